"""SGLangRollout: the Rollout contract in attach mode, against servers that speak SGLang's API on
this machine (embedded engines that the test runs, as an operator would), plus attach mode's own
edges: the controller never stops them, restarts are "wait and verify", a server holding other
weights is told to load the verified ones."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from rollout_contract import RolloutContract, update_all, wait_for

from miles.rollout.engine_client import WeightsIdentity
from miles.rollout.engine_process import EngineProcess, engine_command, free_port
from miles.rollout.rollout import Rollout
from miles.rollout.sglang_rollout import SGLangRollout
from miles.rollout.spec import HealthSettings, RolloutSpec
from miles.rollout.state import ServerState, StateChange, VerifiedWeights
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.asyncio(loop_scope="module")


class ExternalEngine:
    """An engine someone else runs at a fixed address: after a crash, its owner starts it again
    on the same port and its own start checkpoint."""

    def __init__(self, checkpoint: Path, log_dir: Path) -> None:
        self.checkpoint = checkpoint
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_dir = log_dir
        self.process: EngineProcess | None = None

    def start(self) -> None:
        command = engine_command(self.checkpoint, port=self.port, num_threads=1)
        self.process = EngineProcess(command=command, log_path=self._log_dir / f"external-{self.port}.log")
        self.process.start()

    def crash_and_restart(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture(scope="module")
def external(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ExternalEngine]]:
    log_dir = tmp_path_factory.mktemp("external-engines")
    engines = [ExternalEngine(checkpoints["v1"], log_dir) for _ in range(2)]
    try:
        for engine in engines:
            engine.start()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


def attach_spec(checkpoint: Path, urls: list[str], log_dir: Path) -> RolloutSpec:
    return RolloutSpec(
        name="judge",
        checkpoint=checkpoint,
        num_servers=len(urls),
        urls=tuple(urls),
        health=HealthSettings(interval_s=0.2, timeout_s=2.0, failure_threshold=2),
        log_dir=log_dir,
        startup_timeout_s=120,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(
    checkpoints: dict[str, Path], external: list[ExternalEngine], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SGLangRollout]:
    rollout = SGLangRollout(
        attach_spec(checkpoints["v1"], [e.url for e in external], tmp_path_factory.mktemp("attach-logs"))
    )
    await rollout.start()
    try:
        yield rollout
    finally:
        await rollout.stop()


@pytest.fixture
def kill_engine(external: list[ExternalEngine]) -> Callable[[Rollout, str], None]:
    def kill(server: Rollout, server_id: str) -> None:
        url = server.cell(server_id).url
        (engine,) = [e for e in external if e.url == url]
        engine.crash_and_restart()

    return kill


class TestSGLangRolloutAttachedContract(RolloutContract):
    pass


async def test_attached_servers_are_reported_as_attached_and_never_stopped(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    engine = ExternalEngine(checkpoints["v1"], tmp_path)
    engine.start()
    try:
        rollout = SGLangRollout(attach_spec(checkpoints["v1"], [engine.url], tmp_path))
        await rollout.start()
        (snap,) = rollout.snapshot()
        assert snap.state is ServerState.SERVING
        assert snap.placement is not None and snap.placement.attached
        assert snap.pid is None
        await rollout.stop()
        assert rollout.snapshot()[0].state is ServerState.STOPPED
        assert engine.answers(), "stopping an attached rollout must leave its servers running"
    finally:
        engine.stop()


async def test_an_attached_server_on_other_weights_is_given_the_verified_ones(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    engine = ExternalEngine(checkpoints["v2"], tmp_path)
    engine.start()
    try:
        rollout = SGLangRollout(attach_spec(checkpoints["v1"], [engine.url], tmp_path))
        await rollout.start()
        try:
            (snap,) = rollout.snapshot()
            expected = read_manifest(checkpoints["v1"])
            assert snap.state is ServerState.SERVING
            assert snap.checksum == expected.checksum
            assert (await rollout.confirm(snap.server_id)).checksum == expected.checksum
        finally:
            await rollout.stop()
    finally:
        engine.stop()


class _Changes:
    """Records the state changes and drifts a rollout reports."""

    def __init__(self) -> None:
        self.changes: list[StateChange] = []
        self.drifts: list[str] = []

    def state_changed(self, change: StateChange) -> None:
        self.changes.append(change)

    def weights_restored(self, server_id: str, model_name: str, verified: VerifiedWeights) -> None:
        pass

    def weights_written_out(self, model_name: str, checksum: str, checkpoint: Path) -> None:
        pass

    def probed(self, server_id: str) -> None:
        pass

    def drifted(self, server_id: str, model_name: str, *, expected: VerifiedWeights, actual: WeightsIdentity) -> None:
        self.drifts.append(server_id)


async def test_an_attached_server_restarted_between_probes_is_verified_again_as_a_restart(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Its owner restarts it faster than a probe can fail: the new process answers on its own
    start checkpoint. The controller tells it from a drift by the engine's instance, and brings
    it back as a restart, on the verified weights."""
    engine = ExternalEngine(checkpoints["v1"], tmp_path)
    engine.start()
    observer = _Changes()
    # Probes only when woken: the restart below happens between two of them.
    spec = attach_spec(checkpoints["v1"], [engine.url], tmp_path).model_copy(
        update={"health": HealthSettings(interval_s=3600, timeout_s=2.0, failure_threshold=2)}
    )
    rollout = SGLangRollout(spec, observer=observer)
    try:
        await rollout.start()
        await update_all(rollout, checkpoints["v2"])
        (sid,) = rollout.server_ids
        before = rollout.cell(sid).restarts
        engine.crash_and_restart()
        await wait_for(engine.answers, timeout=120, what="the owner's restart to answer")
        rounds = rollout.probe_rounds
        rollout.suspect(sid)
        await wait_for(
            lambda: rollout.probe_rounds > rounds and rollout.cell(sid).state is ServerState.SERVING,
            timeout=120,
            what="the supervisor to look again and the server to serve",
        )
        cell = rollout.cell(sid)
        v2 = read_manifest(checkpoints["v2"])
        assert cell.restarts == before + 1
        assert (await rollout.confirm(sid)).checksum == v2.checksum
        assert observer.drifts == [], "a restart from outside is not a change of weights"
        assert any(
            c.to_state is ServerState.RESTARTING and "restarted outside the controller" in c.reason
            for c in observer.changes
        )
    finally:
        await rollout.stop()
        engine.stop()


async def test_an_attached_server_that_never_answers_fails_start_naming_it(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    spec = attach_spec(checkpoints["v1"], [url], tmp_path).model_copy(update={"startup_timeout_s": 1.0})
    rollout = SGLangRollout(spec)
    with pytest.raises(Exception, match=url):
        await rollout.start()

"""SFTRollout: the RolloutServer contract on real embedded engine processes, plus its own edges."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from rollout_contract import RolloutServerContract

from miles.ray.rollout.rollout_server import RolloutServer, RolloutServerError
from miles.ray.rollout.server_spec import HealthSettings, RolloutServerSpec
from miles.rollout.sft_rollout import SFTRollout

pytestmark = pytest.mark.asyncio(loop_scope="module")


def spec_for(checkpoint: Path, log_dir: Path, *, num_servers: int = 2) -> RolloutServerSpec:
    return RolloutServerSpec(
        name="sft",
        checkpoint=checkpoint,
        num_servers=num_servers,
        health=HealthSettings(interval_s=0.2, timeout_s=2.0, failure_threshold=2),
        num_threads=1,
        log_dir=log_dir,
        startup_timeout_s=120,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SFTRollout]:
    rollout = SFTRollout(spec_for(checkpoints["v1"], tmp_path_factory.mktemp("sft-logs")))
    await rollout.start()
    try:
        yield rollout
    finally:
        await rollout.stop()


@pytest.fixture
def kill_engine() -> Callable[[RolloutServer, str], None]:
    def kill(server: RolloutServer, server_id: str) -> None:
        assert isinstance(server, SFTRollout)
        pid = server.process(server_id).pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)

    return kill


class TestSFTRolloutContract(RolloutServerContract):
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone once reaped, which stop() does.
    return True


async def test_stop_leaves_no_process(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    rollout = SFTRollout(spec_for(checkpoints["v1"], tmp_path, num_servers=1))
    await rollout.start()
    pids = [snap.pid for snap in rollout.snapshot()]
    assert all(pid is not None and _alive(pid) for pid in pids)
    await rollout.stop()
    assert not any(_alive(pid) for pid in pids if pid is not None)
    assert all(snap.state.value == "stopped" for snap in rollout.snapshot())
    await rollout.stop()  # idempotent


async def test_a_server_that_cannot_start_fails_clearly_and_cleans_up(tmp_path: Path) -> None:
    broken = tmp_path / "not-a-checkpoint"
    broken.mkdir()
    (broken / "miles_manifest.json").write_text("{}")
    rollout = SFTRollout(spec_for(broken, tmp_path / "logs", num_servers=1))
    with pytest.raises(RolloutServerError) as caught:
        await rollout.start()
    assert "engine failed to start" in str(caught.value)
    assert all(snap.pid is None for snap in rollout.snapshot())


async def test_both_import_paths_name_the_same_class() -> None:
    from miles.ray.rollout.sft_rollout import SFTRollout as seed_path

    assert seed_path is SFTRollout

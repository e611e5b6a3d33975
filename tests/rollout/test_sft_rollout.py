"""SFTRollout: the Rollout contract on real embedded engine processes, plus its own edges."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from rollout_contract import RolloutContract, RolloutStopContract

from miles.rollout.rollout import Rollout, RolloutError
from miles.rollout.sft_rollout import SFTRollout
from miles.rollout.spec import HealthSettings, RolloutSpec

pytestmark = pytest.mark.asyncio(loop_scope="module")


def spec_for(checkpoint: Path, log_dir: Path, *, num_servers: int = 2) -> RolloutSpec:
    return RolloutSpec(
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
def kill_engine() -> Callable[[Rollout, str], None]:
    def kill(server: Rollout, server_id: str) -> None:
        assert isinstance(server, SFTRollout)
        pid = server.cell(server_id).pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)

    return kill


@pytest.fixture
def new_server(tmp_path: Path) -> Callable[[Path], Rollout]:
    return lambda checkpoint: SFTRollout(spec_for(checkpoint, tmp_path, num_servers=1))


@pytest.fixture
def engine_probe() -> Callable[[Rollout, str], Callable[[], bool]]:
    def probe(server: Rollout, server_id: str) -> Callable[[], bool]:
        pid = server.cell(server_id).pid
        assert pid is not None

        def running() -> bool:
            # The server reaps what it stops, so a stopped engine's pid no longer exists.
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True

        return running

    return probe


class TestSFTRolloutContract(RolloutContract, RolloutStopContract):
    pass


async def test_a_server_that_cannot_start_fails_clearly_and_cleans_up(tmp_path: Path) -> None:
    broken = tmp_path / "not-a-checkpoint"
    broken.mkdir()
    (broken / "miles_manifest.json").write_text("{}")
    rollout = SFTRollout(spec_for(broken, tmp_path / "logs", num_servers=1))
    with pytest.raises(RolloutError) as caught:
        await rollout.start()
    assert "engine failed to start" in str(caught.value)
    assert all(snap.pid is None for snap in rollout.snapshot())


async def test_both_import_paths_name_the_same_class() -> None:
    from miles.ray.rollout.sft_rollout import SFTRollout as seed_path

    assert seed_path is SFTRollout

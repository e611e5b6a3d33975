"""SGLangRollout in launch mode: the controller starts each server with SGLang's command line,
through the parent watch. SGLang itself cannot run here, so a stand-in that takes SGLang's flags
and runs the embedded engine is the launcher (``sglang_standin.py``); the command line itself is
checked against SGLang's own parser in tests/fast/rollout/test_sglang_launch.py."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from miles.rollout.sglang_rollout import SGLangRollout
from miles.rollout.spec import HealthSettings, RolloutSpec, SGLangServerArgs
from miles.rollout.state import ServerState
from miles.testing import process_alive, wait_until
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.asyncio(loop_scope="module")

STANDIN = (sys.executable, str(Path(__file__).parent / "sglang_standin.py"))


def launch_spec(checkpoint: Path, log_dir: Path) -> RolloutSpec:
    return RolloutSpec(
        name="sglang",
        checkpoint=checkpoint,
        num_servers=1,
        devices=("cpu",),
        health=HealthSettings(interval_s=0.2, timeout_s=2.0, failure_threshold=2),
        log_dir=log_dir,
        startup_timeout_s=120,
        sglang=SGLangServerArgs(context_length=256, launcher=STANDIN),
    )


def children(pid: int) -> list[int]:
    """The processes ``pid`` started, from any of its threads."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue  # the thread ended meanwhile
    return found


async def test_launched_server_serves_logs_and_leaves_nothing_behind(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    rollout = SGLangRollout(launch_spec(checkpoints["v1"], tmp_path))
    await rollout.start()
    try:
        (snap,) = rollout.snapshot()
        assert snap.state is ServerState.SERVING
        assert snap.checksum == read_manifest(checkpoints["v1"]).checksum
        assert snap.placement is not None and not snap.placement.attached
        log = (tmp_path / f"{snap.server_id}.log").read_text()
        assert "stand-in for sglang.launch_server: --model-path" in log
        assert "--context-length 256" in log
        info = await rollout.client(snap.server_id).server_info()
        assert info["served_model_name"] == rollout.model_name

        # The wrapper is killed outright (as when the controller's machine kills it): the server
        # goes with it, and the supervisor launches a new one on the verified weights.
        wrapper = snap.pid
        assert wrapper is not None
        (server,) = children(wrapper)
        restarts = snap.restarts
        os.kill(wrapper, signal.SIGKILL)
        await wait_until(lambda: not process_alive(server), what="the server to end with its wrapper", timeout=30)
        await wait_until(
            lambda: (
                rollout.cell(snap.server_id).restarts > restarts
                and rollout.cell(snap.server_id).state is ServerState.SERVING
            ),
            what="the server to be launched again",
            timeout=120,
        )
        wrapper = rollout.cell(snap.server_id).pid
        assert wrapper is not None
        (server,) = children(wrapper)
    finally:
        await rollout.stop()
    assert not process_alive(wrapper) and not process_alive(server)


async def test_a_server_that_refuses_its_arguments_fails_start_with_its_log(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    spec = launch_spec(checkpoints["v1"], tmp_path).model_copy(
        update={"sglang": SGLangServerArgs(tp_size=2, launcher=STANDIN)}
    )
    rollout = SGLangRollout(spec)
    with pytest.raises(Exception, match="tp_size and dp_size must be 1"):
        await rollout.start()

"""VLLMRollout attached to a vLLM server someone else runs: the controller makes it hold the
verified weights and leaves it running when it stops. Its own module, so that the other module's
server is gone while this one starts (two vLLM starts at once on two cores are slow)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from miles.controller.results import UpdateStatus
from miles.rollout.engine_process import free_port
from miles.rollout.runtime import LaunchSlot, Placement
from miles.rollout.spec import VLLMServerArgs
from miles.rollout.state import ServerState
from miles.rollout.vllm_rollout import PROJECT_VLLM_PYTHON, VLLM_PYTHON_ENV, VLLMLaunchCommand, vllm_python
from miles.testing import running_controller, wait_serving
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.skipif(
    not (os.environ.get(VLLM_PYTHON_ENV) or PROJECT_VLLM_PYTHON.is_file()),
    reason="vLLM is not installed: `make vllm` builds it (make test does)",
)

VLLM_MODEL = "small"


def start_standalone(checkpoint: Path, work_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A vLLM server someone else runs (as miles would launch it), for attach mode."""
    args = VLLMServerArgs()
    command = VLLMLaunchCommand(
        python=vllm_python(args),
        served_model_name=VLLM_MODEL,
        max_running_requests=4,
        args=args,
        extra_args=("--enforce-eager",),  # as tests/vllm/test_vllm_rollout.py says why
    )
    slot = LaunchSlot(host="127.0.0.1", port=free_port(), placement=Placement("own", "127.0.0.1"), work_dir=work_dir)
    env = {**os.environ, **command.environment(slot)}
    log = open(work_dir / "server.log", "wb")  # the server writes it until it ends
    process = subprocess.Popen(command.argv(slot, checkpoint), env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return process, f"http://127.0.0.1:{slot.port}"


async def greedy(server_url: str) -> str:
    """A long prompt (its blocks stay in vLLM's prefix cache), answered greedily."""
    body = {"model": VLLM_MODEL, "prompt": "a long prompt that vLLM caches " * 10, "max_tokens": 12, "temperature": 0}
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        answer = await http.post(f"{server_url}/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


async def test_an_attached_vllm_server_is_made_to_hold_the_verified_weights(small, tmp_path: Path) -> None:
    process, server_url = await asyncio.to_thread(start_standalone, small["s1"], tmp_path)
    try:
        log = tmp_path / "server.log"
        await asyncio.to_thread(wait_serving, server_url, process, timeout=300, output=log.read_text)
        # What a fresh vLLM server on s1 answers (its blocks now in the prefix cache).
        fresh = await greedy(server_url)
        # The controller is asked to serve s0 on it.
        spec = {"cls": "VLLMRollout", "checkpoint": small["s0"], "urls": [server_url]}
        async with running_controller({"attached": spec}, http=False, startup_timeout_s=300) as (ctl, _):
            (snap,) = ctl.fleet.rollout(VLLM_MODEL).snapshot()
            assert snap.state is ServerState.SERVING and snap.placement is not None and snap.placement.attached
            assert snap.checksum == read_manifest(small["s0"]).checksum
            assert await greedy(server_url) != fresh
            # Back on s1 after an update: the fresh server's answer, not one from a cached block.
            result = await ctl.update_rollout_weights(small["s1"], model_name=VLLM_MODEL)
            assert result.status is UpdateStatus.COMMITTED, result.message
            assert await greedy(server_url) == fresh
        # The controller stopped; the server is its owner's and still runs.
        assert process.poll() is None
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 60)

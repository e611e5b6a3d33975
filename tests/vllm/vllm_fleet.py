"""What the vLLM tests share: the package's controller (``fleet`` in conftest.py: ``small`` on a
real vLLM server, ``tiny`` on an embedded engine beside it), and how they talk to it and look at
its processes."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from miles.controller.results import UpdateStatus
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.rollout.state import ServerState
from miles.testing import copy_checkpoint, descendants, wait_until
from miles.weights.checksum import saved_state_dict

VLLM_MODEL = "small"
# torch.compile's warm-up is most of a vLLM start on this CPU (and all of it cold, in CI): the tests
# show behaviour, so their servers run eagerly; benchmarks/vllm.py measures vLLM's default.
EAGER = ("--enforce-eager",)
# Serving versions never go back: each update of any module takes the next one.
versions = itertools.count(100)


async def complete(url: str, prompt: str, *, model: str = VLLM_MODEL, tokens: int = 8) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
        return await http.post(f"{url}/v1/completions", json=body)


async def greedy(url: str, prompt: str) -> str:
    answer = await complete(url, prompt)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


async def update(ctl: AsyncInferenceController, checkpoint: Path) -> UpdateStatus:
    result = await ctl.update_rollout_weights(checkpoint, model_name=VLLM_MODEL, weight_version=str(next(versions)))
    return result.status


def corrupted(source: Path, target: Path) -> Path:
    """A copy of ``source`` with one bit of its last tensor flipped (its manifest unchanged)."""
    copy_checkpoint(source, target)
    with open(target / "model.safetensors", "r+b") as file:
        file.seek(-64, os.SEEK_END)
        byte = file.read(1)
        file.seek(-64, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0x40]))
    return target


def weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoint))


def vllm_server(ctl: AsyncInferenceController):  # type: ignore[no-untyped-def]
    return ctl.fleet.rollout(VLLM_MODEL).snapshot()[0]


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def worker_of(wrapper: int) -> int:
    """The pid of the vLLM worker under a server's wrapper (vLLM names its processes)."""
    workers = [pid for pid in descendants(wrapper) if "::Worker" in title(pid)]
    assert len(workers) == 1, {pid: title(pid) for pid in descendants(wrapper)}
    return workers[0]


async def wait_serving_again(ctl: AsyncInferenceController, *, restarts: int) -> None:
    def back() -> bool:
        snap = vllm_server(ctl)
        return snap.state is ServerState.SERVING and snap.restarts >= restarts

    await wait_until(back, timeout=300, what="the vLLM server restarted and serving verified weights")

"""The GPU paths, on a CUDA machine (skipped elsewhere; ``benchmarks/gpu_check.sh`` runs them):
an engine on a GPU, a staged update there, and pushes into it over shared memory (from CPU
tensors), by CUDA IPC handle and over NCCL (from the trainer's GPU tensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.controller.results import UpdateStatus
from miles.rollout.state import ServerState
from miles.testing import running_controller
from miles.train.push import PushPublisher
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import saved_state_dict

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(600),
]


def cuda_fleet(checkpoints: dict[str, Path]) -> dict[str, object]:
    return {"tiny": {"checkpoint": checkpoints["v1"], "num_servers": 1, "devices": ("cuda:0",)}}


async def test_an_engine_on_a_gpu_updates_from_disk_staged(checkpoints: dict[str, Path]) -> None:
    async with running_controller(cuda_fleet(checkpoints)) as (ctl, _):
        (server,) = ctl.health().servers
        assert server.device == "cuda:0" and server.gpu_ids == [0]
        result = await ctl.update_rollout_weights(checkpoints["v2"])
        assert result.status is UpdateStatus.COMMITTED, result.message
        assert ctl.health().servers[0].checksum == read_manifest(checkpoints["v2"]).checksum


# shm from GPU tensors goes by CUDA IPC handle; from host tensors through a shared-memory segment.
@pytest.mark.parametrize(("path", "device"), [("shm", "cpu"), ("shm", "cuda"), ("distributed", "cuda")])
async def test_pushes_into_a_gpu_engine(checkpoints: dict[str, Path], path: str, device: str) -> None:
    named = {
        n: t.to(device) for n, t in saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoints["v2"])).items()
    }
    async with running_controller(cuda_fleet(checkpoints)) as (ctl, _):
        result = await PushPublisher(ctl, path=path, timeout_s=120).push(named, step=7)
        assert result.checksum == read_manifest(checkpoints["v2"]).checksum
        (server,) = ctl.health().servers
        assert server.state is ServerState.SERVING and server.checksum == result.checksum

"""The ``small`` model's checkpoints, for every vLLM test (vLLM's CPU attention refuses the
``tiny`` preset's head size), and the controller the package's modules share."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from vllm_fleet import EAGER

from miles.models import build_model, build_tokenizer
from miles.models.presets import init_checkpoint
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.testing import running_controller
from miles.weights.checksum import model_checksum


@pytest.fixture(scope="package")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """``s0`` and ``s1``: sealed checkpoints (steps 0 and 1); ``plain-a`` and ``plain-b``: what a
    trainer writes with save_pretrained, no manifest (their checksums beside them)."""
    root = tmp_path_factory.mktemp("small")
    made: dict[str, Path | str] = {}
    for name, seed, step in (("s0", 0, 0), ("s1", 1, 1)):
        init_checkpoint(root / name, model_name="small", preset="small", seed=seed, step=step)
        made[name] = root / name
    for name, seed in (("plain-a", 2), ("plain-b", 3)):
        model = build_model("small", seed=seed)
        model.save_pretrained(root / name)
        build_tokenizer().save_pretrained(root / name)
        made[name], made[f"{name}-checksum"] = root / name, model_checksum(model)
    return made


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def fleet(
    small: dict[str, Path], checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[AsyncInferenceController, str]]:
    """One controller for the package's modules (a vLLM start is tens of seconds here): ``small``
    on one vLLM server, ``tiny`` on an embedded engine."""
    specs = {
        "vllm": {
            "cls": "VLLMRollout",
            "checkpoint": small["s0"],
            "num_servers": 1,
            "max_running_requests": 8,
            "engine_args": EAGER,
        },
        "embedded": {"cls": "SFTRollout", "checkpoint": checkpoints["v1"], "num_servers": 1},
    }
    state_dir = tmp_path_factory.mktemp("vllm-controller")
    async with running_controller(specs, num_servers=1, state_dir=state_dir, startup_timeout_s=300) as (ctl, url):
        assert url is not None
        yield ctl, url

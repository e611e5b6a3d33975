"""The controller the vLLM tests share (on the ``small`` model's checkpoints: vLLM's CPU attention
refuses the ``tiny`` preset's head size)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from vllm_fleet import EAGER

from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.testing import running_controller


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

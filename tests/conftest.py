"""Shared fixtures: tiny real checkpoints built from configs, and the environment every test needs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Nothing in the suite may reach a model hub; fail loudly instead of downloading.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two versions of one tiny model (``v1``, ``v2``: same architecture, different weights)."""
    from miles.models.presets import init_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for name, seed, step in (("v1", 0, 1), ("v2", 1, 2)):
        init_checkpoint(root / name, model_name="tiny", preset="tiny", seed=seed, step=step)
        made[name] = root / name
    return made

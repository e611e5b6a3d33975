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
    """Versions of one tiny model (``v1``..``v4``: same architecture, different weights, steps 1-4)
    and ``b1``, step 1 of a second model ``tiny-b``."""
    from miles.models.presets import init_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for name, model, seed, step in (
        ("v1", "tiny", 0, 1),
        ("v2", "tiny", 1, 2),
        ("v3", "tiny", 2, 3),
        ("v4", "tiny", 3, 4),
        ("b1", "tiny-b", 10, 1),
    ):
        init_checkpoint(root / name, model_name=model, preset="tiny", seed=seed, step=step)
        made[name] = root / name
    return made


def pytest_configure(config: pytest.Config) -> None:
    # save_pretrained draws a progress bar per checkpoint; in test output it is only noise.
    import transformers

    transformers.utils.logging.disable_progress_bar()

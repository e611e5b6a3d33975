"""The ``small`` model's checkpoints, for every vLLM test (vLLM's CPU attention refuses the
``tiny`` preset's head size)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.models import build_model, build_tokenizer
from miles.models.presets import init_checkpoint
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

"""The engine's disk load when a checkpoint's weights file is cut short after it was verified (a
trainer saving again in place): read, never memory-mapped, the copy fails with an error rather
than the process dying of SIGBUS, and what the model then holds is hashed for what it is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles.engine.weights.sources import open_verified
from miles.engine.weights.stage import LiveStage
from miles.errors import CheckpointError
from miles.models import build_model, build_tokenizer
from miles.weights.checkpoint import save_checkpoint
from miles.weights.checksum import checksum_module


def test_a_file_cut_after_verification_makes_an_in_place_copy_that_cannot_match(tmp_path: Path) -> None:
    manifest = save_checkpoint(
        tmp_path / "v2", model=build_model("tiny", seed=2), tokenizer=build_tokenizer(), model_name="t", step=2
    )
    model = build_model("tiny", seed=1)
    with open_verified(model, tmp_path / "v2") as checkpoint:
        os.truncate(tmp_path / "v2" / "model.safetensors", 1024)
        stage = LiveStage(model)
        with pytest.raises((OSError, CheckpointError)):
            checkpoint.write(stage)
        checksum = stage.checksum()
    assert checksum.checksum != manifest.checksum
    assert checksum.checksum == checksum_module(model).checksum  # what the model holds now

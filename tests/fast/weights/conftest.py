"""Fixtures for the weights tests: tiny real models and real checkpoints on disk."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from miles.models import build_model, build_tokenizer
from miles.weights.checkpoint import Manifest, save_checkpoint


@pytest.fixture
def tiny_model() -> PreTrainedModel:
    return build_model("tiny", seed=0)


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, Manifest]]:
    """Save a tiny model as a checkpoint under tmp_path; returns (directory, manifest)."""

    def make(
        name: str = "ck", *, preset: str = "tiny", seed: int = 0, step: int = 3, max_shard_size: str | None = None
    ) -> tuple[Path, Manifest]:
        out = tmp_path / name
        manifest = save_checkpoint(
            out,
            model=build_model(preset, seed=seed),
            tokenizer=build_tokenizer(),
            model_name="tiny-test",
            step=step,
            max_shard_size=max_shard_size,
        )
        return out, manifest

    return make


def _rewrite_safetensors(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load a safetensors file, let ``change`` edit the tensors in place, write it back."""
    tensors = {name: t.clone() for name, t in load_file(path).items()}
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _tensor_offset(path: Path, name: str) -> int:
    """Absolute file offset of tensor ``name``'s first byte (read from the header by hand)."""
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    return 8 + header_len + header[name]["data_offsets"][0]


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# The helpers are handed out as fixtures so test modules need not import this conftest by name.


@pytest.fixture
def rewrite_safetensors() -> Callable[[Path, Callable[[dict[str, torch.Tensor]], None]], None]:
    return _rewrite_safetensors


@pytest.fixture
def tensor_offset() -> Callable[[Path, str], int]:
    return _tensor_offset


@pytest.fixture
def flip_byte() -> Callable[[Path, int], None]:
    return _flip_byte

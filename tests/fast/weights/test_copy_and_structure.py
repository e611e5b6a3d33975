"""Copying weights in place while checksumming them, and structure-only verification."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from miles.errors import UnsupportedTensorError
from miles.models import build_model
from miles.weights.checkpoint import ProblemKind, open_checkpoint, verify_checkpoint
from miles.weights.checksum import checksum_module, copy_and_checksum, saved_state_dict


def test_copy_and_checksum_equals_a_checksum_of_the_result(make_checkpoint: Callable) -> None:
    directory, manifest = make_checkpoint(seed=5)
    model = build_model("tiny", seed=0)
    targets = saved_state_dict(model)
    with open_checkpoint(directory) as reader:
        result = copy_and_checksum(targets, reader.tensor, threads=2)
    assert result.checksum == manifest.checksum
    assert checksum_module(model).checksum == manifest.checksum


def test_copy_and_checksum_hashes_the_targets_not_the_source() -> None:
    # Large enough for several slices; the target is bfloat16 so the bytes are what torch holds.
    target = {"w": torch.zeros(3 * 1024 * 1024, dtype=torch.bfloat16)}
    source = torch.randn(3 * 1024 * 1024).to(torch.bfloat16)
    result = copy_and_checksum(target, lambda _: source, threads=1)
    assert torch.equal(target["w"], source)
    assert result.checksum == checksum_module_like(target)


def checksum_module_like(state: dict[str, torch.Tensor]) -> str:
    from miles.weights.checksum import checksum_state_dict

    return checksum_state_dict(state).checksum


def test_copy_and_checksum_refuses_a_mismatched_source() -> None:
    with pytest.raises(UnsupportedTensorError):
        copy_and_checksum({"w": torch.zeros(4)}, lambda _: torch.zeros(5), threads=1)
    with pytest.raises(UnsupportedTensorError):
        copy_and_checksum({"w": torch.zeros(4)}, lambda _: torch.zeros(4, dtype=torch.float64), threads=1)


def test_structure_only_verification_catches_truncation_but_reads_no_bytes(
    make_checkpoint: Callable, tmp_path: Path
) -> None:
    directory, _ = make_checkpoint()
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0x40  # flipped bytes: invisible without hashing
    weights.write_bytes(bytes(data))
    structural = verify_checkpoint(directory, digests=False)
    assert structural.ok and structural.checksum is None
    assert [p.kind for p in verify_checkpoint(directory).problems] == [ProblemKind.DIGEST_MISMATCH]
    weights.write_bytes(bytes(data[:-100]))
    assert [p.kind for p in verify_checkpoint(directory, digests=False).problems] == [ProblemKind.TRUNCATED_FILE]

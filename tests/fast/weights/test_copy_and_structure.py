"""Copying a tensor while digesting what was written, and structure-only verification."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from miles.weights.checkpoint import ProblemKind, verify_checkpoint
from miles.weights.checksum import digest_tensor
from miles.weights.digest import copy_and_digest


def test_copy_and_digest_hashes_the_target_not_the_source() -> None:
    # Several slices and chunks, a last chunk short; bfloat16, so the bytes are what torch holds.
    target = torch.zeros(3 * 1024 * 1024 + 77, dtype=torch.bfloat16)
    source = torch.randn(3 * 1024 * 1024 + 77).to(torch.bfloat16)
    digest = copy_and_digest(target, source)
    assert torch.equal(target, source)
    assert digest == digest_tensor(target)
    strided = torch.zeros(7, 5)
    assert copy_and_digest(strided.t(), source[:35].float().reshape(5, 7)) == digest_tensor(strided.t())


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

"""CheckpointReader: zero-copy tensors over the mapped files, the engine's load path, verification."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.errors import CheckpointError, CheckpointFileTruncatedError, ManifestMissingError
from miles.models import build_model
from miles.weights.checkpoint import MANIFEST_NAME, ProblemKind, open_checkpoint
from miles.weights.checksum import checksum_module

MakeCheckpoint = Callable[..., tuple[Path, Any]]


def test_tensors_equal_the_model(make_checkpoint: MakeCheckpoint) -> None:
    directory, manifest = make_checkpoint()
    model = build_model("tiny", seed=0)
    state = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with open_checkpoint(directory) as reader:
            assert reader.manifest == manifest
            assert reader.tensor_names == tuple(sorted(state))
            for name in reader.tensor_names:
                tensor = reader.tensor(name)
                assert torch.equal(tensor, state[name]), name
                assert tensor.dtype == state[name].dtype and tensor.device.type == "cpu"
            info = reader.info("model.norm.weight")
            assert (info.dtype, info.shape, info.file, info.nbytes) == (torch.float32, (64,), "model.safetensors", 256)


def test_a_tensor_handed_out_is_the_callers_own(make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    before = (directory / "model.safetensors").read_bytes()
    with open_checkpoint(directory) as reader:
        reader.tensor("model.norm.weight").fill_(42.0)
        # Neither the file nor what the reader reads next changed.
        assert reader.verify().ok
        assert not torch.equal(reader.tensor("model.norm.weight"), torch.full((64,), 42.0))
    assert (directory / "model.safetensors").read_bytes() == before


CUT_WHILE_OPEN = """
import os, sys
from miles.errors import CheckpointFileTruncatedError
from miles.weights.checkpoint import open_checkpoint
directory = sys.argv[1]
path = os.path.join(directory, "model.safetensors")
with open_checkpoint(directory) as reader:
    os.truncate(path, 1024)  # a trainer saving again in place, after the reader opened the file
    for attempt in (lambda: reader.verify(threads=1), lambda: reader.tensor("lm_head.weight")):
        try:
            result = attempt()
        except CheckpointFileTruncatedError as exc:
            print("refused:", exc)
        else:
            print("not refused:", result)
"""


def test_a_file_cut_short_while_open_is_an_error_not_a_crash(make_checkpoint: MakeCheckpoint) -> None:
    """A memory-mapped file cut short kills the process that touches a page past its new end
    (SIGBUS): run in a process of its own, so the suite would see that as a failure, not die."""
    directory, _ = make_checkpoint()
    done = subprocess.run(
        [sys.executable, "-c", CUT_WHILE_OPEN, str(directory)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    assert all(line.startswith("refused:") and "cut or rewritten meanwhile" in line for line in lines), lines


def test_engine_load_path_reproduces_the_checksum(make_checkpoint: MakeCheckpoint) -> None:
    directory, manifest = make_checkpoint(max_shard_size="40KB")
    live = build_model("tiny", seed=99)
    assert checksum_module(live).checksum != manifest.checksum
    with open_checkpoint(directory) as reader:
        report = reader.verify()
        assert report.ok and report.checksum == manifest.checksum
        params = dict(live.state_dict(keep_vars=True))
        assert set(params) == set(reader.tensor_names)
        with torch.no_grad():
            for name in reader.tensor_names:
                info = reader.info(name)
                assert (info.dtype, info.shape) == (params[name].dtype, tuple(params[name].shape))
                params[name].copy_(reader.tensor(name))
    assert checksum_module(live).checksum == manifest.checksum


def test_verify_finds_corruption(
    make_checkpoint: MakeCheckpoint, tensor_offset: Callable[..., int], flip_byte: Callable[..., None]
) -> None:
    directory, _ = make_checkpoint()
    path = directory / "model.safetensors"
    flip_byte(path, tensor_offset(path, "lm_head.weight") + 3)
    with open_checkpoint(directory) as reader:
        report = reader.verify(threads=1)
    assert [(p.kind, p.tensor) for p in report.problems] == [(ProblemKind.DIGEST_MISMATCH, "lm_head.weight")]


def test_verify_finds_an_edited_manifest(make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    data = json.loads((directory / MANIFEST_NAME).read_text())
    data["tensors"]["model.norm.weight"]["shape"] = [65]
    (directory / MANIFEST_NAME).write_text(json.dumps(data))
    with open_checkpoint(directory) as reader:
        kinds = sorted(p.kind for p in reader.verify().problems)
    assert kinds == [ProblemKind.CHECKSUM_MISMATCH, ProblemKind.WRONG_SHAPE]


def test_open_refuses_broken_checkpoints(make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    path = directory / "model.safetensors"
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(CheckpointFileTruncatedError):
        open_checkpoint(directory)
    (directory / MANIFEST_NAME).unlink()
    with pytest.raises(ManifestMissingError):
        open_checkpoint(directory)


def test_unknown_names_and_closed_reader(make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    reader = open_checkpoint(directory)
    with pytest.raises(CheckpointError, match="no tensor"):
        reader.tensor("nope")
    kept = reader.tensor("model.norm.weight")
    expected = kept.clone()
    reader.close()
    with pytest.raises(CheckpointError, match="closed"):
        reader.tensor("model.norm.weight")
    # A tensor taken before close stays valid.
    assert torch.equal(kept, expected)
    del kept
    reader.close()  # idempotent

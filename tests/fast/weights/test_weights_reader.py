"""CheckpointReader: zero-copy tensors over the mapped files, the engine's load path, verification."""

from __future__ import annotations

import json
import os
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


def test_tensors_equal_the_model_and_are_views_of_the_map(
    make_checkpoint: MakeCheckpoint, tensor_offset: Callable[..., int]
) -> None:
    directory, manifest = make_checkpoint()
    model = build_model("tiny", seed=0)
    state = model.state_dict()
    path = directory / "model.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # frombuffer over a read-only buffer would warn
        with open_checkpoint(directory) as reader:
            assert reader.manifest == manifest
            assert reader.tensor_names == tuple(sorted(state))
            tensors = {name: reader.tensor(name) for name in reader.tensor_names}
            for name, tensor in tensors.items():
                assert torch.equal(tensor, state[name]), name
                assert tensor.dtype == state[name].dtype and tensor.device.type == "cpu"
            info = reader.info("model.norm.weight")
            assert (info.dtype, info.shape, info.file, info.nbytes) == (torch.float32, (64,), "model.safetensors", 256)
            # No copies: every tensor sits in one mapping, at its own offset in the file.
            a, b = "model.embed_tokens.weight", "model.norm.weight"
            distance = tensors[b].data_ptr() - tensors[a].data_ptr()
            assert distance == tensor_offset(path, b) - tensor_offset(path, a)


def test_tensors_are_copy_on_write(make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    before = (directory / "model.safetensors").read_bytes()
    with open_checkpoint(directory) as reader:
        reader.tensor("model.norm.weight").fill_(42.0)
        # verify() checks the bytes this reader hands out, which now differ ...
        assert [p.tensor for p in reader.verify().problems] == ["model.norm.weight"]
    # ... but the write stayed private: the file is untouched.
    assert (directory / "model.safetensors").read_bytes() == before
    with open_checkpoint(directory) as reader:
        assert reader.verify().ok


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
    # A tensor taken before close keeps its mapping alive.
    assert torch.equal(kept, expected)
    del kept
    reader.close()  # idempotent

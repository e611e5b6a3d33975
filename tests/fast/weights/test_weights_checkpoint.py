"""Checkpoints: atomic writes, manifests from the files, and every corruption named by its kind."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from miles.errors import (
    CheckpointExistsError,
    CheckpointFileMissingError,
    CheckpointVerificationError,
    ChecksumMismatchError,
    ManifestInvalidError,
    ManifestMissingError,
)
from miles.models import build_model
from miles.models.presets import PRESETS
from miles.weights.checkpoint import (
    MANIFEST_NAME,
    ProblemKind,
    read_manifest,
    save_checkpoint,
    seal_checkpoint,
    verify_checkpoint,
    verify_checkpoint_or_raise,
)
from miles.weights.checksum import checksum_module, checksum_safetensors

MakeCheckpoint = Callable[..., tuple[Path, Any]]


def _kinds(directory: Path) -> list[ProblemKind]:
    return [p.kind for p in verify_checkpoint(directory).problems]


def test_save_writes_a_verified_checkpoint(make_checkpoint: MakeCheckpoint) -> None:
    directory, manifest = make_checkpoint(step=3)
    assert {"config.json", "model.safetensors", "tokenizer.json", MANIFEST_NAME} <= set(os.listdir(directory))
    assert manifest.model_name == "tiny-test"
    assert manifest.step == 3 and manifest.weight_version == "3"
    assert manifest.algorithm == "xxh3_128_chunked"
    assert manifest.created_at.tzinfo == UTC
    assert manifest.files == {"model.safetensors": (directory / "model.safetensors").stat().st_size}
    assert manifest.checksum == checksum_module(build_model("tiny", seed=0)).checksum
    assert manifest.checksum == checksum_safetensors(directory).checksum
    assert read_manifest(directory) == manifest

    report = verify_checkpoint(directory)
    assert report.ok and report.problems == ()
    assert report.checksum == manifest.checksum
    assert verify_checkpoint_or_raise(directory) == manifest
    # Nothing but the checkpoint itself is left in the parent.
    assert os.listdir(directory.parent) == [directory.name]


def test_sharded_checkpoint_verifies(make_checkpoint: MakeCheckpoint) -> None:
    directory, manifest = make_checkpoint(max_shard_size="40KB")
    assert len(manifest.files) > 2
    assert (directory / "model.safetensors.index.json").exists()
    assert {entry.file for entry in manifest.tensors.values()} == set(manifest.files)
    assert verify_checkpoint(directory).ok


def test_explicit_weight_version(tmp_path: Path) -> None:
    manifest = save_checkpoint(
        tmp_path / "ck", model=build_model("tiny", seed=0), model_name="m", step=9, weight_version="v9-rc"
    )
    assert manifest.weight_version == "v9-rc"


# --- every corruption is named ----------------------------------------------------------------


def test_missing_manifest(make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    (directory / MANIFEST_NAME).unlink()
    report = verify_checkpoint(directory)
    assert [p.kind for p in report.problems] == [ProblemKind.MISSING_MANIFEST]
    assert report.manifest is None and report.checksum is None
    assert "seal" in report.problems[0].message
    with pytest.raises(ManifestMissingError, match="no miles_manifest.json"):
        read_manifest(directory)


def test_manifest_not_json(make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    (directory / MANIFEST_NAME).write_text("{not json")
    assert _kinds(directory) == [ProblemKind.INVALID_MANIFEST]
    with pytest.raises(ManifestInvalidError, match="not JSON"):
        read_manifest(directory)


def test_a_manifest_nested_too_deeply_to_parse_is_invalid(make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    (directory / MANIFEST_NAME).write_text("[" * 200_000 + "]" * 200_000)
    assert _kinds(directory) == [ProblemKind.INVALID_MANIFEST]
    with pytest.raises(ManifestInvalidError, match="not JSON"):
        read_manifest(directory)


def test_a_header_nested_too_deeply_to_parse_is_an_invalid_file(make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    path = directory / "model.safetensors"
    size = path.stat().st_size
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    nested = b"[" * (header_len // 2) + b"]" * (header_len // 2)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(nested.ljust(header_len, b" "))
    assert path.stat().st_size == size
    assert _kinds(directory) == [ProblemKind.INVALID_FILE]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("step", -1),
        ("algorithm", "sha256"),
        ("algorithm", "xxh3_128"),
        ("surprise", 1),
        ("checksum", "xyz"),
        ("format_version", 2),
        ("files", {"../outside.safetensors": 1}),
        ("created_at", "2024-01-01T00:00:00"),
    ],
)
def test_manifest_invalid_fields_are_named(make_checkpoint: MakeCheckpoint, field: str, value: object) -> None:
    directory, _ = make_checkpoint()
    data = json.loads((directory / MANIFEST_NAME).read_text())
    data[field] = value
    (directory / MANIFEST_NAME).write_text(json.dumps(data))
    assert _kinds(directory) == [ProblemKind.INVALID_MANIFEST]
    with pytest.raises(ManifestInvalidError, match=field):
        read_manifest(directory)


def test_deleted_shard_is_missing_file_only(make_checkpoint: MakeCheckpoint) -> None:
    directory, manifest = make_checkpoint(max_shard_size="40KB")
    victim = sorted(manifest.files)[1]
    (directory / victim).unlink()
    report = verify_checkpoint(directory)
    # The tensors of the missing file are covered by the file's problem, not repeated.
    assert [(p.kind, p.file) for p in report.problems] == [(ProblemKind.MISSING_FILE, victim)]
    assert report.checksum is None


@pytest.mark.parametrize("keep", [4, 20, -100])
def test_truncated_file(make_checkpoint: MakeCheckpoint, keep: int) -> None:
    directory, _ = make_checkpoint()
    path = directory / "model.safetensors"
    size = path.stat().st_size
    os.truncate(path, keep if keep > 0 else size + keep)
    report = verify_checkpoint(directory)
    assert [p.kind for p in report.problems] == [ProblemKind.TRUNCATED_FILE]
    assert report.problems[0].file == "model.safetensors"


def test_malformed_header_is_invalid_file(make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    path = directory / "model.safetensors"
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"[[[[")
    assert _kinds(directory) == [ProblemKind.INVALID_FILE]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("victim", ["model.safetensors", "miles_manifest.json"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(make_checkpoint: MakeCheckpoint, victim: str) -> None:
    # Opening a FIFO blocks until a writer appears; a checkpoint someone shaped this way must be
    # refused at once, not hang the update that reads it.
    directory, _ = make_checkpoint()
    (directory / victim).unlink()
    os.mkfifo(directory / victim)
    report = verify_checkpoint(directory)
    assert not report.ok
    assert "regular file" in "; ".join(p.message for p in report.problems)


def test_flipped_bytes_name_the_tensor(
    make_checkpoint: MakeCheckpoint, tensor_offset: Callable[..., int], flip_byte: Callable[..., None]
) -> None:
    directory, manifest = make_checkpoint()
    path = directory / "model.safetensors"
    flip_byte(path, tensor_offset(path, "model.layers.1.mlp.up_proj.weight") + 17)
    report = verify_checkpoint(directory)
    assert [(p.kind, p.tensor) for p in report.problems] == [
        (ProblemKind.DIGEST_MISMATCH, "model.layers.1.mlp.up_proj.weight")
    ]
    problem = report.problems[0]
    assert problem.expected == manifest.tensors["model.layers.1.mlp.up_proj.weight"].digest
    assert problem.actual != problem.expected
    assert report.checksum != manifest.checksum
    with pytest.raises(CheckpointVerificationError, match="digest_mismatch") as excinfo:
        verify_checkpoint_or_raise(directory)
    assert excinfo.value.report == report


def test_removed_and_added_tensors(make_checkpoint: MakeCheckpoint, rewrite_safetensors: Callable[..., None]) -> None:
    directory, _ = make_checkpoint()

    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.norm.weight"]
        tensors["model.extra.weight"] = torch.zeros(3)

    rewrite_safetensors(directory / "model.safetensors", change)
    report = verify_checkpoint(directory)
    assert sorted((p.kind, p.tensor) for p in report.problems) == [
        (ProblemKind.EXTRA_TENSOR, "model.extra.weight"),
        (ProblemKind.MISSING_TENSOR, "model.norm.weight"),
    ]


def test_wrong_shape(make_checkpoint: MakeCheckpoint, rewrite_safetensors: Callable[..., None]) -> None:
    directory, _ = make_checkpoint()
    name = "model.layers.0.mlp.down_proj.weight"

    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].reshape(-1).contiguous()  # same bytes, other shape

    rewrite_safetensors(directory / "model.safetensors", change)
    report = verify_checkpoint(directory)
    assert [(p.kind, p.tensor) for p in report.problems] == [(ProblemKind.WRONG_SHAPE, name)]
    assert report.problems[0].expected == "[64, 128]" and report.problems[0].actual == "[8192]"


def test_wrong_dtype(make_checkpoint: MakeCheckpoint, rewrite_safetensors: Callable[..., None]) -> None:
    directory, _ = make_checkpoint()
    name = "model.layers.0.self_attn.q_proj.weight"

    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].view(torch.int32)  # same bytes, other dtype

    rewrite_safetensors(directory / "model.safetensors", change)
    report = verify_checkpoint(directory)
    assert [(p.kind, p.tensor, p.expected, p.actual) for p in report.problems] == [
        (ProblemKind.WRONG_DTYPE, name, "float32", "int32")
    ]


def test_edited_manifest_checksum(make_checkpoint: MakeCheckpoint) -> None:
    directory, manifest = make_checkpoint()
    data = json.loads((directory / MANIFEST_NAME).read_text())
    data["checksum"] = "0" * 32
    (directory / MANIFEST_NAME).write_text(json.dumps(data))
    report = verify_checkpoint(directory)
    assert [(p.kind, p.expected, p.actual) for p in report.problems] == [
        (ProblemKind.CHECKSUM_MISMATCH, "0" * 32, manifest.checksum)
    ]


# --- atomic writes -----------------------------------------------------------------------------


def test_existing_target_is_refused(make_checkpoint: MakeCheckpoint, tmp_path: Path) -> None:
    directory, manifest = make_checkpoint()
    with pytest.raises(CheckpointExistsError, match="overwrite"):
        save_checkpoint(directory, model=build_model("tiny", seed=1), model_name="m", step=0)
    assert read_manifest(directory) == manifest
    assert os.listdir(tmp_path) == [directory.name]


def test_overwrite_replaces_the_checkpoint(make_checkpoint: MakeCheckpoint, tmp_path: Path) -> None:
    directory, old = make_checkpoint()
    (directory / "stale.txt").write_text("from the old checkpoint")
    new = save_checkpoint(directory, model=build_model("tiny", seed=1), model_name="m", step=4, overwrite=True)
    assert new.checksum != old.checksum
    assert read_manifest(directory) == new
    assert not (directory / "stale.txt").exists()
    assert verify_checkpoint(directory).ok
    assert os.listdir(tmp_path) == [directory.name]


class _ExplodingSave(LlamaForCausalLM):
    """A real model whose save writes its files and then fails, like a crash mid-write."""

    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> None:
        super().save_pretrained(save_directory, **kwargs)
        raise OSError("disk full (scripted)")


class _DriftingSave(LlamaForCausalLM):
    """A real model whose weights change after they were written: files and memory disagree."""

    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> None:
        super().save_pretrained(save_directory, **kwargs)
        with torch.no_grad():
            self.model.norm.weight.add_(1.0)


def _scripted(cls: type) -> Any:
    return cls(PRESETS["tiny"].build_config())


@pytest.mark.parametrize("overwrite", [False, True])
def test_failed_save_leaves_nothing_behind(tmp_path: Path, overwrite: bool) -> None:
    target = tmp_path / "ck"
    with pytest.raises(OSError, match="scripted"):
        save_checkpoint(target, model=_scripted(_ExplodingSave), model_name="m", step=0, overwrite=overwrite)
    assert os.listdir(tmp_path) == []


def test_failed_overwrite_keeps_the_old_checkpoint(make_checkpoint: MakeCheckpoint, tmp_path: Path) -> None:
    directory, old = make_checkpoint()
    with pytest.raises(OSError, match="scripted"):
        save_checkpoint(directory, model=_scripted(_ExplodingSave), model_name="m", step=1, overwrite=True)
    assert read_manifest(directory) == old
    assert verify_checkpoint(directory).ok
    assert os.listdir(tmp_path) == [directory.name]


def test_files_that_differ_from_memory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ChecksumMismatchError) as excinfo:
        save_checkpoint(tmp_path / "ck", model=_scripted(_DriftingSave), model_name="m", step=0)
    assert excinfo.value.context["expected"] != excinfo.value.context["actual"]
    assert os.listdir(tmp_path) == []


# --- sealing a directory users bring ----------------------------------------------------------


def test_seal_a_plain_hugging_face_directory(tiny_model: Any, tmp_path: Path) -> None:
    tiny_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert _kinds(tmp_path) == [ProblemKind.MISSING_MANIFEST]
    manifest = seal_checkpoint(tmp_path, model_name="brought", step=12)
    assert manifest.weight_version == "12"
    assert manifest.checksum == checksum_module(tiny_model).checksum
    assert verify_checkpoint(tmp_path).ok
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_reseal_accepts_changed_files(
    make_checkpoint: MakeCheckpoint, tensor_offset: Callable[..., int], flip_byte: Callable[..., None]
) -> None:
    directory, old = make_checkpoint()
    path = directory / "model.safetensors"
    flip_byte(path, tensor_offset(path, "model.norm.weight"))
    assert _kinds(directory) == [ProblemKind.DIGEST_MISMATCH]
    new = seal_checkpoint(directory, model_name="tiny-test", step=4)
    assert new.checksum != old.checksum
    assert verify_checkpoint(directory).ok


def test_seal_without_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFileMissingError):
        seal_checkpoint(tmp_path, model_name="m", step=0)
    with pytest.raises(CheckpointFileMissingError):
        seal_checkpoint(tmp_path / "absent", model_name="m", step=0)

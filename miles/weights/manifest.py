"""The checkpoint manifest (``miles_manifest.json``): what a checkpoint holds and its checksum.

A manifest is computed from the written files, never from memory, so it describes exactly the
bytes a rollout server will load.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from miles.errors import (
    CheckpointError,
    CheckpointFileInvalidError,
    CheckpointFileMissingError,
    ManifestInvalidError,
    ManifestMissingError,
)
from miles.weights.checksum import ALGORITHM, TensorDigest, checksum_files, combine_digests
from miles.weights.safetensors_io import index_files, open_regular

MANIFEST_NAME = "miles_manifest.json"
FORMAT_VERSION = 1


class TensorEntry(BaseModel):
    """One tensor of a checkpoint: its dtype name, shape, digest and the file holding it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: str
    shape: tuple[int, ...]
    digest: str = Field(pattern=r"^[0-9a-f]{32}$")
    file: str


class Manifest(BaseModel):
    """What a checkpoint holds: model, step, weight version, per-tensor digests and checksum."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = FORMAT_VERSION
    model_name: str = Field(min_length=1)
    step: int = Field(ge=0)
    weight_version: str = ""
    algorithm: Literal["xxh3_128_chunked"] = ALGORITHM
    checksum: str = Field(pattern=r"^[0-9a-f]{32}$")
    num_bytes: int = Field(ge=0)
    tensors: dict[str, TensorEntry]
    files: dict[str, int]
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @field_validator("format_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value != FORMAT_VERSION:
            raise ValueError(
                f"format_version {value} is not supported (this miles reads {FORMAT_VERSION}); "
                "upgrade miles or re-seal the checkpoint"
            )
        return value

    @field_validator("algorithm", mode="before")
    @classmethod
    def _current_algorithm(cls, value: object) -> object:
        if value == "xxh3_128":
            raise ValueError(
                "this manifest was sealed by an earlier miles, whose digests hashed each tensor's bytes whole "
                f"(now {ALGORITHM}: 256 KiB chunks); re-seal the checkpoint (`miles checkpoint seal`)"
            )
        return value

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("created_at must carry a timezone (write it in UTC, e.g. '...Z')")
        return value.astimezone(UTC)

    @model_validator(mode="before")
    @classmethod
    def _default_weight_version(cls, data: object) -> object:
        # weight_version defaults to str(step); a validator, since a field default cannot see step.
        if isinstance(data, dict) and not data.get("weight_version") and "step" in data:
            data = {**data, "weight_version": str(data["step"])}
        return data

    @field_validator("files")
    @classmethod
    def _files_stay_inside(cls, value: dict[str, int]) -> dict[str, int]:
        # A reader opens directory / name; a manifest must not send it elsewhere.
        for name in value:
            parts = PurePosixPath(name).parts
            if not parts or name.startswith("/") or ".." in parts or "\\" in name:
                raise ValueError(f"file name {name!r} must be a relative path inside the checkpoint")
        return value

    @model_validator(mode="after")
    def _entries_name_listed_files(self) -> Manifest:
        unlisted = sorted({e.file for e in self.tensors.values()} - self.files.keys())
        if unlisted:
            raise ValueError(f"tensor entries name files missing from 'files': {unlisted}; re-seal the checkpoint")
        return self

    def combined_checksum(self) -> str:
        """The model checksum its tensor entries combine to (equals ``checksum`` when consistent)."""
        return combine_digests(
            TensorDigest(name=name, dtype=entry.dtype, shape=entry.shape, digest=entry.digest)
            for name, entry in self.tensors.items()
        )


def manifest_from_files(
    directory: str | os.PathLike[str], *, model_name: str, step: int, weight_version: str | None = None
) -> Manifest:
    """A manifest for the Hugging Face model in ``directory``, hashed from the files ``from_pretrained``
    would load. Raises as ``checksum_safetensors``."""
    directory = Path(directory)
    paths = index_files(directory)
    if not paths:
        raise CheckpointFileMissingError("directory holds no safetensors files", path=str(directory))
    checksum, owners = checksum_files(paths)
    return Manifest(
        model_name=model_name,
        step=step,
        weight_version=weight_version or str(step),
        checksum=checksum.checksum,
        num_bytes=checksum.num_bytes,
        tensors={
            name: TensorEntry(
                dtype=d.dtype, shape=d.shape, digest=d.digest, file=owners[name].relative_to(directory).as_posix()
            )
            for name, d in checksum.tensors.items()
        },
        files={p.relative_to(directory).as_posix(): p.stat().st_size for p in paths},
    )


# A manifest lists one line per tensor; even a model with a million tensors stays far below this.
MAX_MANIFEST_BYTES = 512 * 1024 * 1024


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """``directory/miles_manifest.json``, validated. Raises ManifestMissingError (no directory or
    file), ManifestInvalidError (not JSON, or invalid fields, each named)."""
    path = Path(directory) / MANIFEST_NAME
    try:
        with open_regular(path) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except CheckpointFileInvalidError as exc:
        raise ManifestInvalidError(f"manifest: {exc.message}", path=str(path)) from None
    except IsADirectoryError:
        raise ManifestInvalidError("manifest is a directory, not a file", path=str(path)) from None
    except FileNotFoundError:
        raise ManifestMissingError(
            f"checkpoint has no {MANIFEST_NAME}; seal it (`miles checkpoint seal`) or re-export it",
            path=str(path),
        ) from None
    except NotADirectoryError:
        raise ManifestMissingError("checkpoint path is not a directory", path=str(directory)) from None
    except OSError as exc:  # a read error of the device or filesystem
        raise ManifestInvalidError(f"manifest cannot be read ({exc.strerror})", path=str(path)) from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestInvalidError(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes", path=str(path))
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ManifestInvalidError(f"manifest is not JSON: {exc}", path=str(path)) from None
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ManifestInvalidError(f"manifest fields are invalid: {fields}", path=str(path)) from None


def manifest_or_none(directory: str | os.PathLike[str]) -> Manifest | None:
    """``read_manifest``, or None where there is no valid manifest to read."""
    try:
        return read_manifest(directory)
    except CheckpointError:
        return None


def write_manifest(directory: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write ``manifest`` into ``directory`` atomically; CheckpointFileMissingError if there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointFileMissingError("checkpoint directory does not exist", path=str(directory))
    target = directory / MANIFEST_NAME
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{MANIFEST_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(manifest.model_dump_json(indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_directory(directory)


def fsync_directory(directory: Path) -> None:
    """Make a directory's entries (created, renamed files) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Where a change's bytes come from, checked before any of them is written: a verified checkpoint
matched against the live model, or pushed buckets whose tensors the model has. Files are read,
never memory-mapped (a mapped file cut short kills the process with SIGBUS): one that changes
after the verification makes a stage whose checksum cannot match, never a crash.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles.engine.weights.stage import Stage
from miles.errors import (
    CheckpointError,
    InvalidRequestError,
    ManifestMissingError,
    NotFoundError,
    PermissionDeniedError,
)
from miles.weights.buckets import BucketEntry
from miles.weights.checkpoint import CheckpointReader, open_checkpoint, verify_checkpoint_or_raise
from miles.weights.checksum import saved_state_dict
from miles.weights.manifest import manifest_from_files
from miles.weights.paths import checked_path, roots_problem
from miles.weights.safetensors_io import dtype_name

# A model's tensors by checkpoint name, as (dtype, shape): what every change must match.
Signature = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


class IncompatibleCheckpointError(CheckpointError):
    """A valid checkpoint that does not fit the served model (other names, shapes or dtypes)."""


class UnexpectedChecksumError(CheckpointError):
    """The checkpoint's checksum differs from ``expected_checksum``; ``computed``: hashed from its
    files, when that was done."""

    def __init__(self, message: str, *, computed: str | None, **context: Any) -> None:
        self.computed = computed
        super().__init__(message, **context)


def signature(model: torch.nn.Module) -> Signature:
    """The (dtype, shape) of every tensor a checkpoint of ``model`` holds (not the tensors: a held
    view of the live weights would keep their memory alive past a staged swap)."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in saved_state_dict(model).items()}


def checkpoint_path(raw: str, *, roots: tuple[Path, ...]) -> Path:
    """The checkpoint directory ``raw`` names, checked before any filesystem call sees the text.
    Raises InvalidRequestError for bad text or an unreadable path, PermissionDeniedError for a
    directory outside ``roots`` or holding entries that resolve outside them (``roots_problem``),
    NotFoundError for a path that is not a directory."""
    path = checked_path(raw, field="model_path")
    problem = roots_problem(path, roots)
    if problem is not None:
        raise PermissionDeniedError(problem)
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # e.g. a resolved path longer than the system allows
        raise InvalidRequestError(f"model_path {str(path)[:200]!r} cannot be read: {exc.strerror}") from exc
    if not is_dir:
        raise NotFoundError(f"model_path {str(path)!r} is not a directory")
    return path


@dataclass
class VerifiedCheckpoint(AbstractContextManager["VerifiedCheckpoint"]):
    """A checkpoint matched against the live model. Its bytes were verified whole as it was opened,
    or (``deferred``) are verified as they are staged beside the live weights: a staged load reads
    the checkpoint once instead of twice."""

    reader: CheckpointReader
    timings: dict[str, float]  # seconds to open, verify and match it
    deferred: bool = False

    def write(self, stage: Stage) -> None:
        """Stage every tensor; deferred, raises CheckpointVerificationError naming those whose bytes
        differ from the manifest."""
        digests = stage.write_checkpoint(self.reader)
        if self.deferred:
            self.reader.check_digests(digests).raise_for_problems(limit=5)

    def __exit__(self, *exc: object) -> None:
        self.reader.close()


def open_verified(
    model: torch.nn.Module,
    checkpoint: Path,
    *,
    expected_checksum: str | None = None,
    weight_version: str | None = None,
    defer: bool = False,
) -> VerifiedCheckpoint:
    """Open ``checkpoint``, verify it (against its manifest, whose checksum must be ``expected_checksum``
    when given; a plain Hugging Face directory is hashed into a manifest that must carry it, and needs
    a ``weight_version``) and match it against ``model``'s tensors. With ``defer``, a sealed
    checkpoint's bytes are verified as they are written. Raises CheckpointError naming what is wrong:
    UnexpectedChecksumError for another checkpoint than expected, IncompatibleCheckpointError for
    other names, shapes or dtypes than the model's."""
    started = time.perf_counter()
    plain = False
    try:
        reader = open_checkpoint(checkpoint)
    except ManifestMissingError:
        plain = True
        reader = _open_plain(checkpoint, expected_checksum=expected_checksum, weight_version=weight_version)
    except CheckpointError:
        # The files could not even be opened; a full verification names every problem.
        verify_checkpoint_or_raise(checkpoint, limit=5)
        raise
    except OSError as exc:  # unreadable files are refused like any other bad checkpoint
        raise _unreadable(checkpoint, exc) from exc
    opened = time.perf_counter()
    deferred = defer and not plain  # a plain directory's files were hashed as it was opened
    try:
        if not plain:
            if expected_checksum is not None and expected_checksum != reader.manifest.checksum:
                # Refused before hashing: whatever the files hold, this is not the checkpoint asked for.
                raise UnexpectedChecksumError(  # noqa: TRY301  # the except below closes the reader, re-raises
                    "the checkpoint's manifest names another checksum than expected_checksum; "
                    "load the checkpoint the caller expects, or fix expected_checksum",
                    computed=None,
                    expected=expected_checksum,
                    manifest=reader.manifest.checksum,
                    path=str(checkpoint),
                )
            reader.verify(digests=not deferred).raise_for_problems(limit=5)
        verified = time.perf_counter()
        _match(signature(model), reader, checkpoint)
    except OSError as exc:
        reader.close()
        raise _unreadable(checkpoint, exc) from exc
    except BaseException:
        reader.close()
        raise
    timings = {"open": opened - started, "verify": verified - opened, "match": time.perf_counter() - verified}
    return VerifiedCheckpoint(reader=reader, timings=timings, deferred=deferred)


def _open_plain(checkpoint: Path, *, expected_checksum: str | None, weight_version: str | None) -> CheckpointReader:
    """A reader over a plain Hugging Face directory, whose manifest is hashed from its files here."""
    if expected_checksum is None:
        raise CheckpointError(
            "the checkpoint has no miles manifest (miles_manifest.json) to verify it against: seal it with "
            "`miles checkpoint seal` or pass expected_checksum",
            path=str(checkpoint),
        )
    if weight_version is None:
        raise CheckpointError(
            "a checkpoint without a miles manifest has no weight version of its own; pass weight_version",
            path=str(checkpoint),
        )
    try:
        name = checkpoint.name or "checkpoint"
        manifest = manifest_from_files(checkpoint, model_name=name, step=0, weight_version=weight_version)
        if manifest.checksum != expected_checksum:
            raise UnexpectedChecksumError(
                f"the checkpoint's files hash to {manifest.checksum}, not to the expected checksum "
                f"{expected_checksum}; it is another checkpoint, or it was changed or corrupted",
                computed=manifest.checksum,
                path=str(checkpoint),
            )
        return open_checkpoint(checkpoint, manifest=manifest)
    except OSError as exc:
        raise _unreadable(checkpoint, exc) from exc


def _unreadable(checkpoint: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(f"checkpoint could not be read: {exc}", path=str(checkpoint))


def _match(layout: Signature, reader: CheckpointReader, checkpoint: Path) -> None:
    names = set(reader.tensor_names)
    missing, extra = sorted(set(layout) - names), sorted(names - set(layout))
    if missing or extra:
        raise IncompatibleCheckpointError(
            "checkpoint tensors do not match the served model; it was written for another architecture",
            path=str(checkpoint),
            missing=missing[:5] or None,
            unexpected=extra[:5] or None,
        )
    for name, (dtype, shape) in layout.items():
        info = reader.info(name)
        if tuple(info.shape) != shape or info.dtype != dtype:
            raise IncompatibleCheckpointError(
                "checkpoint tensor differs in shape or dtype from the served model",
                path=str(checkpoint),
                tensor=name,
                expected=f"{dtype_name(dtype)}{list(shape)}",
                actual=f"{dtype_name(info.dtype)}{list(info.shape)}",
            )


def check_pushed(entries: Iterable[BucketEntry], live: Signature) -> None:
    """Raise InvalidRequestError unless every pushed entry names a live tensor of its dtype and
    shape, compared as numbers: a shape no tensor could have is never allocated, even on meta."""
    for entry in entries:
        dtype, target = entry.torch_dtype(), live.get(entry.name)
        if target is None:
            raise InvalidRequestError(f"the model has no tensor {entry.name!r}; push the names its checkpoint has")
        if target != (dtype, tuple(entry.shape)):
            dims = list(entry.shape)  # cut short past 8 dimensions: a hostile shape may have thousands
            shape = str(dims) if len(dims) <= 8 else f"[{', '.join(map(str, dims[:8]))}, ... ({len(dims)} dimensions)]"
            raise InvalidRequestError(
                f"tensor {entry.name!r} is pushed as {dtype}{shape}, but the model holds {target[0]}{list(target[1])}"
            )

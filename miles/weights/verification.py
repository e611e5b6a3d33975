"""Verify a checkpoint against its manifest: every digest recomputed from the files, every problem named."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from miles.errors import (
    CheckpointError,
    CheckpointFileError,
    CheckpointFileInvalidError,
    CheckpointFileMissingError,
    CheckpointFileTruncatedError,
    CheckpointVerificationError,
    ManifestInvalidError,
    ManifestMissingError,
)
from miles.weights.checksum import TensorDigest, checksum_from_digests, digest_files
from miles.weights.manifest import MANIFEST_NAME, Manifest, TensorEntry, read_manifest
from miles.weights.safetensors_io import SafetensorsFile, TensorSlot, dtype_name, index_files, read_header

_RESEAL = "re-export the checkpoint, or re-seal it (`miles checkpoint seal`) if the files are what you want"


class ProblemKind(StrEnum):
    """What is wrong with a checkpoint; one kind per way it can be wrong."""

    MISSING_MANIFEST = "missing_manifest"
    INVALID_MANIFEST = "invalid_manifest"
    MISSING_FILE = "missing_file"
    TRUNCATED_FILE = "truncated_file"
    INVALID_FILE = "invalid_file"
    MISSING_TENSOR = "missing_tensor"
    EXTRA_TENSOR = "extra_tensor"
    WRONG_SHAPE = "wrong_shape"
    WRONG_DTYPE = "wrong_dtype"
    DIGEST_MISMATCH = "digest_mismatch"
    CHECKSUM_MISMATCH = "checksum_mismatch"


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointProblem:
    """One problem: its kind, where (tensor, file), expected vs actual, and how to fix it."""

    kind: ProblemKind
    message: str
    tensor: str | None = None
    file: str | None = None
    expected: str | None = None
    actual: str | None = None


@dataclass(frozen=True, slots=True)
class VerificationReport:
    """The outcome of verifying a checkpoint; ``checksum``: the model checksum recomputed from the
    files (None when a file could not be read or a tensor name is duplicated)."""

    directory: Path
    manifest: Manifest | None
    problems: tuple[CheckpointProblem, ...]
    checksum: str | None

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self, *, limit: int | None = None) -> Manifest:
        """The verified manifest. Raises CheckpointVerificationError for any problem: ``.report``
        holds them all, the message lists them (the first ``limit``, when given)."""
        if self.manifest is not None and not self.problems:
            return self.manifest
        shown = self.problems[:limit]
        more = f" (and {len(self.problems) - len(shown)} more)" if len(shown) < len(self.problems) else ""
        raise CheckpointVerificationError(
            "checkpoint failed verification: " + "; ".join(f"{p.kind}: {p.message}" for p in shown) + more,
            report=self,
            path=str(self.directory),
            problems=len(self.problems),
        )


def verify_checkpoint(directory: str | os.PathLike[str], *, digests: bool = True) -> VerificationReport:
    """Check the checkpoint in ``directory`` against its manifest, hashing every tensor from disk
    (with ``digests=False`` only its structure, and no checksum). Never raises for a broken
    checkpoint: every problem is in the report."""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except (ManifestMissingError, ManifestInvalidError) as exc:
        missing = isinstance(exc, ManifestMissingError)
        problem = CheckpointProblem(
            kind=ProblemKind.MISSING_MANIFEST if missing else ProblemKind.INVALID_MANIFEST,
            file=MANIFEST_NAME,
            message=f"no {MANIFEST_NAME} in {directory}: seal the directory (`miles checkpoint seal DIR "
            "--model-name NAME --step N`) or re-export it with save_checkpoint."
            if missing
            else f"{exc.message}; re-seal the checkpoint or re-export it.",
        )
        return VerificationReport(directory, None, (problem,), None)
    with ExitStack() as stack:
        opened: dict[str, SafetensorsFile] = {}
        problems: list[CheckpointProblem] = []
        for file_name in sorted(manifest.files):
            try:
                opened[file_name] = stack.enter_context(SafetensorsFile(directory / file_name))
            except CheckpointFileError as exc:
                problems.append(file_problem(file_name, exc))
        found, checksum = compare_with_manifest(manifest, opened, digests=digests)
    if len(opened) < len(manifest.files):
        checksum = None
    return VerificationReport(directory, manifest, tuple(problems + found), checksum)


def verify_checkpoint_or_raise(directory: str | os.PathLike[str], *, limit: int | None = None) -> Manifest:
    """The manifest of the checkpoint in ``directory``, verified. Raises as
    ``VerificationReport.raise_for_problems``, and CheckpointError for files that cannot be read."""
    try:
        report = verify_checkpoint(directory)
    except OSError as exc:
        raise CheckpointError(f"checkpoint could not be read: {exc}", path=str(directory)) from exc
    return report.raise_for_problems(limit=limit)


def file_problem(file_name: str, exc: CheckpointFileError) -> CheckpointProblem:
    """The problem a file-level read error stands for, named by its kind."""
    if isinstance(exc, CheckpointFileMissingError):
        return CheckpointProblem(
            kind=ProblemKind.MISSING_FILE,
            file=file_name,
            message=f"{file_name} is named by the manifest but does not exist; copy the checkpoint "
            "again or re-export it.",
        )
    if isinstance(exc, CheckpointFileTruncatedError):
        return CheckpointProblem(
            kind=ProblemKind.TRUNCATED_FILE,
            file=file_name,
            expected=_str_or_none(exc.context.get("needed") or exc.context.get("header_len")),
            actual=_str_or_none(exc.context.get("size")),
            message=f"{file_name} is truncated ({exc.message}); the write or copy was cut short: copy the "
            "checkpoint again or re-export it.",
        )
    kind = ProblemKind.INVALID_FILE if isinstance(exc, CheckpointFileInvalidError) else ProblemKind.MISSING_FILE
    return CheckpointProblem(
        kind=kind,
        file=file_name,
        message=f"{file_name} is not a valid safetensors file ({exc.message}); re-export the checkpoint.",
    )


def compare_with_manifest(
    manifest: Manifest, opened: Mapping[str, SafetensorsFile], *, threads: int | None = None, digests: bool = True
) -> tuple[list[CheckpointProblem], str | None]:
    """The problems of the tensors in ``opened`` (the manifest's files that could be opened) against
    the manifest, and the model checksum of the tensors found (None if a name is duplicated)."""
    problems: list[CheckpointProblem] = []
    combined = manifest.combined_checksum()
    if combined != manifest.checksum:
        problems.append(
            CheckpointProblem(
                kind=ProblemKind.CHECKSUM_MISMATCH,
                file=MANIFEST_NAME,
                expected=manifest.checksum,
                actual=combined,
                message="the manifest's model checksum does not match what its tensor entries combine "
                "to: the manifest was edited or written by a broken tool; re-seal the checkpoint.",
            )
        )
    found: dict[str, tuple[str, SafetensorsFile, TensorSlot]] = {}
    duplicated = False
    for file_name in sorted(opened):
        for name, slot in opened[file_name].tensors.items():
            if name in found:
                duplicated = True
                problems.append(
                    CheckpointProblem(
                        kind=ProblemKind.EXTRA_TENSOR,
                        tensor=name,
                        file=file_name,
                        message=f"tensor {name!r} appears again in {file_name} (first in {found[name][0]}); {_RESEAL}.",
                    )
                )
                continue
            found[name] = (file_name, opened[file_name], slot)
    for name, entry in sorted(manifest.tensors.items()):
        if name not in found and entry.file in opened:
            problems.append(
                CheckpointProblem(
                    kind=ProblemKind.MISSING_TENSOR,
                    tensor=name,
                    file=entry.file,
                    message=f"tensor {name!r} is in the manifest (file {entry.file}) but in no weights file; "
                    "re-export the checkpoint.",
                )
            )
    problems.extend(
        CheckpointProblem(
            kind=ProblemKind.EXTRA_TENSOR,
            tensor=name,
            file=found[name][0],
            message=f"tensor {name!r} in {found[name][0]} is not in the manifest; {_RESEAL}.",
        )
        for name in sorted(found.keys() - manifest.tensors.keys())
    )
    names = sorted(found)
    if digests:
        computed = digest_files([(found[n][1], found[n][2]) for n in names], threads=threads)
    else:
        # Structure only: the dtype and shape come from the file's header, the digest is taken on
        # trust from the manifest (no byte is read).
        computed = [
            TensorDigest(
                name=n,
                dtype=dtype_name(found[n][2].dtype),
                shape=tuple(found[n][2].shape),
                digest=manifest.tensors[n].digest if n in manifest.tensors else "",
            )
            for n in names
        ]
    for name, digest in zip(names, computed, strict=True):
        if name in manifest.tensors:
            problems.extend(_entry_problems(name, found[name][0], manifest.tensors[name], digest))
    checksum = None if duplicated or not digests else checksum_from_digests(computed, num_bytes=0).checksum
    return problems, checksum


def digest_problems(manifest: Manifest, digests: Mapping[str, str]) -> list[CheckpointProblem]:
    """The tensors whose bytes, hashed to ``digests`` as they were read, differ from the manifest."""
    return [
        _digest_problem(name, entry, digests[name])
        for name, entry in sorted(manifest.tensors.items())
        if name in digests and digests[name] != entry.digest
    ]


def _digest_problem(name: str, entry: TensorEntry, actual: str) -> CheckpointProblem:
    return CheckpointProblem(
        kind=ProblemKind.DIGEST_MISMATCH,
        tensor=name,
        file=entry.file,
        expected=entry.digest,
        actual=actual,
        message=f"the bytes of tensor {name!r} in {entry.file} differ from the manifest "
        f"(corrupted on disk or changed after sealing); {_RESEAL}.",
    )


def _entry_problems(name: str, file_name: str, entry: TensorEntry, digest: TensorDigest) -> list[CheckpointProblem]:
    layouts = (
        (ProblemKind.WRONG_DTYPE, "is", entry.dtype, digest.dtype),
        (ProblemKind.WRONG_SHAPE, "has shape", str(list(entry.shape)), str(list(digest.shape))),
    )
    problems = [
        CheckpointProblem(
            kind=kind,
            tensor=name,
            file=file_name,
            expected=expected,
            actual=actual,
            message=f"tensor {name!r} {verb} {actual} in {file_name}, the manifest says {expected}; {_RESEAL}.",
        )
        for kind, verb, expected, actual in layouts
        if expected != actual
    ]
    # Only compare bytes once dtype and shape agree: a different layout is already named above.
    if not problems and entry.digest != digest.digest:
        problems.append(_digest_problem(name, entry, digest.digest))
    return problems


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def plain_checkpoint_problems(directory: Path) -> list[str]:
    """What keeps ``directory`` from being a loadable Hugging Face checkpoint without a manifest,
    from its headers only (whoever loads it hashes the tensors)."""
    problems = []
    if not (directory / "config.json").is_file():
        problems.append("config.json is missing: this is not a Hugging Face model directory")
    try:
        files = index_files(directory)
    except CheckpointFileError as exc:
        return [*problems, exc.message]
    if not files:
        problems.append("no *.safetensors files: save the model with save_pretrained(safe_serialization=True)")
    seen: dict[str, str] = {}
    for path in files:
        try:
            tensors = read_header(path)
        except CheckpointFileError as exc:
            problems.append(f"{path.name}: {exc.message}")
            continue
        for name in tensors:
            if name in seen:
                problems.append(f"tensor {name!r} is in both {seen[name]} and {path.name}")
            seen[name] = path.name
    return problems

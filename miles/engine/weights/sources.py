"""Loading a checkpoint into the live model in place, only after all of it was read and validated.

The order is what makes an update safe: (1) every tensor of the checkpoint is read and its digest
checked against its manifest, (2) every name, shape and dtype is matched against
the live model, and only then (3) the caller either stages it (``weight_stage.py``: written beside
the live weights while serving, then swapped in) or takes the write side of the weights lock and
``apply_update`` copies each tensor into the existing parameter storage. Steps 1-2 run while
generation continues on the old weights; a refused checkpoint never touches them. Files are read,
never memory-mapped (a mapped file cut short while in use kills the process with SIGBUS): one
that changes between the verification and the copy makes a copy whose checksum cannot match,
which is refused (staged) or left unverified (in place), never a crash.

A plain Hugging Face directory (no miles manifest) loads the same way when the caller names the
checksum it expects: the verification pass computes every tensor's digest from the files and the
model checksum from those digests (``miles.weights.checksum``), and the load goes on only if that
equals the expected one. The digests become an in-memory manifest, so the rest of the load (and
the confirmation of the live weights) does not care where the manifest came from.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles.errors import CheckpointError, CheckpointFileMissingError, ManifestMissingError
from miles.weights.checkpoint import (
    CheckpointReader,
    Manifest,
    TensorEntry,
    VerificationReport,
    open_checkpoint,
    verify_checkpoint,
)
from miles.weights.checksum import (
    ModelChecksum,
    checksum_from_digests,
    checksum_module,
    collect_slots,
    copy_and_checksum,
    digest_files,
    saved_state_dict,
)
from miles.weights.safetensors_io import SafetensorsFile, dtype_name, index_files

logger = logging.getLogger("miles.engine")


class IncompatibleCheckpointError(CheckpointError):
    """A valid checkpoint that does not fit the served model (other names, shapes or dtypes)."""


class UnexpectedChecksumError(CheckpointError):
    """The checkpoint is not the one the caller expects: its checksum differs from
    ``expected_checksum``. ``computed`` is the checksum hashed from its files, when that was done."""

    def __init__(self, message: str, *, computed: str | None, **context: object) -> None:
        self.computed = computed
        super().__init__(message, **context)


@dataclass
class PreparedUpdate:
    """A verified checkpoint matched against the live model, ready to be copied in."""

    reader: CheckpointReader
    # The model checksum hashed from the checkpoint's files by the verification pass.
    checkpoint_checksum: str | None = None
    # Seconds per phase of this load (open, verify, match, copy, checksum), for the response.
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def manifest_checksum(self) -> str:
        return self.reader.manifest.checksum

    @property
    def weight_version(self) -> str:
        return self.reader.manifest.weight_version

    def close(self) -> None:
        self.reader.close()


def prepare_update(
    model: torch.nn.Module,
    checkpoint: Path,
    *,
    expected_checksum: str | None = None,
    weight_version: str | None = None,
) -> PreparedUpdate:
    """Open and fully verify ``checkpoint`` and match it against ``model``'s tensors.

    With a manifest, the files are verified against it and, when ``expected_checksum`` is given,
    the manifest's checksum must equal it. Without one, ``expected_checksum`` and
    ``weight_version`` are required and the checksum hashed from the files must equal the
    expected one.

    Raises CheckpointError (missing, corrupt or truncated checkpoint, digest mismatch, a plain
    directory without the expected checksum or a version), UnexpectedChecksumError (not the
    checkpoint the caller expects) or IncompatibleCheckpointError (names, shapes or dtypes differ
    from the live model), naming what is wrong; the live weights are untouched either way.
    """
    started = time.perf_counter()
    try:
        reader = open_checkpoint(checkpoint)
    except ManifestMissingError:
        reader = None
    except CheckpointError:
        # The files could not even be mapped; a full verification names every problem.
        _raise_if_bad(_verified(checkpoint), checkpoint)
        raise
    except OSError as exc:
        # Unreadable files (a directory where the manifest should be, no permission): the
        # checkpoint is refused like any other bad one, never a failure of the engine.
        raise CheckpointError(f"checkpoint could not be read: {exc}", path=str(checkpoint)) from exc
    if reader is None:
        reader, computed = _open_plain(checkpoint, expected_checksum=expected_checksum, weight_version=weight_version)
        opened = verified = time.perf_counter()
    else:
        try:
            manifest_checksum = reader.manifest.checksum
            if expected_checksum is not None and expected_checksum != manifest_checksum:
                # Refused before hashing: whatever the files hold, this is not the checkpoint asked for.
                raise UnexpectedChecksumError(  # noqa: TRY301  # the except below closes the reader, re-raises
                    "the checkpoint's manifest names another checksum than expected_checksum; "
                    "load the checkpoint the caller expects, or fix expected_checksum",
                    computed=None,
                    expected=expected_checksum,
                    manifest=manifest_checksum,
                    path=str(checkpoint),
                )
            opened = time.perf_counter()
            try:
                report = reader.verify()
            except OSError as exc:
                raise CheckpointError(f"checkpoint could not be read: {exc}", path=str(checkpoint)) from exc
            _raise_if_bad(report, checkpoint)
            assert report.checksum is not None  # a hashed report without problems has its checksum
            computed = report.checksum
            verified = time.perf_counter()
        except BaseException:
            reader.close()
            raise
    try:
        _match(_layout(model), reader, checkpoint)
        timings = {"open": opened - started, "verify": verified - opened, "match": time.perf_counter() - verified}
        return PreparedUpdate(reader=reader, checkpoint_checksum=computed, timings=timings)
    except BaseException:
        reader.close()
        raise


def _open_plain(
    checkpoint: Path, *, expected_checksum: str | None, weight_version: str | None
) -> tuple[CheckpointReader, str]:
    """A reader over the plain Hugging Face directory ``checkpoint`` whose files hash to
    ``expected_checksum`` (one pass: the digests hashed here become its in-memory manifest),
    and the checksum computed.

    Raises CheckpointError naming what is missing or wrong, UnexpectedChecksumError when the files
    hash to another checksum.
    """
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
    paths = index_files(checkpoint)
    if not paths:
        raise CheckpointFileMissingError("the checkpoint directory holds no safetensors files", path=str(checkpoint))
    with ExitStack() as stack:
        try:
            files = {p.relative_to(checkpoint).as_posix(): stack.enter_context(SafetensorsFile(p)) for p in paths}
            slots = collect_slots(files.values())
            digests = digest_files(slots)
        except OSError as exc:
            raise CheckpointError(f"checkpoint could not be read: {exc}", path=str(checkpoint)) from exc
        computed = checksum_from_digests(digests, num_bytes=sum(slot.nbytes for _, slot in slots))
        if computed.checksum != expected_checksum:
            raise UnexpectedChecksumError(
                f"the checkpoint's files hash to {computed.checksum}, not to the expected checksum "
                f"{expected_checksum}; it is another checkpoint, or it was changed or corrupted",
                computed=computed.checksum,
                path=str(checkpoint),
            )
        owners = {name: file for file, mapped in files.items() for name in mapped.tensors}
        manifest = Manifest(
            model_name=checkpoint.name or "checkpoint",
            step=0,
            weight_version=weight_version,
            checksum=computed.checksum,
            num_bytes=computed.num_bytes,
            tensors={
                name: TensorEntry(dtype=d.dtype, shape=d.shape, digest=d.digest, file=owners[name])
                for name, d in computed.tensors.items()
            },
            files={name: mapped.path.stat().st_size for name, mapped in files.items()},
        )
        reader = CheckpointReader(directory=checkpoint, manifest=manifest, files=files)
        # The reader owns the open files now.
        stack.pop_all()
    return reader, computed.checksum


def _verified(checkpoint: Path) -> VerificationReport:
    try:
        return verify_checkpoint(checkpoint)
    except OSError as exc:
        raise CheckpointError(f"checkpoint could not be read: {exc}", path=str(checkpoint)) from exc


def _raise_if_bad(report: VerificationReport, checkpoint: Path) -> None:
    if report.ok:
        return
    problems = "; ".join(f"{p.kind.value}: {p.message}" for p in report.problems[:5])
    more = f" (and {len(report.problems) - 5} more)" if len(report.problems) > 5 else ""
    raise CheckpointError(f"checkpoint failed verification: {problems}{more}", path=str(checkpoint))


def _layout(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor a checkpoint of ``model`` holds. Not the tensors: a held
    view of the live weights would keep their memory alive past a staged swap."""
    return {name: (tuple(t.shape), t.dtype) for name, t in saved_state_dict(model).items()}


def _match(layout: dict[str, tuple[tuple[int, ...], torch.dtype]], reader: CheckpointReader, checkpoint: Path) -> None:
    names = set(reader.tensor_names)
    missing = sorted(set(layout) - names)
    extra = sorted(names - set(layout))
    if missing or extra:
        raise IncompatibleCheckpointError(
            "checkpoint tensors do not match the served model; it was written for another architecture",
            path=str(checkpoint),
            missing=missing[:5] or None,
            unexpected=extra[:5] or None,
        )
    for name, (shape, dtype) in layout.items():
        info = reader.info(name)
        if tuple(info.shape) != shape or info.dtype != dtype:
            raise IncompatibleCheckpointError(
                "checkpoint tensor differs in shape or dtype from the served model",
                path=str(checkpoint),
                tensor=name,
                expected=f"{dtype_name(dtype)}{list(shape)}",
                actual=f"{dtype_name(info.dtype)}{list(info.shape)}",
            )


@torch.no_grad()
def apply_update(update: PreparedUpdate, model: torch.nn.Module) -> ModelChecksum:
    """Copy every tensor into the live ``model`` in place and return the checksum of what it now
    holds.

    The caller must hold the write side of the weights lock.
    """
    started = time.perf_counter()
    # The checksum is computed from the parameters' memory right after each slice is written:
    # it describes what the model holds now, at the cost of a cache read, not a second pass.
    # One thread: the caller is the engine's torch thread (see scheduler.py); copy_ still uses
    # its intra-op threads.
    try:
        checksum = copy_and_checksum(saved_state_dict(model), update.reader.tensor, threads=1)
    except (OSError, CheckpointError) as exc:
        # The files became unreadable (cut, rewritten) after they were verified, part of the way
        # through the copy: what the model holds now is hashed, and cannot match the manifest.
        logger.error("copying %s into the model failed part of the way: %s", update.reader.directory, exc)  # noqa: TRY400
        checksum = checksum_module(model)
    update.timings["copy_and_checksum"] = time.perf_counter() - started
    return checksum

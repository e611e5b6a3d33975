"""Loading a checkpoint into the live model in place, only after all of it was read and validated.

The order is what makes an update safe: (1) the whole checkpoint is memory-mapped and every
tensor's digest checked against its manifest, (2) every name, shape and dtype is matched against
the live model, and only then (3) the caller takes the write side of the weights lock and
``apply`` copies each tensor into the existing parameter storage. Steps 1-2 run while generation
continues on the old weights; a refused checkpoint never touches them. No second copy of the model
is made: the source tensors are views of the file's page-cache pages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles.errors import CheckpointError
from miles.weights.checkpoint import CheckpointReader, VerificationReport, open_checkpoint, verify_checkpoint
from miles.weights.checksum import ModelChecksum, copy_and_checksum, saved_state_dict
from miles.weights.safetensors_io import dtype_name


class IncompatibleCheckpointError(CheckpointError):
    """A valid checkpoint that does not fit the served model (other names, shapes or dtypes)."""


@dataclass
class PreparedUpdate:
    """A verified checkpoint matched against the live model, ready to be copied in."""

    reader: CheckpointReader
    targets: dict[str, torch.Tensor]
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


def prepare_update(model: torch.nn.Module, checkpoint: Path) -> PreparedUpdate:
    """Open and fully verify ``checkpoint`` and match it against ``model``'s tensors.

    Raises CheckpointError (missing, corrupt or truncated checkpoint, digest mismatch) or
    IncompatibleCheckpointError (names, shapes or dtypes differ from the live model), naming what
    is wrong; the live weights are untouched either way.
    """
    started = time.perf_counter()
    try:
        reader = open_checkpoint(checkpoint)
    except CheckpointError:
        # The files could not even be mapped; a full verification names every problem.
        _raise_if_bad(_verified(checkpoint), checkpoint)
        raise
    except OSError as exc:
        # Unreadable files (a directory where the manifest should be, no permission): the
        # checkpoint is refused like any other bad one, never a failure of the engine.
        raise CheckpointError(f"checkpoint could not be read: {exc}", path=str(checkpoint)) from exc
    try:
        opened = time.perf_counter()
        try:
            report = reader.verify()
        except OSError as exc:
            raise CheckpointError(f"checkpoint could not be read: {exc}", path=str(checkpoint)) from exc
        _raise_if_bad(report, checkpoint)
        verified = time.perf_counter()
        targets = saved_state_dict(model)
        _match(targets, reader, checkpoint)
        timings = {"open": opened - started, "verify": verified - opened, "match": time.perf_counter() - verified}
        return PreparedUpdate(reader=reader, targets=targets, timings=timings)
    except BaseException:
        reader.close()
        raise


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


def _match(targets: dict[str, torch.Tensor], reader: CheckpointReader, checkpoint: Path) -> None:
    names = set(reader.tensor_names)
    missing = sorted(set(targets) - names)
    extra = sorted(names - set(targets))
    if missing or extra:
        raise IncompatibleCheckpointError(
            "checkpoint tensors do not match the served model; it was written for another architecture",
            path=str(checkpoint),
            missing=missing[:5] or None,
            unexpected=extra[:5] or None,
        )
    for name, live in targets.items():
        info = reader.info(name)
        if tuple(info.shape) != tuple(live.shape) or info.dtype != live.dtype:
            raise IncompatibleCheckpointError(
                "checkpoint tensor differs in shape or dtype from the served model",
                path=str(checkpoint),
                tensor=name,
                expected=f"{dtype_name(live.dtype)}{list(live.shape)}",
                actual=f"{dtype_name(info.dtype)}{list(info.shape)}",
            )


@torch.no_grad()
def apply_update(update: PreparedUpdate) -> ModelChecksum:
    """Copy every tensor into the live model and return the checksum of what it now holds.

    The caller must hold the write side of the weights lock.
    """
    started = time.perf_counter()
    # The checksum is computed from the parameters' memory right after each slice is written:
    # it describes what the model holds now, at the cost of a cache read, not a second pass.
    # One thread: the caller is the engine's torch thread (see scheduler.py); copy_ still uses
    # its intra-op threads.
    checksum = copy_and_checksum(update.targets, update.reader.tensor, threads=1)
    update.timings["copy_and_checksum"] = time.perf_counter() - started
    return checksum

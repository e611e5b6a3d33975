"""Exporting the weights an engine holds as a sealed miles checkpoint (``POST /export_weights``).

A restarted peer can then load exactly these weights, verified by their manifest, instead of
waiting for training to publish again. The caller hands over a copy of the weights it holds, so
updates and generation go on while it is written; the written checkpoint must still hash to the
checksum the engine recorded for them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from miles.errors import CheckpointError, ChecksumMismatchError
from miles.weights.checkpoint import read_manifest, save_checkpoint

# Each part of a snapshot's directory name stays well inside NAME_MAX (255 bytes) in all.
_MAX_PART_CHARS = 96


def snapshot_path(snapshot_dir: Path, *, model_name: str, weight_version: str, checksum: str) -> Path:
    """``snapshot_dir/<model>-<version>-<checksum[:16]>``, with characters that are unsafe in a
    directory name replaced by ``_``: the same weights under the same name map to the same path."""
    return snapshot_dir / f"{_safe(model_name)}-{_safe(weight_version)}-{checksum[:16]}"


def export_snapshot(
    model: PreTrainedModel,
    *,
    tokenizer: Any,
    snapshot_dir: Path,
    model_name: str,
    weight_version: str,
    checksum: str,
    step: int,
) -> Path:
    """Write ``model`` (whose checksum is ``checksum``) under ``snapshot_dir`` and return the path.

    An existing snapshot of the same name whose manifest has this checksum is reused as it is.
    The caller must keep the weights from changing until this returns.

    Raises:
        ChecksumMismatchError: the written checkpoint does not hash to ``checksum`` (the caller's
            record of the weights is wrong); nothing is left at the path.
        CheckpointError / OSError: the snapshot could not be written (permissions, disk space).
    """
    target = snapshot_path(snapshot_dir, model_name=model_name, weight_version=weight_version, checksum=checksum)
    if target.is_dir():
        try:
            if read_manifest(target).checksum == checksum:
                return target
        except CheckpointError:
            pass  # not a sealed snapshot (a leftover of something else): written again below
    manifest = save_checkpoint(
        target,
        model=model,
        tokenizer=tokenizer,
        model_name=model_name,
        step=step,
        weight_version=weight_version,
        overwrite=target.exists(),
    )
    if manifest.checksum != checksum:
        # save_checkpoint already held the files to the live model; a difference here means the
        # engine's record of what it holds is wrong, and a snapshot named after it would lie.
        shutil.rmtree(target, ignore_errors=True)
        raise ChecksumMismatchError(
            "the exported weights do not hash to the checksum the engine records for them",
            expected=checksum,
            actual=manifest.checksum,
            path=str(target),
        )
    return target


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", part)[:_MAX_PART_CHARS] or "_"

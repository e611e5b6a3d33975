"""Checkpoints: a Hugging Face model directory plus ``miles_manifest.json``, written atomically.

The public face of checkpoints: it re-exports the manifest, verification and reader APIs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.errors import CheckpointError, CheckpointExistsError, ChecksumMismatchError
from miles.weights.checksum import checksum_module
from miles.weights.manifest import (
    MANIFEST_NAME,
    Manifest,
    fsync_directory,
    manifest_from_files,
    read_manifest,
    write_manifest,
)
from miles.weights.reader import CheckpointReader, open_checkpoint
from miles.weights.verification import (
    ProblemKind,
    VerificationReport,
    verify_checkpoint,
    verify_checkpoint_or_raise,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "MANIFEST_NAME",
    "CheckpointReader",
    "Manifest",
    "ProblemKind",
    "VerificationReport",
    "open_checkpoint",
    "read_manifest",
    "save_checkpoint",
    "seal_checkpoint",
    "verify_checkpoint",
    "verify_checkpoint_or_raise",
]

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def save_checkpoint(
    out_dir: str | os.PathLike[str],
    *,
    model: PreTrainedModel,
    tokenizer: Any = None,
    model_name: str,
    step: int,
    weight_version: str | None = None,
    max_shard_size: str | int | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Write ``model`` (and ``tokenizer``) as a checkpoint at ``out_dir``, atomically (with
    ``overwrite``, swapped for the old one in one rename where the filesystem allows it), and return
    its manifest, hashed from the written files; on any failure ``out_dir`` is as it was. Raises
    CheckpointExistsError when ``out_dir`` exists and ``overwrite`` is False, or is not a directory;
    ChecksumMismatchError when the written files do not hash to the model in memory, CheckpointError
    when they cannot be read."""
    target = Path(out_dir).absolute()
    if target.exists() and (not overwrite or not target.is_dir()):
        raise CheckpointExistsError(
            "checkpoint target already exists; pass overwrite=True (--overwrite) to replace it, "
            "or choose another directory",
            path=str(target),
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(tmp, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        manifest = manifest_from_files(tmp, model_name=model_name, step=step, weight_version=weight_version)
        live = checksum_module(model)
        if live.checksum != manifest.checksum:
            raise ChecksumMismatchError(  # noqa: TRY301  # the except below removes the temp dir, re-raises
                "the saved files do not hash to the model in memory (save_pretrained renamed, "
                "dropped or converted tensors)",
                expected=live.checksum,
                actual=manifest.checksum,
                missing=sorted(live.tensors.keys() - manifest.tensors.keys())[:5] or None,
                extra=sorted(manifest.tensors.keys() - live.tensors.keys())[:5] or None,
                path=str(target),
            )
        write_manifest(tmp, manifest)
        _fsync_tree(tmp)
        _move_into_place(tmp, target, overwrite=overwrite)
    except BaseException:
        # Whatever failed (including KeyboardInterrupt), leave no temp directory behind.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def seal_checkpoint(
    directory: str | os.PathLike[str], *, model_name: str, step: int, weight_version: str | None = None
) -> Manifest:
    """Write (or replace, atomically) the manifest of a Hugging Face model directory, hashed from
    its files; raises as ``manifest_from_files``."""
    directory = Path(directory)
    manifest = manifest_from_files(directory, model_name=model_name, step=step, weight_version=weight_version)
    write_manifest(directory, manifest)
    return manifest


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for filename in filenames:
            with open(os.path.join(dirpath, filename), "rb") as f:
                os.fsync(f.fileno())
        fsync_directory(Path(dirpath))


def _move_into_place(tmp: Path, target: Path, *, overwrite: bool) -> None:
    if not overwrite or not target.exists():
        if not _renameat2(tmp, target, _RENAME_NOREPLACE):
            # No renameat2 here: plain rename, which refuses a non-empty target (our check above
            # covers the rest; the window is a race with another writer of the same path).
            try:
                os.rename(tmp, target)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    raise CheckpointExistsError("checkpoint target appeared while writing", path=str(target)) from None
                raise
    elif _renameat2(tmp, target, _RENAME_EXCHANGE):
        # One atomic swap: readers of ``target`` see the old checkpoint or the new one, never neither.
        shutil.rmtree(tmp)
    else:
        aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, aside)
        os.rename(tmp, target)
        shutil.rmtree(aside)
    fsync_directory(target.parent)


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2``: True when done, False when this system or filesystem lacks it.
    Raises CheckpointExistsError (RENAME_NOREPLACE and ``dst`` exists), else CheckpointError."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    if err == errno.EEXIST:
        raise CheckpointExistsError("checkpoint target appeared while writing", path=str(dst))
    raise CheckpointError(f"renaming the checkpoint into place failed: {os.strerror(err)}", src=str(src), dst=str(dst))

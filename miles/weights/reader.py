"""CheckpointReader: how an inference server loads an update from a checkpoint's files.

``open_checkpoint`` -> ``verify()`` (refuse on any problem) -> compare names, shapes and dtypes
with the live model -> copy each tensor in (``copy_into``: its digest as it is read) -> confirm.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from miles.errors import CheckpointError
from miles.weights.checksum import collect_slots
from miles.weights.manifest import Manifest, read_manifest
from miles.weights.safetensors_io import SafetensorsFile, TensorSlot
from miles.weights.verification import VerificationReport, compare_with_manifest, digest_problems


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What a checkpoint holds under one name, read from the file's header."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str
    nbytes: int


class CheckpointReader(AbstractContextManager["CheckpointReader"]):
    """An open checkpoint: its manifest and its open weight files. Use ``open_checkpoint``."""

    def __init__(self, *, directory: Path, manifest: Manifest, files: dict[str, SafetensorsFile]) -> None:
        self.directory = directory
        self.manifest = manifest
        self._files = files
        names = {mapped.path: file_name for file_name, mapped in files.items()}
        self._index = {
            slot.name: (names[mapped.path], slot) for mapped, slot in collect_slots(f for _, f in sorted(files.items()))
        }
        self.tensor_names: tuple[str, ...] = tuple(sorted(self._index))

    def info(self, name: str) -> TensorInfo:
        """Tensor ``name`` as its file's header describes it; CheckpointError if there is none."""
        file_name, slot = self._lookup(name)
        return TensorInfo(name=name, dtype=slot.dtype, shape=slot.shape, file=file_name, nbytes=slot.nbytes)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, read from its file into a new CPU tensor. Raises CheckpointError for no
        such tensor, a closed reader, or a file cut or rewritten since it was opened."""
        file_name, slot = self._lookup(name)
        return self._files[file_name].tensor(slot)

    def copy_into(self, name: str, target: torch.Tensor) -> str:
        """Copy tensor ``name`` from its file into ``target`` (a tensor of its dtype and shape) and
        return the digest of the bytes read. Raises CheckpointError as ``tensor``."""
        file_name, slot = self._lookup(name)
        return self._files[file_name].copy_into(slot, target)

    def verify(self, *, threads: int | None = None, digests: bool = True) -> VerificationReport:
        """Hash every tensor in the files and compare with the manifest (with ``digests=False``,
        only names, dtypes and shapes: no byte is read); never raises for a mismatch."""
        if not self._files and self.manifest.files:
            raise CheckpointError("checkpoint reader is closed", path=str(self.directory))
        problems, checksum = compare_with_manifest(self.manifest, self._files, threads=threads, digests=digests)
        return VerificationReport(self.directory, self.manifest, tuple(problems), checksum)

    def check_digests(self, digests: Mapping[str, str]) -> VerificationReport:
        """Compare the digests of tensors read from the files (``copy_into``) with the manifest."""
        problems = tuple(digest_problems(self.manifest, digests))
        return VerificationReport(self.directory, self.manifest, problems, None if problems else self.manifest.checksum)

    def close(self) -> None:
        """Close the files (tensors already read stay valid)."""
        files, self._files = self._files, {}
        for mapped in files.values():
            mapped.close()

    def _lookup(self, name: str) -> tuple[str, TensorSlot]:
        if not self._files:
            raise CheckpointError("checkpoint reader is closed", path=str(self.directory))
        try:
            return self._index[name]
        except KeyError:
            raise CheckpointError(
                "checkpoint holds no tensor of this name", tensor=name, path=str(self.directory)
            ) from None

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_checkpoint(directory: str | os.PathLike[str], *, manifest: Manifest | None = None) -> CheckpointReader:
    """The checkpoint in ``directory`` with its manifest (unless given) and weight files open;
    nothing is hashed: ``verify()`` before trusting the bytes. Raises as ``read_manifest`` and
    ``SafetensorsFile`` for a weight file the manifest names."""
    directory = Path(directory)
    manifest = read_manifest(directory) if manifest is None else manifest
    with ExitStack() as stack:
        files = {name: stack.enter_context(SafetensorsFile(directory / name)) for name in sorted(manifest.files)}
        reader = CheckpointReader(directory=directory, manifest=manifest, files=files)
        # Success: the reader owns the open files now, so the stack must not close them.
        stack.pop_all()
    return reader

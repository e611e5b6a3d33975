"""CheckpointReader: how an inference server loads an update, zero-copy from memory-mapped files.

The intended path: ``open_checkpoint`` -> ``verify()`` (refuse on any problem) -> compare names,
shapes and dtypes with the live model -> ``param.copy_(reader.tensor(name))`` for each ->
``checksum_module(model)`` to confirm. ``tensor()`` is a view over the map, so the only copy
of the bytes is the one into the parameter.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from miles.errors import CheckpointError, CheckpointFileInvalidError
from miles.weights.manifest import Manifest, read_manifest
from miles.weights.safetensors_io import MappedSafetensors, TensorSlot
from miles.weights.verification import VerificationReport, compare_with_manifest


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What a checkpoint holds under one name, read from the file's header."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str
    nbytes: int


class CheckpointReader:
    """An open checkpoint: its manifest and its memory-mapped weight files. Use ``open_checkpoint``."""

    def __init__(self, *, directory: Path, manifest: Manifest, files: dict[str, MappedSafetensors]) -> None:
        self.directory = directory
        self.manifest = manifest
        self._files = files
        self._index: dict[str, tuple[str, TensorSlot]] = {}
        for file_name, mapped in sorted(files.items()):
            for name, slot in mapped.tensors.items():
                if name in self._index:
                    raise CheckpointFileInvalidError(
                        "tensor appears in two safetensors files",
                        tensor=name,
                        first=self._index[name][0],
                        second=file_name,
                    )
                self._index[name] = (file_name, slot)
        self.tensor_names: tuple[str, ...] = tuple(sorted(self._index))

    def info(self, name: str) -> TensorInfo:
        """Dtype, shape, file and size of tensor ``name`` (from the file, not the manifest).

        Raises:
            CheckpointError: no tensor of that name.
        """
        file_name, slot = self._lookup(name)
        return TensorInfo(name=name, dtype=slot.dtype, shape=slot.shape, file=file_name, nbytes=slot.nbytes)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a zero-copy CPU view over the mapped file (writable copy-on-write).

        The tensor stays valid after ``close()``: it keeps its mapping alive itself.

        Raises:
            CheckpointError: no tensor of that name, or the reader is closed.
        """
        file_name, slot = self._lookup(name)
        return self._files[file_name].tensor(slot)

    def verify(self, *, threads: int | None = None) -> VerificationReport:
        """Hash every tensor in the maps and compare with the manifest; never raises for a mismatch.

        It checks the bytes this reader hands out, so a write made through one of its tensors
        shows as a digest mismatch (the file itself never changes).
        """
        if not self._files and self.manifest.files:
            raise CheckpointError("checkpoint reader is closed", path=str(self.directory))
        problems, checksum = compare_with_manifest(self.manifest, self._files, threads=threads)
        return VerificationReport(self.directory, self.manifest, tuple(problems), checksum)

    def close(self) -> None:
        """Release the maps (those still viewed by live tensors go when the tensors do)."""
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

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_checkpoint(directory: str | os.PathLike[str]) -> CheckpointReader:
    """Open the checkpoint in ``directory``: read its manifest and headers, map its weight files.

    Nothing is hashed here; call ``verify()`` before trusting the bytes.

    Raises:
        ManifestMissingError / ManifestInvalidError: the manifest is missing or invalid.
        CheckpointFileMissingError / CheckpointFileTruncatedError / CheckpointFileInvalidError:
            a weight file named by the manifest is missing, cut, or malformed.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    with ExitStack() as stack:
        files = {name: stack.enter_context(MappedSafetensors(directory / name)) for name in sorted(manifest.files)}
        reader = CheckpointReader(directory=directory, manifest=manifest, files=files)
        # Success: the reader owns the maps now, so the stack must not close them.
        stack.pop_all()
    return reader

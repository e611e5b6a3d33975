"""Read safetensors files ourselves: parse the header, read each tensor's byte range.

Not ``safetensors.safe_open``: the checksum and the verifier hash each tensor's bytes a slice at a
time by their offsets in the file, which ``safe_open`` never gives, and the verifier must tell a
truncated file from a malformed one, which it cannot. Tensor bytes are row-major little-endian,
torch's in-memory layout here, so a digest of the file bytes equals the loaded tensor's.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import BinaryIO

import numpy
import torch

from miles.errors import (
    CheckpointFileInvalidError,
    CheckpointFileMissingError,
    CheckpointFileTruncatedError,
)
from miles.weights.digest import TensorHasher, digest_buffer

# A header larger than this is not a real header but garbage in the length field (the
# safetensors library uses the same bound).
MAX_HEADER_BYTES = 100_000_000

METADATA_KEY = "__metadata__"

SAFETENSORS_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U64": torch.uint64,
        "U32": torch.uint32,
        "U16": torch.uint16,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "C64": torch.complex64,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
        "F8_E8M0": torch.float8_e8m0fnu,
    }
)

if sys.byteorder != "little":  # pragma: no cover - no big-endian machine runs torch wheels we pin
    raise ImportError("miles.weights assumes a little-endian machine (safetensors byte order)")


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a torch dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor lives in a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def open_regular(path: Path) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file; CheckpointFileInvalidError otherwise,
    FileNotFoundError and NotADirectoryError passed through. A checkpoint is data an attacker may
    shape: a FIFO would block a plain ``open`` forever, and a device file would be read as weights.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as exc:
        raise CheckpointFileInvalidError(f"cannot be opened ({exc.strerror})", path=str(path)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointFileInvalidError("not a regular file", path=str(path))  # noqa: TRY301  # fd closed below
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_header(path: str | os.PathLike[str]) -> Mapping[str, TensorSlot]:
    """The tensors the header of the safetensors file at ``path`` lists, each one's bytes checked to lie in
    the file and to match its dtype and shape. Raises CheckpointFileMissingError (no file), CheckpointFileTruncatedError
    (it ends before the header or a tensor's bytes), CheckpointFileInvalidError (a malformed header)."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointFileTruncatedError(
                    "safetensors file is shorter than its 8-byte header length", path=str(path), size=size
                )
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointFileInvalidError(
                    "safetensors header length is implausibly large", path=str(path), header_len=header_len
                )
            raw = f.read(header_len)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointFileMissingError("safetensors file does not exist", path=str(path)) from None
    except OSError as exc:  # a read error of the device or filesystem
        raise CheckpointFileInvalidError(f"cannot be read ({exc.strerror})", path=str(path)) from None
    if len(raw) < header_len:
        raise CheckpointFileTruncatedError(
            "safetensors file ends inside its header", path=str(path), size=size, header_len=header_len
        )
    data_start = 8 + header_len
    try:
        parsed = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointFileInvalidError(f"safetensors header is not JSON: {exc}", path=str(path)) from None
    if not isinstance(parsed, dict):
        raise CheckpointFileInvalidError("safetensors header is not a JSON object", path=str(path))
    metadata = parsed.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFileInvalidError("safetensors __metadata__ is not a str -> str object", path=str(path))
    tensors = {name: _parse_entry(path, name, entry, data_start) for name, entry in parsed.items()}
    # Check truncation after parsing every entry, so a malformed entry is reported as invalid
    # rather than hidden behind a truncation of an earlier one.
    for slot in tensors.values():
        if slot.end > size:
            raise CheckpointFileTruncatedError(
                f"safetensors file ends before the bytes of tensor {slot.name!r}",
                path=str(path),
                size=size,
                needed=slot.end,
            )
    return MappingProxyType(tensors)


def _parse_entry(path: Path, name: str, entry: object, data_start: int) -> TensorSlot:
    def invalid(what: str) -> CheckpointFileInvalidError:
        return CheckpointFileInvalidError(f"safetensors entry {name!r}: {what}", path=str(path))

    if not isinstance(entry, dict):
        raise invalid("is not an object")
    dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise invalid(f"unknown dtype {entry.get('dtype')!r}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise invalid(f"shape {shape!r} is not a list of non-negative integers")
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise invalid(f"data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    expected = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != expected:
        raise invalid(f"holds {offsets[1] - offsets[0]} bytes but dtype and shape need {expected}")
    return TensorSlot(
        name=name, dtype=dtype, shape=tuple(shape), begin=data_start + offsets[0], end=data_start + offsets[1]
    )


class SafetensorsFile(AbstractContextManager["SafetensorsFile"]):
    """One safetensors file, open: its header parsed (raises as ``read_header``), its tensors'
    bytes read with ``pread``. Never memory-mapped: a mapped file cut short while it is read kills
    its reader with SIGBUS; read, it gives an error naming what happened."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tensors = read_header(self.path)
        self._file: BinaryIO | None = open_regular(self.path)

    def digest(self, slot: TensorSlot, *, into: numpy.ndarray | None = None) -> str:
        """The digest of ``slot``'s bytes, read a slice at a time into this thread's buffer, which
        stays in cache while it is hashed (and copied on into the uint8 array ``into``: reading
        straight into fresh memory runs at half the speed here)."""
        hasher = TensorHasher()
        buffer = _read_buffer()
        staged = numpy.frombuffer(buffer, dtype=numpy.uint8)
        for start in range(0, slot.nbytes, len(buffer)):
            view = buffer[: min(len(buffer), slot.nbytes - start)]
            self._read_into(view, slot.begin + start)
            hasher.update(view)
            if into is not None:
                numpy.copyto(into[start : start + len(view)], staged[: len(view)])
        return hasher.hexdigest()

    def copy_into(self, slot: TensorSlot, target: torch.Tensor) -> str:
        """Copy ``slot``'s bytes into ``target`` (of its dtype and shape) and return their digest."""
        if target.device.type != "cpu" or not target.is_contiguous():
            # A GPU tensor or a strided view (of a fused weight): read whole on the host, then copied.
            source = self.tensor(slot)
            with torch.no_grad():
                target.copy_(source)
            return digest_buffer(source.reshape(-1).view(torch.uint8).numpy())
        return self.digest(slot, into=target.reshape(-1).view(torch.uint8).numpy())

    def tensor(self, slot: TensorSlot) -> torch.Tensor:
        """A new CPU tensor holding ``slot``'s bytes (the process's own memory, writable)."""
        out = torch.empty(slot.shape, dtype=slot.dtype)
        raw = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        for start in range(0, len(raw), READ_SLICE_BYTES):
            self._read_into(raw[start : start + READ_SLICE_BYTES], slot.begin + start)
        return out

    def _read_into(self, view: memoryview, offset: int) -> None:
        if self._file is None:
            raise CheckpointFileInvalidError("safetensors file is closed", path=str(self.path))
        done = 0
        while done < len(view):
            got = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            if got == 0:
                raise CheckpointFileTruncatedError(
                    f"safetensors file ended at byte {offset + done} while it was being read: it was cut "
                    "or rewritten meanwhile; load it again once it is complete",
                    path=str(self.path),
                )
            done += got

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# How much of a file is read per ``pread``: small enough that the bytes are still in cache when
# they are hashed or copied on.
READ_SLICE_BYTES = 1 << 20
_buffers = threading.local()


def _read_buffer() -> memoryview:
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = memoryview(bytearray(READ_SLICE_BYTES))
    return buffer


def index_files(directory: Path) -> list[Path]:
    """The safetensors files of the Hugging Face model in ``directory``: those its
    ``model.safetensors.index.json`` names (as ``from_pretrained`` reads them), else every
    ``*.safetensors``, sorted. Raises CheckpointFileInvalidError for an index that is invalid or
    names files outside the directory."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CheckpointFileInvalidError(f"safetensors index is not valid: {exc!r}", path=str(index)) from None
        # The index is data from the checkpoint: a shard named "../../x" or "/x" would be read
        # from outside the directory (and outside any allowed root).
        escaping = [n for n in names if not isinstance(n, str) or Path(n).is_absolute() or ".." in Path(n).parts]
        if escaping:
            raise CheckpointFileInvalidError(
                f"safetensors index names files outside the checkpoint: {escaping[:3]!r}", path=str(index)
            )
        return [directory / name for name in names]
    return sorted(p for p in directory.glob("*.safetensors") if p.is_file())

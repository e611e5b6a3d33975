"""Buckets: many named tensors moved as one flat run of bytes, so that an update takes a number of
calls that does not grow with the number of tensors. A ``BucketTable`` says where each tensor lies
and carries its digest, computed as it is packed and checked by the receiver (``Received``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field

from miles.errors import InvalidRequestError
from miles.weights.checksum import TensorDigest, digest_tensor
from miles.weights.digest import copy_and_digest
from miles.weights.safetensors_io import SAFETENSORS_DTYPES, dtype_name

# Default bucket size: large enough that per-call costs vanish, small enough to stage twice.
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
# Every dtype a checkpoint can hold, by torch's name.
TORCH_DTYPES = {dtype_name(dtype): dtype for dtype in SAFETENSORS_DTYPES.values()}


def torch_dtype(name: str, dtype: str) -> torch.dtype:
    """Tensor ``name``'s ``dtype`` by its torch name (``torch.`` prefix allowed); InvalidRequestError for another."""
    try:
        return TORCH_DTYPES[dtype.removeprefix("torch.")]
    except KeyError:
        raise InvalidRequestError(f"tensor {name!r} has dtype {dtype!r}; known: {', '.join(TORCH_DTYPES)}") from None


class BucketEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=1024)]
    dtype: str  # torch's name, as SGLang sends it: "bfloat16", "float32", ...
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    offset: Annotated[int, Field(ge=0)]
    nbytes: Annotated[int, Field(ge=0)]
    digest: Annotated[str, Field(min_length=32, max_length=32, pattern=r"^[0-9a-f]+$")] | None = None

    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.name, self.dtype)

    def tensor_digest(self) -> TensorDigest:
        assert self.digest is not None
        return TensorDigest(name=self.name, dtype=self.dtype, shape=self.shape, digest=self.digest)


class BucketTable(BaseModel):
    """Where each tensor of one bucket lies in its flat bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    entries: tuple[BucketEntry, ...]

    @property
    def total_bytes(self) -> int:
        """Where the last tensor ends: how many bytes the flat run must hold."""
        return max((e.offset + e.nbytes for e in self.entries), default=0)

    @property
    def nbytes(self) -> int:
        """The bytes of the tensors themselves."""
        return sum(e.nbytes for e in self.entries)


def plan(named: Mapping[str, torch.Tensor], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[str]]:
    """The tensor names of each bucket, in order; a tensor bigger than a bucket gets its own."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name, tensor in named.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return [b for b in buckets if b]


def regions(buckets: int) -> int:
    """Buffers a sender of ``buckets`` buckets packs into: two, one packed while the receivers take
    the other, unless there is no next bucket to pack."""
    return min(2, buckets)


def layout(named: Mapping[str, torch.Tensor], names: Iterable[str], *, start: int = 0) -> BucketTable:
    """The table of ``names`` packed back to back from byte ``start`` (digests not yet known)."""
    entries, offset = [], start
    for name in names:
        tensor = named[name]
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(
            BucketEntry(
                name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), offset=offset, nbytes=nbytes
            )
        )
        offset += nbytes
    return BucketTable(entries=tuple(entries))


# Below this many bytes a bucket is packed on one thread: more cost more than they save.
_PARALLEL_PACK_BYTES = 16 * 1024 * 1024


@torch.no_grad()
def pack(named: Mapping[str, torch.Tensor], table: BucketTable, into: torch.Tensor) -> BucketTable:
    """Copy each tensor of ``table`` into the flat uint8 tensor ``into`` at its offset, digesting
    the bytes as they are written; returns the table with the digests once the copies are done. A
    large host bucket is packed on torch's threads (the copy and the hash release the GIL)."""
    flat = into.reshape(-1).view(torch.uint8)

    def one(entry: BucketEntry) -> BucketEntry:
        source = named[entry.name].detach().contiguous().reshape(-1).view(torch.uint8)
        digest = copy_and_digest(flat[entry.offset : entry.offset + entry.nbytes], source)
        return entry.model_copy(update={"digest": digest})

    threads = min(torch.get_num_threads(), len(table.entries))
    if flat.device.type == "cpu" and threads >= 2 and table.nbytes >= _PARALLEL_PACK_BYTES:
        largest_first = sorted(table.entries, key=lambda e: e.nbytes, reverse=True)
        with ThreadPoolExecutor(threads, thread_name_prefix="miles-pack") as pool:
            done = dict(zip((e.name for e in largest_first), pool.map(one, largest_first), strict=True))
        return BucketTable(entries=tuple(done[e.name] for e in table.entries))
    packed = BucketTable(entries=tuple(one(e) for e in table.entries))
    if flat.device.type != "cpu":
        torch.cuda.synchronize(flat.device)
    return packed


class Received:
    """One bucket's tensors as they arrived, with the digests they were sent with, unchecked: whoever
    copies them out checks each over the bytes it copied (``copy_into``, ``check``) or first
    calls ``verify``."""

    def __init__(self, entries: Iterable[BucketEntry], *, tensors: Mapping[str, torch.Tensor]) -> None:
        self.entries: Mapping[str, BucketEntry] = {e.name: e for e in entries}
        self.digests: Mapping[str, str] = {n: e.digest for n, e in self.entries.items() if e.digest is not None}
        self.tensors = tensors

    def copy_into(self, name: str, target: torch.Tensor) -> str:
        """Copy tensor ``name`` into ``target`` (a tensor of its dtype and shape) and return the
        digest of the bytes ``target`` now holds."""
        return copy_and_digest(target, self.tensors[name])

    def check(self, name: str, actual: str) -> None:
        """Raise InvalidRequestError when ``actual`` is not the digest ``name`` was sent with."""
        expected = self.digests.get(name)
        if expected is not None and actual != expected:
            raise InvalidRequestError(
                f"tensor {name!r} arrived with digest {actual}, not the {expected} it was sent "
                "with: the bytes were corrupted on the way; push the update again"
            )

    def verify(self) -> None:
        """Check every tensor against its digest (raises as ``check``)."""
        for name, tensor in self.tensors.items():
            if name in self.digests:
                self.check(name, digest_tensor(tensor))

    def close(self) -> None:
        self.tensors = {}


def unpack(table: BucketTable, flat: torch.Tensor) -> Received:
    """Views of each tensor of ``table`` in the flat uint8 tensor ``flat``, with their digests.
    Raises InvalidRequestError naming the first tensor that lies outside the bytes, whose size
    does not match its dtype and shape, or that appears twice."""
    flat = flat.reshape(-1).view(torch.uint8)
    size = flat.numel()
    tensors: dict[str, torch.Tensor] = {}
    for entry in table.entries:
        dtype = entry.torch_dtype()
        expected = math.prod(entry.shape) * torch.empty((), dtype=dtype).element_size()
        if entry.nbytes != expected:
            raise InvalidRequestError(
                f"tensor {entry.name!r} says {entry.nbytes} bytes, but "
                f"{entry.dtype}{list(entry.shape)} takes {expected}"
            )
        if entry.offset + entry.nbytes > size:
            raise InvalidRequestError(
                f"tensor {entry.name!r} ends at byte {entry.offset + entry.nbytes}, past the bucket's {size} bytes"
            )
        if entry.name in tensors:
            raise InvalidRequestError(f"tensor {entry.name!r} appears twice in one bucket")
        raw = flat[entry.offset : entry.offset + entry.nbytes]
        if (flat.storage_offset() + entry.offset) % dtype.itemsize:
            # Packed back to back after a tensor of a smaller dtype: torch views only aligned bytes.
            raw = raw.clone()
        tensors[entry.name] = (
            raw.view(dtype).reshape(entry.shape) if entry.nbytes else torch.empty(entry.shape, dtype=dtype)
        )
    return Received(table.entries, tensors=tensors)

"""The digest of one tensor's bytes, and how to compute it from any pieces of them.

A tensor's digest is xxh3-128 over the concatenated xxh3-128 digests (16 bytes each, big-endian as
``xxhash`` gives them) of its bytes' consecutive 256 KiB chunks, the last one possibly shorter; a
tensor of no bytes has no chunk, so its digest is xxh3-128 of nothing. The bytes are the tensor's
raw row-major bytes, exactly what a safetensors file stores.

Chunked so that whoever holds part of a tensor can hash it (a sharded trainer's ranks hash the
chunks inside their rows). The size is measured: per 64 KiB two threads hashed no faster than one
(26 GB/s); per 256 KiB 33 GB/s on one thread, 43 on two (1 MiB: 35 and 45).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch
import xxhash

CHUNK_BYTES: Final = 256 * 1024
# Copy and hash in slices this big: the slice just written is still in the core's cache when it
# is hashed, so the hash costs a cache read instead of a second pass over memory. Source and
# target slices should both fit in L2 (2 MiB per core on the machines measured); smaller slices
# pay per-slice overhead (`benchmarks/checksum.py` compares sizes; docs/PERFORMANCE.md). A
# multiple of CHUNK_BYTES, so no chunk is split between two slices.
COPY_SLICE_BYTES = 1024 * 1024


def chunk_digest(chunk: object) -> bytes:
    """The 16-byte digest of one chunk (any object with the buffer protocol)."""
    return xxhash.xxh3_128_digest(chunk)  # type: ignore[arg-type]


class TensorHasher:
    """A tensor's digest from its bytes given in order, in pieces of any size (``update``), or
    from the digests of whole chunks hashed elsewhere (``update_chunks``)."""

    def __init__(self) -> None:
        self._outer = xxhash.xxh3_128()
        self._carry = bytearray()  # the start of a chunk whose end has not come yet

    def update(self, data: object) -> None:
        """Hash the next bytes (any object with the buffer protocol)."""
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        if self._carry:
            take = min(CHUNK_BYTES - len(self._carry), len(view))
            self._carry += view[:take]
            view = view[take:]
            if len(self._carry) < CHUNK_BYTES:
                return
            self._outer.update(chunk_digest(self._carry))
            self._carry.clear()
        whole = len(view) - len(view) % CHUNK_BYTES
        for start in range(0, whole, CHUNK_BYTES):
            self._outer.update(chunk_digest(view[start : start + CHUNK_BYTES]))
        if whole < len(view):
            self._carry += view[whole:]

    def update_chunks(self, digests: bytes) -> None:
        """Take the digests of the next whole chunks (16 bytes each), hashed by someone else."""
        if self._carry:
            raise ValueError("chunk digests can only follow whole chunks")
        self._outer.update(digests)

    def hexdigest(self) -> str:
        outer = self._outer.copy()
        if self._carry:
            outer.update(chunk_digest(self._carry))
        return outer.hexdigest()


def digest_buffer(buffer: object) -> str:
    """The digest of the bytes of ``buffer`` (any object with the buffer protocol)."""
    hasher = TensorHasher()
    hasher.update(buffer)
    return hasher.hexdigest()


def copy_and_digest(target: torch.Tensor, source: torch.Tensor) -> str:
    """Copy ``source`` into ``target`` (of its dtype and shape) and return the digest of what
    ``target`` now holds, each slice hashed right after it is written."""
    source = source.detach()
    cpu = target.device.type == "cpu" and source.device.type == "cpu"
    if not (cpu and target.is_contiguous() and source.is_contiguous()) or target.numel() == 0:
        with torch.no_grad():
            target.copy_(source)
        raw = target.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        return digest_buffer(raw.numpy())
    # numpy views of the raw bytes: np.copyto releases the GIL and runs no OpenMP team.
    dst = target.reshape(-1).view(torch.uint8).numpy()
    src = source.reshape(-1).view(torch.uint8).numpy()
    hasher = TensorHasher()
    for start in range(0, dst.size, COPY_SLICE_BYTES):
        end = min(start + COPY_SLICE_BYTES, dst.size)
        np.copyto(dst[start:end], src[start:end])
        hasher.update(dst[start:end])
    return hasher.hexdigest()

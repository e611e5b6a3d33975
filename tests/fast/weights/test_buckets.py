"""The bucket format pushes share: tensors packed back to back with their digests, read back by
an engine from the flat bytes or from a shared-memory segment, whatever the mix of dtypes and whatever offsets a
sender claims."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import pytest
import torch

from miles.errors import InvalidRequestError
from miles.testing import bucket_segment
from miles.weights.buckets import BucketEntry, BucketTable, layout, pack, unpack
from miles.weights.checksum import digest_tensor
from miles.weights.transport.segments import SegmentMaps, SegmentRef


def test_mixed_dtypes_packed_back_to_back_come_back_equal_with_their_digests() -> None:
    # An odd number of bfloat16 values leaves the next float32 and float64 tensors unaligned.
    named = {
        "a": torch.randn(3, dtype=torch.bfloat16),
        "b": torch.randn(5, 7),
        "c": torch.randn(2, dtype=torch.float64),
        "d": torch.arange(9, dtype=torch.int8),
    }
    table = layout(named, list(named))
    assert [e.offset for e in table.entries] == [0, 6, 146, 162]
    flat = torch.empty(table.total_bytes, dtype=torch.uint8)
    packed = pack(named, table, flat)
    received = unpack(packed, flat)
    for name, tensor in named.items():
        assert torch.equal(received.tensors[name], tensor), name
        received.check(name, digest_tensor(received.tensors[name]))
        assert received.digests[name] == digest_tensor(tensor)


def test_a_tensor_the_bytes_do_not_hold_is_refused_by_name() -> None:
    flat = torch.zeros(64, dtype=torch.uint8)

    def table(**entry: object) -> BucketTable:
        return BucketTable(entries=(BucketEntry(**{"name": "w", "dtype": "float32", "shape": (4,), **entry}),))

    assert torch.equal(unpack(table(offset=1, nbytes=16), flat).tensors["w"], torch.zeros(4))
    with pytest.raises(InvalidRequestError, match="'w' ends at byte 65"):
        unpack(table(offset=49, nbytes=16), flat)
    with pytest.raises(InvalidRequestError, match="'w' says 12 bytes"):
        unpack(table(offset=0, nbytes=12), flat)
    with pytest.raises(InvalidRequestError, match="'w' has dtype 'complex32'"):
        unpack(table(offset=0, nbytes=16, dtype="complex32"), flat)


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_a_large_bucket_packed_on_two_threads_holds_every_tensor_with_its_digest() -> None:
    generator = torch.Generator().manual_seed(0)
    named = {f"w{i}": torch.randn(1_500_000 + i, generator=generator) for i in range(4)}  # 24 MB
    named["small"] = torch.arange(3, dtype=torch.bfloat16)
    table = layout(named, list(named))
    flat = torch.empty(table.total_bytes, dtype=torch.uint8)
    packed = pack(named, table, flat)
    assert [e.name for e in packed.entries] == list(named)  # in table order, whatever the threads
    received = unpack(packed, flat)
    for name, tensor in named.items():
        assert torch.equal(received.tensors[name], tensor), name
        assert received.digests[name] == digest_tensor(tensor)


def test_a_bucket_in_a_segment_is_read_like_one_in_memory() -> None:
    named = {
        "a": torch.randn(3, dtype=torch.bfloat16),
        "b": torch.randn(5, 7),  # unaligned in the segment, after 6 bytes of bfloat16
        "c": torch.arange(9, dtype=torch.int8),
        "empty": torch.empty(0, 4),
    }
    segment, packed = bucket_segment(named)
    received = unpack(packed, SegmentMaps().flat(segment.ref, packed.total_bytes))
    for name, tensor in named.items():
        target = torch.empty_like(tensor)
        received.check(name, received.copy_into(name, target))
        assert torch.equal(target, tensor), name
    # Into a strided view (a part of a fused weight).
    fused = torch.zeros(7, 5)
    received.check("b", received.copy_into("b", fused.t()))
    assert torch.equal(fused.t(), named["b"])
    with pytest.raises(InvalidRequestError, match="'b' ends at byte 146, past the bucket's 100 bytes"):
        unpack(packed, segment.flat[:100])
    segment.close()


def test_tensors_far_apart_in_a_segment_are_read_without_what_lies_between() -> None:
    """Only each tensor's bytes are faulted in: a sealed segment whose tensors lie a terabyte apart
    costs their bytes, not a terabyte."""
    named = {"a": torch.randn(4, 8), "b": torch.randn(16)}
    gap = 1 << 40
    table = BucketTable(entries=(*layout(named, ["a"]).entries, *layout(named, ["b"], start=gap).entries))
    fd = os.memfd_create("miles-sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, table.total_bytes)
        for entry in table.entries:
            os.pwrite(fd, named[entry.name].numpy().tobytes(), entry.offset)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        ref = SegmentRef(pid=os.getpid(), fd=fd, name="miles-sparse")
        tensors = unpack(table, SegmentMaps().flat(ref, table.total_bytes)).tensors
        assert {n: torch.equal(t, named[n]) for n, t in tensors.items()} == {"a": True, "b": True}
    finally:
        os.close(fd)

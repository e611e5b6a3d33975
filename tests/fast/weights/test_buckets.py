"""The bucket format pushes share: tensors packed back to back with their digests, read back by
an engine from the flat bytes, whatever the mix of dtypes and whatever offsets a sender claims."""

from __future__ import annotations

import pytest
import torch

from miles.errors import InvalidRequestError
from miles.weights.buckets import BucketEntry, BucketTable, layout, pack, unpack
from miles.weights.checksum import digest_tensor


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

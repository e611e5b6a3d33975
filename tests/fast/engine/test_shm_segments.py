"""What an engine maps for a shared-memory push: only a sealed memory file of miles' of the right
size, refused by name otherwise, never a wait; a sender cannot cut a segment short under a reader,
and a mapping is kept while its maker holds the segment (the HTTP side is tested in
tests/train/test_push.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from miles.errors import InvalidRequestError, NotFoundError
from miles.weights.buckets import layout, pack, unpack
from miles.weights.transport.segments import MAX_MAPPED, Segment, SegmentMaps, SegmentRef


def test_a_segment_is_mapped_and_its_bytes_read() -> None:
    segment = Segment(16)
    segment.flat.copy_(torch.arange(16, dtype=torch.uint8))
    flat = SegmentMaps().flat(segment.ref, 16)
    assert flat.tolist() == list(range(16))
    segment.flat[3] = 99  # one memory: what the maker writes, the reader sees
    assert flat[3].item() == 99
    segment.close()


def test_a_sealed_segment_cannot_be_cut_short_or_grown() -> None:
    segment = Segment(4096)
    for size in (100, 8192):
        with pytest.raises(PermissionError):
            os.ftruncate(segment.ref.fd, size)
    assert os.fstat(segment.ref.fd).st_size == 4096
    segment.close()


def test_what_is_not_a_segment_is_refused_without_waiting(tmp_path: object) -> None:
    maps = SegmentMaps()
    gone = SegmentRef(pid=2**31 - 1, fd=3, name="miles-nobody")
    with pytest.raises(NotFoundError, match="no shared-memory segment 'miles-nobody'"):
        maps.flat(gone, 16)
    # A descriptor of this process's that is no segment: a pipe (opening it would wait for a
    # writer), a regular file, a memory file under another name, one left unsealed.
    read_end, write_end = os.pipe()
    unsealed = os.memfd_create("miles-unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 64)
    other = os.memfd_create("something-else", os.MFD_CLOEXEC)
    with open(__file__, "rb") as regular:
        cases = [
            (read_end, "miles-pipe", "is not the shared-memory segment"),
            (regular.fileno(), "miles-file", "is not the shared-memory segment"),
            (other, "miles-other", "is not the shared-memory segment"),
            (unsealed, "miles-unsealed", "not sealed against shrinking"),
        ]
        for fd, name, says in cases:
            with pytest.raises(InvalidRequestError, match=says):
                maps.flat(SegmentRef(pid=os.getpid(), fd=fd, name=name), 16)
    small = Segment(8)
    with pytest.raises(InvalidRequestError, match="holds 8 bytes, fewer than the 16"):
        maps.flat(small.ref, 16)
    for fd in (read_end, write_end, unsealed, other):
        os.close(fd)
    small.close()


def test_a_segment_of_another_process_is_read_as_it_was_packed() -> None:
    named = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(8192, dtype=torch.bfloat16)}
    table = layout(named, named)
    segment = Segment(table.total_bytes)
    table = pack(named, table, segment.flat)
    reader = (
        "import sys, torch; from miles.weights.transport.segments import SegmentMaps, SegmentRef; "
        "from miles.weights.buckets import BucketTable, unpack; "
        "ref = SegmentRef.model_validate_json(sys.argv[1]); table = BucketTable.model_validate_json(sys.argv[2]); "
        "got = unpack(table, SegmentMaps().flat(ref, table.total_bytes)); got.verify(); "
        "print(float(got.tensors['a'].sum()), float(got.tensors['b'].float().sum()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", reader, segment.ref.model_dump_json(), table.model_dump_json()],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.split() == [str(float(named["a"].sum())), "8192.0"]
    got = unpack(table, SegmentMaps().flat(segment.ref, table.total_bytes))
    target = torch.empty(8192, dtype=torch.bfloat16)
    got.check("b", got.copy_into("b", target))
    assert torch.equal(target, named["b"])
    segment.close()


def test_a_mapping_is_kept_while_its_maker_holds_the_segment_and_forgotten_after() -> None:
    maps = SegmentMaps()
    segment = Segment(64)
    first = maps.flat(segment.ref, 64)
    assert maps.flat(segment.ref, 64) is first  # mapped once, for every push that names it
    assert maps.forget_gone() == []
    name = segment.ref.name
    segment.close()
    assert maps.forget_gone() == [name]
    # Its descriptor number may now name something else: that is refused, never read.
    with pytest.raises((NotFoundError, InvalidRequestError)):
        maps.flat(segment.ref, 64)


def test_an_engine_keeps_a_few_segments_mapped_whoever_names_many() -> None:
    """A sender naming a new segment at every push leaves no mapping (nor descriptor) behind for
    each: the oldest goes, and a bucket still viewing it keeps its bytes."""
    maps = SegmentMaps()
    made = [Segment(64) for _ in range(MAX_MAPPED + 4)]
    held = maps.flat(made[0].ref, 64)
    made[0].flat.fill_(9)
    for segment in made[1:]:
        maps.flat(segment.ref, 64)
    assert len(maps._maps) == MAX_MAPPED
    assert held.tolist() == [9] * 64  # unmapped from the cache, still readable by its viewer
    for segment in made:
        segment.close()

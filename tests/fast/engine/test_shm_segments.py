"""What an engine reads for a shared-memory push: only a regular file of the right size in
/dev/shm, refused by name otherwise, never a wait, and a segment cut short while it is read is an
error, not a crash (the HTTP side is tested in tests/train/test_push.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import torch

from miles.errors import InvalidRequestError, NotFoundError
from miles.weights.buckets import from_file, layout, pack
from miles.weights.transport.segments import SHM_DIR, open_segment


@pytest.fixture
def name() -> Iterator[str]:
    name = f"miles-test-{uuid.uuid4().hex}"
    yield name
    path = SHM_DIR / name
    if path.is_dir():
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


def test_a_segment_is_opened_and_its_bytes_read(name: str) -> None:
    (SHM_DIR / name).write_bytes(bytes(range(16)))
    fd, size = open_segment(name, 16)
    try:
        assert size == 16 and os.pread(fd, 16, 0) == bytes(range(16))
    finally:
        os.close(fd)


def test_what_is_not_a_segment_is_refused_without_waiting(name: str) -> None:
    with pytest.raises(NotFoundError, match="no shared-memory segment"):
        open_segment(name, 16)
    os.mkfifo(SHM_DIR / name)  # opening it for reading would wait for a writer
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        open_segment(name, 16)
    os.unlink(SHM_DIR / name)
    os.mkdir(SHM_DIR / name)
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        open_segment(name, 16)
    os.rmdir(SHM_DIR / name)
    (SHM_DIR / name).write_bytes(bytes(8))
    with pytest.raises(InvalidRequestError, match="holds 8 bytes, fewer than the 16"):
        open_segment(name, 16)
    os.unlink(SHM_DIR / name)
    os.symlink("/etc/hostname", SHM_DIR / name)
    with pytest.raises(InvalidRequestError, match="cannot be opened"):
        open_segment(name, 1)


def test_a_segment_cut_short_while_it_is_read_is_an_error_naming_the_tensor(name: str) -> None:
    named = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(8192, dtype=torch.bfloat16)}
    table = layout(named, named)
    flat = torch.zeros(table.total_bytes, dtype=torch.uint8)
    table = pack(named, table, flat)
    (SHM_DIR / name).write_bytes(flat.numpy().tobytes())
    fd, size = open_segment(name, table.total_bytes)
    try:
        bucket = from_file(table, fd, size)
        target = torch.empty(4096, dtype=torch.float32)
        bucket.check("a", bucket.copy_into("a", target))
        assert torch.equal(target, named["a"])
        # The sender cuts its segment after the engine checked its size: the next read says so.
        os.truncate(SHM_DIR / name, table.entries[1].offset + 100)
        with pytest.raises(InvalidRequestError, match="ends at byte .* before tensor 'b' does: the sender cut"):
            bucket.copy_into("b", torch.empty(8192, dtype=torch.bfloat16))
        with pytest.raises(InvalidRequestError, match="the sender cut it short"):
            _ = bucket.tensors
    finally:
        os.close(fd)

"""What an engine maps for a shared-memory push: only a regular file of the right size in /dev/shm,
refused by name otherwise, and never a wait (the HTTP side is tested in tests/train/test_push.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import torch

from miles.engine.receiver import SHM_DIR, SegmentMaps
from miles.errors import InvalidRequestError, NotFoundError


@pytest.fixture
def name() -> Iterator[str]:
    name = f"miles-test-{uuid.uuid4().hex}"
    yield name
    path = SHM_DIR / name
    if path.is_dir():
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


def test_a_segment_is_mapped_and_its_bytes_read(name: str) -> None:
    (SHM_DIR / name).write_bytes(bytes(range(16)))
    assert torch.equal(SegmentMaps().open(name, 16), torch.arange(16, dtype=torch.uint8))


def test_what_is_not_a_segment_is_refused_without_waiting(name: str) -> None:
    segments = SegmentMaps()
    with pytest.raises(NotFoundError, match="no shared-memory segment"):
        segments.open(name, 16)
    os.mkfifo(SHM_DIR / name)  # opening it for reading would wait for a writer
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        segments.open(name, 16)
    os.unlink(SHM_DIR / name)
    os.mkdir(SHM_DIR / name)
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        segments.open(name, 16)
    os.rmdir(SHM_DIR / name)
    (SHM_DIR / name).write_bytes(bytes(8))
    with pytest.raises(InvalidRequestError, match="holds 8 bytes, fewer than the 16"):
        segments.open(name, 16)
    os.unlink(SHM_DIR / name)
    os.symlink("/etc/hostname", SHM_DIR / name)
    with pytest.raises(InvalidRequestError, match="cannot be opened"):
        segments.open(name, 1)

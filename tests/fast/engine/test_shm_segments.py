"""What an engine reads for a shared-memory push: only a regular file of the right size in /dev/shm,
refused by name otherwise, never a wait, and never a crash when the segment is cut while it is
read (the HTTP side is tested in tests/train/test_push.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch

from miles.engine.receiver import SHM_DIR, SegmentReader
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


def test_a_segment_is_read_into_a_buffer_kept_for_the_next_bucket(name: str) -> None:
    (SHM_DIR / name).write_bytes(bytes(range(16)))
    segments = SegmentReader()
    first = segments.read(name, 16)
    assert torch.equal(first[:16], torch.arange(16, dtype=torch.uint8))
    segments.release(first)
    (SHM_DIR / name).write_bytes(bytes(range(100, 108)))
    again = segments.read(name, 8)
    assert again.data_ptr() == first.data_ptr()  # its pages faulted in once
    assert torch.equal(again[:8], torch.arange(100, 108, dtype=torch.uint8))


CUT_WHILE_READ = """
import os, sys, threading
from miles.engine.receiver import SHM_DIR, SegmentReader
from miles.errors import InvalidRequestError
name = sys.argv[1]
path = SHM_DIR / name
size = 64 << 20
path.write_bytes(bytes(size))
stop = threading.Event()
def cut():
    with open(path, "r+b") as f:
        while not stop.is_set():
            f.truncate(0)
            f.truncate(size)
threading.Thread(target=cut, daemon=True).start()
segments, refused = SegmentReader(), 0
for _ in range(200):
    try:
        segments.release(segments.read(name, size))
    except InvalidRequestError:
        refused += 1
stop.set()
print("survived", refused)
"""


def test_a_segment_cut_while_it_is_read_is_refused_not_a_crash(name: str) -> None:
    """A sender cutting its segment short mid-push: a mapping would kill the engine (SIGBUS).
    In a process of its own, so that the suite would see a crash as a failure and live on."""
    done = subprocess.run([sys.executable, "-c", CUT_WHILE_READ, name], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("survived"), done.stdout


def test_what_is_not_a_segment_is_refused_without_waiting(name: str) -> None:
    segments = SegmentReader()
    with pytest.raises(NotFoundError, match="no shared-memory segment"):
        segments.read(name, 16)
    os.mkfifo(SHM_DIR / name)  # opening it for reading would wait for a writer
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        segments.read(name, 16)
    os.unlink(SHM_DIR / name)
    os.mkdir(SHM_DIR / name)
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        segments.read(name, 16)
    os.rmdir(SHM_DIR / name)
    (SHM_DIR / name).write_bytes(bytes(8))
    with pytest.raises(InvalidRequestError, match="holds 8 bytes, fewer than the 16"):
        segments.read(name, 16)
    os.unlink(SHM_DIR / name)
    os.symlink("/etc/hostname", SHM_DIR / name)
    with pytest.raises(InvalidRequestError, match="cannot be opened"):
        segments.read(name, 1)

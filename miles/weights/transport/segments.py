"""Shared-memory segments: the files in /dev/shm that pushes on one node carry weights in.

Both ends use this module: the trainer makes a segment (``Segment``) and writes buckets (or its
model's weights) into it; an engine opens it read-only (``open_segment``) and reads the tensors.

Who made a segment, and whether it is still alive, is told by a lock, not a process id: the
maker holds a shared ``flock`` on its segment for as long as it lives, and the kernel drops it
when the process dies, however it dies (kill -9 included), in any PID namespace that shares
the node's /dev/shm. ``sweep`` removes every segment nobody holds: the leftovers of dead
makers. Engines sweep when a training window closes (whoever closed it), and every new segment
sweeps first, so a dead trainer's memory (a whole copy of the model, for a shared-weights push)
does not outlive its window.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import re
import stat
import uuid
import weakref
from pathlib import Path

import torch

from miles.errors import InvalidRequestError, NotFoundError, PublishError

logger = logging.getLogger("miles.weights")

SHM_DIR = Path("/dev/shm")
PREFIX = "miles-"
# A segment's name as pushes carry it: matched whole (a trailing newline is no name).
NAME = re.compile(r"miles-[A-Za-z0-9_.-]{1,200}")
# What to do when /dev/shm is too small for a segment.
MORE_ROOM = "give it more room (a container's --shm-size), lower bucket_bytes, or push with path='distributed'"


class Segment:
    """A shared-memory segment of this process's (``/dev/shm/miles-<pid>-...``), removed by
    ``close``, or at interpreter exit if nobody closed it (its memory stays mapped while a tensor
    views it). A process killed outright leaves it to the next ``sweep``.

    Its pages are reserved when it is made: a /dev/shm too small for it is a PublishError here,
    not a SIGBUS at the first write past what it can hold."""

    def __init__(self, size: int) -> None:
        sweep()
        self.size = size
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = SHM_DIR / self.name
        room = _room(SHM_DIR)
        if room is not None and size > room:
            raise PublishError(f"{SHM_DIR} has room for {room} bytes, not the {size} a push needs there: {MORE_ROOM}")
        # Made under a name no sweep looks at, locked, then renamed: a sweep never sees it unlocked.
        making = SHM_DIR / f".{self.name}"
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                # Pages taken now: one that cannot be had later would be a SIGBUS at its first write.
                os.posix_fallocate(fd, 0, max(size, 1))
            except OSError as exc:
                why = f"{SHM_DIR} cannot hold the {size} bytes of a push ({exc.strerror})"
                raise PublishError(f"{why}: {MORE_ROOM}") from None
            self._map = mmap.mmap(fd, max(size, 1))
            os.rename(making, self.path)
        except BaseException:
            making.unlink(missing_ok=True)
            os.close(fd)
            raise
        # The descriptor holds the lock that says this segment's maker lives: kept until ``close``.
        self._fd: int | None = fd
        self.flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self.base = self.flat.data_ptr()
        self._finalizer = weakref.finalize(self, _remove, self.path, fd)

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where ``tensor``'s bytes start in this segment, when they lie in it back to back."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.layout != torch.strided:
            return None
        start = tensor.data_ptr()
        if self.base <= start and start + tensor.numel() * tensor.element_size() <= self.base + self.size:
            return start - self.base
        return None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage lies in this segment (the tensor may be any view of it)."""
        start = tensor.untyped_storage().data_ptr()
        return tensor.device.type == "cpu" and self.base <= start < self.base + self.size

    def close(self) -> None:
        """Remove the file. The memory is unmapped once no tensor views it: tensors hold the map,
        and closing it under them would leave them pointing at nothing."""
        self._finalizer()


def _remove(path: Path, fd: int) -> None:
    """Remove a segment's file and drop its lock. Run by ``close``, when the segment is collected,
    or at exit. A collection can happen on a running event loop, where the file system call (and
    the pages its removal frees) goes to the loop's executor instead: handed over by the loop, not
    from here, because a collection can also happen inside that executor's ``submit``, which
    holds a lock that submitting from here would wait on forever."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: remove it here
            loop.call_soon_threadsafe(_unlink_off_loop, loop, path, fd)
            return
    _unlink(path, fd)


def _unlink_off_loop(loop: asyncio.AbstractEventLoop, path: Path, fd: int) -> None:
    try:
        loop.run_in_executor(None, _unlink, path, fd)
    except RuntimeError:  # the loop's executor is shut down
        _unlink(path, fd)


def _unlink(path: Path, fd: int) -> None:
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        os.close(fd)


def _room(directory: Path) -> int | None:
    """Bytes that can still be written under ``directory`` (None when unknown)."""
    try:
        status = os.statvfs(directory)
    except OSError:
        return None
    return status.f_bavail * status.f_frsize


def open_segment(name: str, needed: int) -> tuple[int, int]:
    """An open descriptor of segment ``name`` and its size, refused unless it is a regular file
    under /dev/shm holding at least ``needed`` bytes."""
    if not NAME.fullmatch(name):
        raise InvalidRequestError(f"shared-memory segment names start with {PREFIX!r} (letters, digits, ._-): {name!r}")
    path = SHM_DIR / name
    try:
        # Non-blocking: opening a FIFO for reading would wait for a writer that may never come.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotFoundError(
            f"no shared-memory segment {name!r} on this node: the sender must run on the engine's node"
        ) from None
    except OSError as exc:
        raise InvalidRequestError(f"shared-memory segment {name!r} cannot be opened: {exc.strerror}") from None
    status = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(status.st_mode):
        problem = (
            f"{name!r} in {SHM_DIR} is not a shared-memory segment (not a regular file); "
            "push from miles.train.push.PushPublisher, which creates one"
        )
    elif status.st_size < needed or status.st_size == 0:
        problem = f"segment {name!r} holds {status.st_size} bytes, fewer than the {needed} its table describes"
    if problem is not None:
        os.close(fd)
        raise InvalidRequestError(problem)
    return fd, status.st_size


def sweep() -> list[str]:
    """Remove every segment whose maker is gone (nobody holds its lock); returns their names.

    Safe against every other party: a live maker holds its lock, so its segments stay; a reader
    in the middle of a push keeps its descriptor, so the bytes it reads stay until it closes it."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        if not NAME.fullmatch(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its maker lives
            # Unlocked: nobody holds it (a maker locks its segment before giving it this name,
            # which no other segment ever has).
            path.unlink(missing_ok=True)
            removed.append(path.name)
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d shared-memory segment(s) left by pushers that died: %s", len(removed), removed)
    return removed

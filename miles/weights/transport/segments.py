"""Shared-memory segments: the memory pushes on one node carry weights in.

The trainer makes a segment (``Segment``: a ``memfd_create`` file sealed against shrinking and
growing, named on the wire by ``/proc/<pid>/fd/<fd>``); an engine maps it read-only
(``SegmentMaps``). The seal is what lets an engine map it: a mapped file cut short kills its reader
(SIGBUS); an unsealed one is refused. With no name in any directory, its memory goes back to the
system once the maker's descriptor and every mapping are gone, however the maker died.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import re
import stat
import threading
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field

from miles.errors import InvalidRequestError, NotFoundError, PublishError
from miles.utils.memory import available_host_memory

PREFIX = "miles-"
# A segment's name as pushes carry it: matched whole (a trailing newline is no name).
NAME = re.compile(r"miles-[A-Za-z0-9_.-]{1,200}")
# The seals a segment must carry before an engine maps it: it can neither be cut nor grow.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Where a process's descriptors are reachable by other processes of the same user.
PROC = Path("/proc")
# Segments an engine keeps mapped at once (``SegmentMaps``).
MAX_MAPPED = 8


def available() -> bool:
    """Whether this machine makes segments (Linux memory files, reachable through /proc)."""
    return hasattr(os, "memfd_create") and (PROC / "self" / "fd").is_dir()


class SegmentRef(BaseModel):
    """A segment as a push names it: its maker's process, the maker's descriptor of it, its name."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    pid: Annotated[int, Field(gt=0, lt=2**31)]
    fd: Annotated[int, Field(ge=0, lt=2**31)]
    name: Annotated[str, Field(pattern=NAME.pattern, max_length=205)]

    @property
    def path(self) -> Path:
        return PROC / str(self.pid) / "fd" / str(self.fd)


class Segment:
    """A shared-memory segment of this process's, sealed at ``size`` bytes, its memory kept while a
    tensor viewing ``flat`` or a mapping is left. Its pages are reserved when it is made: memory
    that cannot be had is a PublishError here, not a SIGBUS at the first write past it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        room = available_host_memory()
        if room is not None and size > room:
            # Reserving more than there is would not fail: the system would kill processes to make room.
            raise PublishError(
                f"a push needs {size} bytes of shared memory, but {room} are available: free memory, "
                "lower bucket_bytes, or push with path='distributed'"
            )
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            try:
                os.posix_fallocate(fd, 0, max(size, 1))
            except OSError as exc:
                raise PublishError(
                    f"shared memory for the {size} bytes of a push cannot be had ({exc.strerror}): free memory, "
                    "lower bucket_bytes, or push with path='distributed'"
                ) from None
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            # Mapped by path, which keeps no descriptor of its own (a Python mmap would keep a
            # copy of ``fd``): once ``close`` drops ``fd``, the tensors viewing it are all that hold it.
            self.flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=max(size, 1), dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        self.ref = SegmentRef(pid=os.getpid(), fd=fd, name=self.name)
        self.base = self.flat.data_ptr()
        self._finalizer = weakref.finalize(self, _close_soon, fd)

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
        """Drop the descriptor. The memory is unmapped once no tensor views it: tensors hold the
        map, and closing it under them would leave them pointing at nothing."""
        self._finalizer()


def _close_soon(fd: int) -> None:
    """Close a segment's descriptor: run by ``close``, when the segment is collected, or at exit.
    Freeing a model's worth of pages takes a while: on a running loop the close goes to the loop's
    executor, handed over by the loop (a collection can happen inside that executor's ``submit``,
    under a lock that submitting from here would wait on forever)."""
    try:
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(_close_off_loop, loop, fd)
    except RuntimeError:  # no loop runs here, or it is closed: close it here
        _close(fd)


def _close_off_loop(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    try:
        loop.run_in_executor(None, _close, fd)
    except RuntimeError:  # the loop's executor is shut down
        _close(fd)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


@dataclass(frozen=True)
class _Mapped:
    inode: tuple[int, int]  # (device, inode): the same memory file, whatever descriptor names it
    flat: torch.Tensor  # the whole segment, read-only (a write would fault, never reach the maker)


class SegmentMaps:
    """An engine's mappings of the segments pushes name, kept from one push to the next: the first
    read of a mapped page faults it into this process (about 70 ms per GB here), which a trainer
    that keeps its segments pays once. ``forget_gone`` lets go of those whose maker dropped them."""

    def __init__(self, *, forget_every_s: float | None = None) -> None:
        self._maps: dict[SegmentRef, _Mapped] = {}
        self._lock = threading.Lock()  # pushes map on worker threads while another thread forgets
        if forget_every_s is not None:
            # A trainer that exits after its last push ends no window: its segments are let go
            # within this many seconds instead of at the next window's end.
            threading.Thread(
                target=self._forget_gone_every, args=(forget_every_s,), name="miles-segments", daemon=True
            ).start()

    def flat(self, ref: SegmentRef, needed: int) -> torch.Tensor:
        """The bytes of segment ``ref`` (read-only), a sealed memory file of miles' of at least ``needed``
        bytes. Raises NotFoundError when it is not on this node, InvalidRequestError for anything else."""
        fd = _open(ref, where="the sender must run on the engine's node, in its process namespace")
        try:
            status = os.fstat(fd)
            inode = (status.st_dev, status.st_ino)
            with self._lock:
                known = self._maps.get(ref)
            if known is not None and known.inode == inode and known.flat.numel() >= needed:
                return known.flat
            _check(fd, ref, status, needed)
            with warnings.catch_warnings():
                # torch warns that the buffer is not writable: nothing here writes to it.
                warnings.simplefilter("ignore", UserWarning)
                # Mapped whole but faulted in only where tensors are read: a sparse segment far
                # larger than its tensors costs their bytes, not its size.
                mapped = mmap.mmap(fd, status.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                flat = torch.frombuffer(mapped, dtype=torch.uint8)
        finally:
            os.close(fd)
        with self._lock:
            self._maps[ref] = _Mapped(inode, flat)
            # A push names one segment or two (its buckets', its model's): a sender naming ever new
            # ones must not leave a mapping (and a descriptor) behind for each. The oldest goes;
            # a bucket still being copied from it keeps its memory until it is done.
            while len(self._maps) > MAX_MAPPED:
                del self._maps[next(iter(self._maps))]
        return flat

    def forget_gone(self) -> list[str]:
        """Let go of the segments whose maker no longer holds them (it closed them, or died);
        returns their names. Their memory goes once no tensor of this process views it either."""
        with self._lock:
            known = dict(self._maps)
        gone = [ref for ref, mapped in known.items() if _inode(ref) != mapped.inode]
        with self._lock:
            for ref in gone:
                if self._maps.get(ref) is known[ref]:  # not mapped again meanwhile
                    del self._maps[ref]
        return [ref.name for ref in gone]

    def _forget_gone_every(self, seconds: float) -> None:
        while True:
            time.sleep(seconds)
            self.forget_gone()

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()


def _open(ref: SegmentRef, *, where: str) -> int:
    """A descriptor of segment ``ref``'s file; NotFoundError (saying ``where`` its maker must run)
    when there is none on this node, InvalidRequestError when it cannot be opened."""
    try:
        # Non-blocking: opening a FIFO for reading would wait for a writer that may never come.
        return os.open(ref.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFoundError(
            f"no shared-memory segment {ref.name!r} (process {ref.pid}, descriptor {ref.fd}) on this node: {where}"
        ) from None
    except OSError as exc:
        raise InvalidRequestError(f"shared-memory segment {ref.name!r} cannot be opened: {exc.strerror}") from None


def _inode(ref: SegmentRef) -> tuple[int, int] | None:
    try:
        status = os.stat(ref.path)
    except OSError:
        return None
    return (status.st_dev, status.st_ino)


def _check(fd: int, ref: SegmentRef, status: os.stat_result, needed: int) -> None:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = ""
    if not stat.S_ISREG(status.st_mode) or target != f"/memfd:{ref.name} (deleted)":
        raise InvalidRequestError(
            f"process {ref.pid}'s descriptor {ref.fd} is not the shared-memory segment {ref.name!r}; push from "
            "miles.train.push.PushPublisher, which makes one"
        )
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise InvalidRequestError(f"segment {ref.name!r} is not sealed against shrinking; make it with miles' Segment")
    if status.st_size < needed or status.st_size == 0:
        raise InvalidRequestError(
            f"segment {ref.name!r} holds {status.st_size} bytes, fewer than the {needed} its table describes"
        )


def writable(ref: SegmentRef) -> torch.Tensor:
    """The bytes of segment ``ref``, mapped to be written: the ranks of one trainer fill the
    buckets of one rank's segment together. Raises as ``SegmentMaps.flat``."""
    fd = _open(ref, where="the ranks must run on one node")
    try:
        status = os.fstat(fd)
        _check(fd, ref, status, 1)
        # Mapped by the path of this descriptor, which is the file just checked.
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=status.st_size, dtype=torch.uint8)
    finally:
        os.close(fd)

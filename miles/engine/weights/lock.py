"""A writer-preferring reader-writer lock for the live weights: generation steps and long reads
share them, a change writes them alone; a waiting writer blocks new readers, so a steady stream of
generation steps can never starve a weight update.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from miles.errors import ConflictError

# What one section of a long read (an export, a checksum) reads: what a swap may wait for (~0.5 ms).
READ_SECTION_BYTES = 4 * 1024 * 1024


class WeightsLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._writes = 0
        self._changing = False  # a change announced its stage and has not swapped or dropped it

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not (self._writing or self._writers_waiting))
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            try:
                self._cond.wait_for(lambda: not (self._writing or self._readers))
            finally:
                self._writers_waiting -= 1
            self._writing = True
            self._writes += 1
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    def announce(self) -> None:
        """A change opened its stage: counted as a write, so that a long read in sections ends at
        its next section instead of at the swap, where it would end torn anyway; until
        ``withdraw``, ``wait_for_no_change`` holds back new long reads. A swap then waits for no
        reader (an export's copy of one slice, preempted on a busy machine, stalled swaps, and
        generation with them, for 1-10 ms on two cores)."""
        with self._cond:
            self._writes += 1
            self._changing = True

    def withdraw(self) -> None:
        """The change announced last ended: its stage was swapped in or dropped."""
        with self._cond:
            self._changing = False
            self._cond.notify_all()

    def wait_for_no_change(self, timeout_s: float) -> bool:
        """Block until no announced change is pending, or ``timeout_s`` passed; whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._changing, timeout=timeout_s)

    @property
    def writes(self) -> int:
        """Write sections begun or announced: the same count in two read sections means nothing
        was written between them."""
        with self._cond:
            return self._writes


def read_in_sections(
    lock: WeightsLock,
    tensors: Sequence[torch.Tensor],
    *,
    writes: int,
    what: str,
    each: Callable[[int, int, torch.Tensor], None],
) -> None:
    """Call ``each(index, start, chunk)`` for every slice of each tensor's bytes (``chunk`` a flat
    uint8 view of the live bytes from ``start``), each in a read section of its own: a change
    waits for one slice, never for the whole read. ``each`` must not keep ``chunk`` (a swap
    refuses to leave a viewer it does not know on the old weights). ``tensors`` are the model's
    own tensor objects, which a swap re-points: a write between two sections would tear the read.
    Raises ConflictError when ``lock.writes`` is no longer ``writes`` (read with ``what``).
    """
    for index, live in enumerate(tensors):
        nbytes = live.numel() * live.element_size()
        # A tensor that is not contiguous is read whole, in one section.
        step = READ_SECTION_BYTES if live.is_contiguous() else max(nbytes, 1)
        for start in range(0, nbytes, step):
            with lock.read():
                if lock.writes != writes:
                    raise ConflictError(
                        f"the weights changed while they were read ({what} then); ask again to read the ones held now"
                    )
                raw = live.detach().contiguous().reshape(-1).view(torch.uint8)
                each(index, start, raw[start : start + step])
                del raw

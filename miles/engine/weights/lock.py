"""A writer-preferring reader-writer lock for the live weights: generation steps and long reads
share them, a change writes them alone; a waiting writer blocks new readers, so a steady stream of
generation steps can never starve a weight update.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


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

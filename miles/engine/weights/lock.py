"""A writer-preferring reader-writer lock for the live weights.

Generation steps and checksum reads share the weights (read side); copying a new checkpoint into
them is exclusive (write side). A waiting writer blocks new readers, so a steady stream of
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

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
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
                while self._writing or self._readers:
                    self._cond.wait()
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

    @property
    def writes(self) -> int:
        """How many write sections have begun: a reader that sees the same count in two read
        sections knows nothing was written between them."""
        with self._cond:
            return self._writes

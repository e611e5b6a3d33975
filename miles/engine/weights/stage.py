"""What a change writes into: a stage, taken by name from any source.

Every write records the digest of the bytes it left in the stage's memory, so a stage's checksum
is the checksum of what it holds (names not written keep their live values). Two kinds, one
interface:

- ``BufferStage`` (``buffers.py``): a second copy of the weights, written and hashed while the
  engine serves on the first, then swapped in by re-pointing tensors (``activate``), in a time
  that grows with the number of tensors, not their size. The staging policy there decides
  whether a change gets one.
- ``LiveStage``: the live tensors themselves, written in place by a caller that holds the write
  side of the weights lock on the scheduler thread while generation is paused; ``activate`` has
  nothing left to do.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import ClassVar

import torch

from miles.errors import UnsupportedTensorError
from miles.weights.buckets import BucketEntry, Received, copy_and_digest
from miles.weights.checksum import (
    ModelChecksum,
    TensorDigest,
    checksum_from_digests,
    copy_and_checksum,
    digest_tensor,
    saved_state_dict,
)
from miles.weights.safetensors_io import dtype_name

# Below this many bytes a bucket is written on one thread: more cost more than they save.
_PARALLEL_WRITE_BYTES = 16 * 1024 * 1024


class _StageState(Enum):
    OPEN = "open"
    ACTIVATED = "activated"
    DISCARDED = "discarded"


class Stage:
    """One change's new weights, written by name: ``write``, ``write_with`` for a source that
    copies itself, ``write_all`` for a whole checkpoint, ``write_bucket`` for a pushed bucket.
    ``checksum`` hashes what is staged; ``activate`` (under the write side of the weights lock)
    makes it the live weights, ``discard`` drops it."""

    # Whether the stage is the live weights (written while generation is paused).
    in_place: ClassVar[bool]
    # What the answers' ``timings`` call a write into this stage and its hash.
    phases: ClassVar[tuple[str, str]]

    def __init__(self, layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self._layout = layout
        self._state = _StageState.OPEN
        self._digests: dict[str, str] = {}
        self._checksum: ModelChecksum | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The names the stage takes: the tensors a checkpoint of the served model holds."""
        return tuple(sorted(self._layout))

    def write(self, name: str, tensor: torch.Tensor) -> str:
        """Stage ``tensor`` as the new value of ``name`` (copied; the source may go after) and
        return the digest of the bytes staged.

        Raises KeyError for a name the served model does not hold, UnsupportedTensorError for a
        dtype or shape other than the live tensor's, RuntimeError once the stage is closed.
        """
        return self.write_with(name, tensor.dtype, tuple(tensor.shape), lambda target: copy_and_digest(target, tensor))

    def write_with(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], copy: Callable[[torch.Tensor], str]
    ) -> str:
        """``write`` for a source that copies itself: ``copy(target)`` fills the staged tensor of
        ``name`` (``dtype`` and ``shape``, checked first as ``write`` checks them) and returns the
        digest of what it wrote, which this returns."""
        self._require_open()
        live = self._layout.get(name)
        if live is None:
            raise KeyError(f"{name!r} is not a tensor of the served model; stage the names Stage.names lists")
        if (dtype, tuple(shape)) != live:
            raise UnsupportedTensorError(
                "a staged tensor must have the dtype and shape of the live one",
                tensor=name,
                live=f"{dtype_name(live[0])}{list(live[1])}",
                staged=f"{dtype_name(dtype)}{list(shape)}",
            )
        self._checksum = None
        digest = self._digests[name] = copy(self._target(name))
        return digest

    def write_all(self, source: Callable[[str], torch.Tensor]) -> None:
        """Stage ``source(name)`` for every name in ``names`` (a whole checkpoint)."""
        for name in self.names:
            self.write(name, source(name))

    def write_bucket(self, bucket: Received) -> None:
        """Stage every tensor of ``bucket``, each checked against its digest over the bytes staged
        (InvalidRequestError for the first that differs).

        A large bucket is written on as many threads as torch may use in this process (the cores
        the engine was given; the copy and the hash release the GIL), the largest tensors first;
        the first tensor that fails stops the others from taking more.
        """
        items = sorted(bucket.entries.values(), key=lambda entry: entry.nbytes, reverse=True)

        def one(entry: BucketEntry) -> None:
            copy = functools.partial(bucket.copy_into, entry.name)
            bucket.check(entry.name, self.write_with(entry.name, entry.torch_dtype(), entry.shape, copy))

        threads = min(torch.get_num_threads(), len(items))
        if threads < 2 or sum(e.nbytes for e in items) < _PARALLEL_WRITE_BYTES:
            for entry in items:
                one(entry)
            return
        queue = iter(items)
        taking = threading.Lock()
        failed = threading.Event()

        def work() -> None:
            while not failed.is_set():
                with taking:
                    item = next(queue, None)
                if item is None:
                    return
                try:
                    one(item)
                except BaseException:
                    failed.set()
                    raise

        with ThreadPoolExecutor(threads, thread_name_prefix="miles-stage") as pool:
            workers = [pool.submit(work) for _ in range(threads)]
        for worker in workers:
            worker.result()

    def checksum(self) -> ModelChecksum:
        """The model checksum of the staged weights, which the live model has once they are
        activated. Names not written keep their live values (hashed here)."""
        self._require_open()
        if self._checksum is None:
            for name in self._layout.keys() - self._digests.keys():
                self._digests[name] = self._keep(name)
            digests = [TensorDigest(n, dtype_name(d), s, self._digests[n]) for n, (d, s) in self._layout.items()]
            num_bytes = sum(dtype.itemsize * math.prod(shape) for dtype, shape in self._layout.values())
            self._checksum = checksum_from_digests(digests, num_bytes=num_bytes)
        return self._checksum

    def prepare_activation(self) -> None:
        """Check, before the write lock is taken, what ``activate`` checks again under it (nothing
        for most stages). Raises StagingRefusedError as ``activate`` does (the stage stays open)."""
        self._require_open()

    def activate(self) -> ModelChecksum:
        """Make the staged weights the live ones and return their checksum; the caller holds the
        write side of the weights lock.

        Raises RuntimeError when ``checksum`` was not computed after the last write (only weights
        whose checksum is known are activated); a buffer stage raises StagingRefusedError as
        ``BufferStage`` says. Either way nothing changed.
        """
        self._require_open()
        if self._checksum is None:
            raise RuntimeError("compute the stage's checksum() before activating it")
        self._swap()
        self._close(_StageState.ACTIVATED)
        return self._checksum

    def discard(self) -> None:
        """Drop the stage (a no-op once activated or discarded). The live weights keep what was
        written into them: nothing for a buffer stage."""
        if self._state is _StageState.OPEN:
            self._close(_StageState.DISCARDED)

    def _target(self, name: str) -> torch.Tensor:
        """The tensor a write of ``name`` fills."""
        raise NotImplementedError

    def _keep(self, name: str) -> str:
        """Make the stage hold the live value of ``name`` (not written) and return its digest."""
        raise NotImplementedError

    def _swap(self) -> None:
        """Make the staged memory the live one (write lock held)."""

    def _close(self, state: _StageState) -> None:
        self._state = state
        self._closed()

    def _closed(self) -> None:
        """Let go of what the stage held (once activated or discarded)."""

    def _require_open(self) -> None:
        if self._state is not _StageState.OPEN:
            raise RuntimeError(f"the weight stage is {self._state.value}; open a new one")


class LiveStage(Stage):
    """The live tensors of ``model`` as a stage: every write lands in the served weights, so the
    caller writes under the write side of the weights lock, on the scheduler thread, with
    generation paused; there is nothing to swap."""

    in_place = True
    phases = ("copy", "checksum")

    def __init__(self, model: torch.nn.Module) -> None:
        self._live = saved_state_dict(model)
        super().__init__({name: (t.dtype, tuple(t.shape)) for name, t in self._live.items()})

    def write_all(self, source: Callable[[str], torch.Tensor]) -> None:
        # One thread: the caller is the engine's torch thread (see scheduler.py), and copy_ still
        # uses its intra-op threads; each slice is hashed right after it is written.
        self._require_open()
        self._checksum = None
        written = copy_and_checksum(self._live, source, threads=1)
        self._digests.update({name: d.digest for name, d in written.tensors.items()})

    def _target(self, name: str) -> torch.Tensor:
        return self._live[name]

    def _keep(self, name: str) -> str:
        return digest_tensor(self._live[name])

    def _closed(self) -> None:
        # Views of the live weights: held past the change, they would make a later buffer swap
        # find viewers it does not know.
        self._live = {}

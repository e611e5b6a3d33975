"""What a change writes into: a stage, taking tensors by name, whose checksum is that of the bytes
its writes left in its memory. A ``BufferStage`` (``buffers.py``) lies beside the live weights
and is swapped in; a ``LiveStage`` is the live tensors, written under the write lock."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import ClassVar

import torch

from miles.errors import UnsupportedTensorError
from miles.weights.buckets import Received
from miles.weights.checksum import ModelChecksum, TensorDigest, checksum_from_digests, digest_tensor, saved_state_dict
from miles.weights.digest import copy_and_digest
from miles.weights.reader import CheckpointReader
from miles.weights.safetensors_io import dtype_name

# Below this many bytes a bucket is written on one thread: more cost more than they save.
_PARALLEL_WRITE_BYTES = 16 * 1024 * 1024


class StageState(Enum):
    OPEN = "open"
    ACTIVATED = "activated"
    DISCARDED = "discarded"


class Stage:
    """One change's new weights: written, hashed (``checksum``), then made the live weights
    (``activate``, under the write lock) or dropped (``discard``)."""

    in_place: ClassVar[bool]  # whether the stage is the live weights
    phases: ClassVar[tuple[str, str]]  # what answers' ``timings`` call a write into it and its hash

    def __init__(self, layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self._layout = layout
        self._state = StageState.OPEN
        self._digests: dict[str, str] = {}
        self._checksum: ModelChecksum | None = None
        self._on_close: Callable[[], None] | None = None

    @property
    def is_open(self) -> bool:
        return self._state is StageState.OPEN

    @property
    def names(self) -> tuple[str, ...]:
        """The names the stage takes: the tensors a checkpoint of the served model holds."""
        return tuple(sorted(self._layout))

    def write(self, name: str, tensor: torch.Tensor) -> str:
        """Stage a copy of ``tensor`` as the new value of ``name``; returns the digest of the bytes
        staged. Raises KeyError for a name the served model does not hold, UnsupportedTensorError
        for another dtype or shape than the live tensor's, RuntimeError once the stage is closed."""
        return self.write_with(name, tensor.dtype, tuple(tensor.shape), lambda target: copy_and_digest(target, tensor))

    def write_with(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], copy: Callable[[torch.Tensor], str]
    ) -> str:
        """``write`` for a source that copies itself: ``copy(target)`` fills the staged tensor of
        ``name`` (checked first as ``write`` checks it) and returns the digest of what it wrote."""
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
        self._digests.pop(name, None)  # unknown until written (a write that fails half-way leaves it so)
        digest = self._digests[name] = copy(self._target(name))
        return digest

    def write_checkpoint(self, reader: CheckpointReader) -> dict[str, str]:
        """Stage every tensor of ``reader`` and return the digests of the bytes read (each slice
        hashed and copied while in cache)."""

        def one(name: str) -> None:
            info = reader.info(name)
            self.write_with(name, info.dtype, info.shape, functools.partial(reader.copy_into, name))

        self._each([(name, reader.info(name).nbytes) for name in self.names], one)
        return {name: self._digests[name] for name in self.names}

    def write_bucket(self, bucket: Received) -> None:
        """Stage every tensor of ``bucket``, each checked against its digest (InvalidRequestError)."""

        def one(name: str) -> None:
            entry = bucket.entries[name]
            copy = functools.partial(bucket.copy_into, name)
            bucket.check(name, self.write_with(name, entry.torch_dtype(), entry.shape, copy))

        self._each([(e.name, e.nbytes) for e in bucket.entries.values()], one)

    def _each(self, items: list[tuple[str, int]], job: Callable[[str], None]) -> None:
        """``job(name)`` for every (name, nbytes) item, largest first: a large write on torch's
        number of threads (the copy and the hash release the GIL); the first that fails stops the
        others."""
        items = sorted(items, key=lambda item: item[1], reverse=True)
        threads = min(torch.get_num_threads(), len(items))
        if threads < 2 or sum(nbytes for _, nbytes in items) < _PARALLEL_WRITE_BYTES:
            for name, _ in items:
                job(name)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="miles-stage") as pool:
            writes = [pool.submit(job, name) for name, _ in items]
            try:
                for done in writes:
                    done.result()
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise

    def checksum(self) -> ModelChecksum:
        """The model checksum of the staged weights (names not written keep their live values)."""
        self._require_open()
        if self._checksum is None:
            for name in self._layout.keys() - self._digests.keys():
                self._digests[name] = self._keep(name)
            digests = [TensorDigest(n, dtype_name(d), s, self._digests[n]) for n, (d, s) in self._layout.items()]
            num_bytes = sum(dtype.itemsize * math.prod(shape) for dtype, shape in self._layout.values())
            self._checksum = checksum_from_digests(digests, num_bytes=num_bytes)
        return self._checksum

    def activate(self) -> ModelChecksum:
        """Make the staged weights the live ones and return their checksum (write lock held).
        Raises RuntimeError when ``checksum`` was not computed after the last write, a buffer
        stage StagingRefusedError; either way nothing changed."""
        self._require_open()
        if self._checksum is None:
            raise RuntimeError("compute the stage's checksum() before activating it")
        self._swap()
        self._close(StageState.ACTIVATED)
        return self._checksum

    def discard(self) -> None:
        """Drop the stage (a no-op once closed); what a live stage wrote stays in the weights."""
        if self.is_open:
            self._close(StageState.DISCARDED)

    def when_closed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the stage is activated or discarded, however that comes."""
        self._on_close = callback

    def _target(self, name: str) -> torch.Tensor:
        """The tensor a write of ``name`` fills, once it is checked."""
        raise NotImplementedError

    def _keep(self, name: str) -> str:
        """Make the stage hold the live value of ``name`` (not written) and return its digest."""
        raise NotImplementedError

    def _swap(self) -> None:
        """Make the staged memory the live one (write lock held)."""

    def _close(self, state: StageState) -> None:
        self._state = state
        callback, self._on_close = self._on_close, None
        if callback is not None:
            callback()

    def _require_open(self) -> None:
        if self._state is not StageState.OPEN:
            raise RuntimeError(f"the weight stage is {self._state.value}; open a new one")


class LiveStage(Stage):
    """The live tensors of ``model`` as a stage: nothing to swap."""

    in_place = True
    # A change in place hashes each slice as it copies it: one phase, however many writes it takes.
    phases = ("copy_and_checksum", "copy_and_checksum")

    def __init__(self, model: torch.nn.Module) -> None:
        self._live = saved_state_dict(model)
        super().__init__({name: (t.dtype, tuple(t.shape)) for name, t in self._live.items()})

    def _target(self, name: str) -> torch.Tensor:
        return self._live[name]

    def _keep(self, name: str) -> str:
        return digest_tensor(self._live[name])

    def _close(self, state: StageState) -> None:
        super()._close(state)
        # Views of the live weights: held past the change, a swap would find viewers it does not know.
        self._live = {}

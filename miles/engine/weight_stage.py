"""Staged activation: new weights written beside the live ones while the engine serves, then
swapped in by re-pointing tensors, so generation waits for a swap instead of a copy.

It works on storages, not parameters, because the model's parameters are not independent tensors:
the fused decoder makes q/k/v and gate/up views of one fused buffer each, tied embeddings share
one, and the runner keeps handles of its own on the fused buffers. For every distinct storage that
holds checkpoint weights, ``StagingBuffers`` keeps a twin of the same size, and every tensor object
that views the storage (parameters, buffers, the runner's cached tensors) with its offset, size and
stride. A ``WeightStage`` writes new bytes into the twins at the same offsets, hashing each slice as
it is written, and combines the digests into the model checksum (``miles.weights.checksum``) of
the staged weights: the checksum the live model has once they are activated, since activation
changes which memory the tensors view, not a byte of it. ``activate`` runs under the write side
of the weights lock and re-points each tensor at the same place in its twin (what ``Tensor.set_``
does; a view of the twin built beforehand is assigned to ``tensor.data``): O(number of tensors),
whatever their size. The old storages become the twins of the next update (double buffering: the
memory is allocated once).

Nothing may go on viewing an old storage after activation: it would keep serving the old weights,
and one update later the bytes being staged. Every tensor object holds one reference to the
storage it views, so a storage's reference count shows a viewer nobody reported. It is checked
when the buffers are built and again, under the lock, before every swap; a swap that finds one
changes nothing and raises ``StagingRefusedError``.

The copies into the twins go through numpy, which releases the GIL and starts no OpenMP team, so a
stage is written on a worker thread while the scheduler thread serves: a second thread running
parallel torch operations would slow every later decode step (see ``scheduler.py``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
import xxhash

from miles.errors import MilesError, UnsupportedTensorError
from miles.weights.checksum import ModelChecksum, TensorDigest, checksum_from_digests, digest_tensor, saved_state_dict
from miles.weights.safetensors_io import dtype_name

# Copy and hash in slices this big: the slice just written is still in cache when it is hashed,
# so the hash costs a cache read instead of a second pass over memory (as copy_and_checksum does).
_SLICE_BYTES = 4 * 1024 * 1024


class StagingUnsupportedError(MilesError):
    """The model's weights cannot be staged; updates are copied in place instead."""


class StagingRefusedError(MilesError):
    """A swap found a tensor the buffers do not know viewing a live storage; nothing was changed."""


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where a tensor lies in its storage, in elements of its dtype."""

    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @staticmethod
    def of(tensor: torch.Tensor) -> _Placement:
        return _Placement(int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()))

    def byte_span(self, itemsize: int) -> tuple[int, int]:
        """The bytes of the storage this placement reaches: ``[begin, end)``."""
        if any(d == 0 for d in self.size):
            return (self.offset * itemsize, self.offset * itemsize)
        last = self.offset + sum((d - 1) * s for d, s in zip(self.size, self.stride, strict=True))
        return (self.offset * itemsize, (last + 1) * itemsize)


@dataclass(slots=True)
class _Storage:
    """One storage the weights live in, its twin, and every tensor object that views it."""

    live: torch.UntypedStorage
    spare: torch.UntypedStorage | None
    viewers: list[torch.Tensor]
    names: list[str]  # the viewers' names, for messages


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one tensor of the checkpoint's name space lives (a name ``checksum_module`` lists)."""

    storage: int
    dtype: torch.dtype
    placement: _Placement


class StagingBuffers:
    """The model's weight storages, a twin of each (once allocated), and every tensor viewing them.

    Build it with ``build`` once the runner exists (the fused decoder re-points parameters while
    it is built). One stage at a time: ``open`` hands out the next ``WeightStage``.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        storages: list[_Storage],
        slots: dict[str, _Slot],
        fills: list[tuple[int, torch.Tensor]],
    ) -> None:
        self.device = device
        self._storages = storages
        self._slots = slots
        # Model tensors on staged storages that no checkpoint holds (a non-persistent buffer):
        # copied from the live memory into every stage, so the swap keeps their values.
        self._fills = fills
        self._open: WeightStage | None = None
        # While a stage is open: each viewer with a view of its twin at the same place, and where
        # it lies in the live storage (to put it back should the swap fail half-way).
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._restore: list[tuple[torch.UntypedStorage, _Placement]] = []

    @staticmethod
    def build(model: torch.nn.Module, *, runner_tensors: Iterable[torch.Tensor] = ()) -> StagingBuffers:
        """The buffers of ``model``'s weights; ``runner_tensors`` are the tensors the runner holds
        besides the model's parameters and buffers (``ModelRunner.weight_views``).

        Raises StagingUnsupportedError naming the reason: a tensor that is not dense, tensors that
        overlap in memory without being the same view, or a storage viewed by a tensor that
        neither the model nor the runner lists.
        """
        storages, slots = _checkpoint_slots(model)
        index_of = {s.live._cdata: i for i, s in enumerate(storages)}
        canonical = {(s.storage, s.dtype, s.placement) for s in slots.values()}
        fills: list[tuple[int, torch.Tensor]] = []
        seen: set[int] = set()

        def add(name: str, tensor: torch.Tensor, *, of_model: bool) -> None:
            if id(tensor) in seen:
                return  # one object listed twice (tied weights): one viewer
            seen.add(id(tensor))
            index = index_of.get(tensor.untyped_storage()._cdata)
            if index is None:
                return  # memory no checkpoint writes (a rotary table): no update changes it
            _require_dense(tensor, name)
            storages[index].viewers.append(tensor)
            storages[index].names.append(name)
            if of_model and (index, tensor.dtype, _Placement.of(tensor)) not in canonical:
                fills.append((index, tensor))

        for name, parameter in model.named_parameters(remove_duplicate=False):
            add(name, parameter, of_model=True)
        for name, buffer in model.named_buffers(remove_duplicate=False):
            add(name, buffer, of_model=True)
        for i, held in enumerate(runner_tensors):
            add(f"runner tensor {i}", held, of_model=False)
        device = storages[0].live.device if storages else "cpu"
        buffers = StagingBuffers(device=torch.device(device), storages=storages, slots=slots, fills=fills)
        buffers._check_layout()
        unknown = buffers._unknown_viewers()
        if unknown:
            raise StagingUnsupportedError(
                "some weight memory is viewed by tensors that neither the model nor its runner lists, "
                "so a swap could not re-point them; list them in the runner's weight_views()",
                storages=unknown[:3],
            )
        return buffers

    @property
    def nbytes(self) -> int:
        """Bytes of one copy of the staged weights: what the twins cost."""
        return sum(s.live.nbytes() for s in self._storages)

    @property
    def allocated(self) -> bool:
        return all(s.spare is not None for s in self._storages)

    @property
    def allocated_bytes(self) -> int:
        return sum(s.spare.nbytes() for s in self._storages if s.spare is not None)

    def allocate(self) -> None:
        """Allocate the twins (once; later stages reuse them). Raises what the allocator raises
        (``torch.OutOfMemoryError``, ``RuntimeError``) when the memory is not there."""
        for storage in self._storages:
            if storage.spare is None:
                storage.spare = torch.UntypedStorage(storage.live.nbytes(), device=storage.live.device)

    def release(self) -> None:
        """Give the twins' memory back (staging is given up for good)."""
        if self._open is not None:
            self._open.discard()
        for storage in self._storages:
            storage.spare = None
        self._pairs, self._restore = [], []

    def open(self) -> WeightStage:
        """The stage for the next update, writing into the twins.

        Raises RuntimeError when the twins are not allocated or another stage is open, and
        StagingRefusedError when some tensor no longer views the storage it was built with.
        """
        if not self.allocated:
            raise RuntimeError("allocate() the staging buffers before opening a stage")
        if self._open is not None:
            raise RuntimeError("a weight stage is already open; activate or discard it first")
        moved = self._viewers_moved()
        if moved:
            raise StagingRefusedError("tensors no longer view the memory the staging buffers know", tensors=moved[:5])
        # Built here, outside the write lock, so that the swap only rebinds each viewer.
        self._pairs, self._restore = [], []  # and the last stage's views are freed
        for storage in self._storages:
            assert storage.spare is not None
            for tensor in storage.viewers:
                p = _Placement.of(tensor)
                twin = torch.empty(0, dtype=tensor.dtype, device=storage.spare.device)
                self._pairs.append((tensor, twin.set_(storage.spare, p.offset, p.size, p.stride)))
                self._restore.append((storage.live, p))
        self._open = WeightStage(self)
        return self._open

    # --- used by WeightStage ---------------------------------------------------------------

    def _target(self, slot: _Slot, *, twin: bool) -> torch.Tensor:
        """A tensor viewing ``slot`` in the twin (``twin``) or in the live storage."""
        storage = self._storages[slot.storage]
        source = storage.spare if twin else storage.live
        assert source is not None, "the twins are allocated before a stage opens"
        p = slot.placement
        return torch.empty(0, dtype=slot.dtype, device=source.device).set_(source, p.offset, p.size, p.stride)

    def _check_swap(self) -> None:
        """Raise StagingRefusedError when a tensor nobody reported views a live storage."""
        unknown = self._unknown_viewers()
        if unknown:
            # A reference cycle can keep a dead temporary view alive until the collector runs;
            # only a viewer that survives a collection is real.
            gc.collect()
            unknown = self._unknown_viewers()
        if unknown:
            raise StagingRefusedError(
                "some weight memory is viewed by tensors the staging buffers do not know; swapping would "
                "leave them on the old weights",
                storages=unknown[:3],
            )

    def _warm(self) -> None:
        """Read every viewer and twin view once, so the swap finds them in cache (staging has just
        streamed the whole model through it)."""
        for tensor, twin in self._pairs:
            tensor.data_ptr()
            twin.data_ptr()

    def _swap(self) -> None:
        """Re-point every viewer at its twin, then swap the roles of live and twin storages.

        All or nothing: a viewer that cannot be moved puts back those already moved.
        """
        self._check_swap()
        done = 0
        with torch.no_grad():
            try:
                # Assigning .data takes the twin view's storage, offset, size and stride into the
                # same tensor object, as set_ would, in a sixth of its time (no argument parsing):
                # 0.05 ms for 400 tensors.
                for tensor, twin in self._pairs:
                    tensor.data = twin
                    done += 1
            except BaseException:
                for (tensor, _), (live, p) in zip(self._pairs[:done], self._restore[:done], strict=True):
                    tensor.set_(live, p.offset, p.size, p.stride)
                raise
        for storage in self._storages:
            assert storage.spare is not None
            storage.live, storage.spare = storage.spare, storage.live

    def _closed(self, stage: WeightStage) -> None:
        if self._open is stage:
            # The twin views reference what is now (after a swap) the live memory; they must go
            # before the next swap counts its references, but freeing ~400 tensors is a tenth of
            # a millisecond the write lock need not wait for: the next open() drops them.
            self._open = None

    # --- checks ----------------------------------------------------------------------------

    def _check_layout(self) -> None:
        """Refuse tensors that overlap without being the same view: staging could not say which
        bytes belong to which name, nor copy one without changing the other."""
        spans: dict[int, list[tuple[int, int, str]]] = {}
        for name, slot in self._slots.items():
            begin, end = slot.placement.byte_span(slot.dtype.itemsize)
            spans.setdefault(slot.storage, []).append((begin, end, name))
        for index, tensor in self._fills:
            begin, end = _Placement.of(tensor).byte_span(tensor.dtype.itemsize)
            spans.setdefault(index, []).append((begin, end, f"a {dtype_name(tensor.dtype)} tensor no checkpoint holds"))
        for entries in spans.values():
            entries.sort()
            for (_, end, first), (begin, _, second) in zip(entries, entries[1:], strict=False):
                if begin < end:
                    raise StagingUnsupportedError(
                        "two weight tensors overlap in memory without being the same view",
                        first=first,
                        second=second,
                    )

    def _unknown_viewers(self) -> list[str]:
        """Storages with more references than their known viewers hold (plus this object's own)."""
        return [
            f"{s.names[:3]}: {_references(s.live) - 1} references, {len(s.viewers)} known"
            for s in self._storages
            if _references(s.live) != len(s.viewers) + 1
        ]

    def _viewers_moved(self) -> list[str]:
        return [
            name
            for s in self._storages
            for tensor, name in zip(s.viewers, s.names, strict=True)
            if tensor.untyped_storage()._cdata != s.live._cdata
        ]


class _StageState(Enum):
    OPEN = "open"
    ACTIVATED = "activated"
    DISCARDED = "discarded"


class WeightStage:
    """One update's new weights, staged in the twins while the live ones keep serving.

    Any source of tensors writes into it the same way, by name (``write``; ``write_all`` for a
    whole checkpoint); a name not written keeps its live value. ``checksum`` hashes what is
    staged; ``activate`` (under the write side of the weights lock) swaps it in, ``discard``
    drops it. Writes and the checksum may run on any one thread while the engine serves.
    """

    def __init__(self, buffers: StagingBuffers) -> None:
        self._buffers = buffers
        self._state = _StageState.OPEN
        self._digests: dict[str, str] = {}
        self._checksum: ModelChecksum | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The names the stage takes: the tensors a checkpoint of the served model holds."""
        return tuple(sorted(self._buffers._slots))

    @property
    def nbytes(self) -> int:
        return self._buffers.nbytes

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Stage ``tensor`` as the new value of ``name`` (copied; the source may go after).

        Raises KeyError for a name the served model does not hold, UnsupportedTensorError for a
        dtype or shape other than the live tensor's, RuntimeError once the stage is closed.
        """
        self._require_open()
        slot = self._buffers._slots.get(name)
        if slot is None:
            raise KeyError(f"{name!r} is not a tensor of the served model; stage the names WeightStage.names lists")
        if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.placement.size:
            raise UnsupportedTensorError(
                "a staged tensor must have the dtype and shape of the live one",
                tensor=name,
                live=f"{dtype_name(slot.dtype)}{list(slot.placement.size)}",
                staged=f"{dtype_name(tensor.dtype)}{list(tensor.shape)}",
            )
        self._checksum = None
        self._digests[name] = _copy_and_digest(self._buffers._target(slot, twin=True), tensor)

    def write_all(self, source: Callable[[str], torch.Tensor]) -> None:
        """Stage ``source(name)`` for every name in ``names`` (a whole checkpoint)."""
        for name in self.names:
            self.write(name, source(name))

    def checksum(self) -> ModelChecksum:
        """The model checksum of the staged weights, which the live model has once they are
        activated. Names not written are copied from the live weights first."""
        self._require_open()
        if self._checksum is None:
            buffers = self._buffers
            for name, slot in buffers._slots.items():
                if name not in self._digests:
                    live = buffers._target(slot, twin=False)
                    self._digests[name] = _copy_and_digest(buffers._target(slot, twin=True), live)
            for index, tensor in buffers._fills:
                storage = buffers._storages[index]
                assert storage.spare is not None
                p = _Placement.of(tensor)
                twin = torch.empty(0, dtype=tensor.dtype, device=storage.spare.device)
                _copy_and_digest(twin.set_(storage.spare, p.offset, p.size, p.stride), tensor.detach())
            digests = [
                TensorDigest(name, dtype_name(slot.dtype), slot.placement.size, self._digests[name])
                for name, slot in buffers._slots.items()
            ]
            num_bytes = sum(slot.dtype.itemsize * _numel(slot.placement.size) for slot in buffers._slots.values())
            self._checksum = checksum_from_digests(digests, num_bytes=num_bytes)
        return self._checksum

    def prepare_activation(self) -> None:
        """Check, before the write lock is taken, what ``activate`` checks again under it, and
        bring the tensors it moves into cache: a refusal is known without holding the lock, and
        the swap after staging 1 GB took 0.2 ms instead of 0.45 (500M parameters, 363 tensors).

        Raises StagingRefusedError as ``activate`` does (the stage stays open).
        """
        self._require_open()
        self._buffers._check_swap()
        self._buffers._warm()

    def activate(self) -> ModelChecksum:
        """Swap the staged weights in and return their checksum; the caller holds the write side
        of the weights lock. O(number of tensors).

        Raises RuntimeError when ``checksum`` was not computed after the last write (only weights
        whose checksum is known are activated), and StagingRefusedError when a tensor the buffers
        do not know views a live storage; either way nothing changed and the stage is discarded
        by the second.
        """
        self._require_open()
        if self._checksum is None:
            raise RuntimeError("compute the stage's checksum() before activating it")
        try:
            self._buffers._swap()
        except StagingRefusedError:
            self.discard()
            raise
        self._close(_StageState.ACTIVATED)
        return self._checksum

    def discard(self) -> None:
        """Drop the staged weights (the live ones never changed); idempotent, a no-op once activated."""
        if self._state is _StageState.OPEN:
            self._close(_StageState.DISCARDED)

    def _require_open(self) -> None:
        if self._state is not _StageState.OPEN:
            raise RuntimeError(f"the weight stage is {self._state.value}; open a new one")

    def _close(self, state: _StageState) -> None:
        self._state = state
        self._buffers._closed(self)


def _copy_and_digest(target: torch.Tensor, source: torch.Tensor) -> str:
    """Copy ``source`` into ``target`` and return the digest of what ``target`` now holds."""
    source = source.detach()
    cpu = target.device.type == "cpu" and source.device.type == "cpu"
    if not (cpu and target.is_contiguous() and source.is_contiguous()) or target.numel() == 0:
        with torch.no_grad():
            target.copy_(source)
        return digest_tensor(target)
    # numpy views of the raw bytes: np.copyto releases the GIL and runs no OpenMP team.
    dst = target.reshape(-1).view(torch.uint8).numpy()
    src = source.reshape(-1).view(torch.uint8).numpy()
    view = memoryview(dst)  # type: ignore[arg-type]  # an ndarray has the buffer protocol
    hasher = xxhash.xxh3_128()
    for start in range(0, dst.size, _SLICE_BYTES):
        end = min(start + _SLICE_BYTES, dst.size)
        np.copyto(dst[start:end], src[start:end])
        hasher.update(view[start:end])
    return hasher.hexdigest()


def _checkpoint_slots(model: torch.nn.Module) -> tuple[list[_Storage], dict[str, _Slot]]:
    """The storages holding the tensors a checkpoint of ``model`` holds, and where each lies.

    A function of its own so that the state dict's tensors (detached views, each one more
    reference to its storage) are gone when the caller counts references.
    """
    storages: list[_Storage] = []
    index_of: dict[int, int] = {}
    slots: dict[str, _Slot] = {}
    for name, tensor in saved_state_dict(model).items():
        _require_dense(tensor, name)
        if tensor.numel() == 0:
            continue  # no bytes to stage; its view of whatever storage never changes
        storage = tensor.untyped_storage()
        index = index_of.setdefault(storage._cdata, len(storages))
        if index == len(storages):
            storages.append(_Storage(live=storage, spare=None, viewers=[], names=[]))
        slots[name] = _Slot(storage=index, dtype=tensor.dtype, placement=_Placement.of(tensor))
    return storages, slots


def _require_dense(tensor: torch.Tensor, name: str) -> None:
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested or tensor.device.type == "meta":
        raise StagingUnsupportedError("only dense tensors with memory can be staged", tensor=name)


def _numel(size: tuple[int, ...]) -> int:
    count = 1
    for d in size:
        count *= d
    return count


def _references(storage: torch.UntypedStorage) -> int:
    """How many references the storage has: one per tensor object viewing it, one per Python
    storage object wrapping it."""
    return int(torch._C._storage_Use_Count(storage._cdata))

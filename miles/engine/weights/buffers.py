"""The buffer stage (twins of the live storages, swapped in: docs/ENGINE.md, "Staged activation")
and the policy (``--weight-staging``) that decides whether a change gets one. Nothing may go on
viewing an old storage (it would serve the old weights, then the bytes being staged)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from miles.engine.settings import StagingMode
from miles.engine.weights.memory import Slot, StagingUnsupportedError, ViewSpec, WeightMemory
from miles.engine.weights.stage import LiveStage, Stage
from miles.errors import MilesError
from miles.utils.memory import available_host_memory
from miles.weights.checksum import ModelChecksum
from miles.weights.digest import copy_and_digest

logger = logging.getLogger("miles.engine")


class StagingRefusedError(MilesError):
    """A swap found a tensor nobody listed viewing a live storage; nothing was changed."""


class StagingBuffers:
    """The twins of a model's weight storages; one stage at a time. Built once the runner exists
    (the fused decoder re-points parameters)."""

    def __init__(self, memory: WeightMemory) -> None:
        self.memory = memory
        self._stage: BufferStage | None = None  # the last stage opened, open or not
        # The digest of what the live storages and the twins hold under each name, where known: a
        # stage need not copy a name it is not given into a twin that holds its live bytes already
        # (the weights from before the last swap, equal wherever that update did not change them).
        self.live_digests: dict[str, str] = {}
        self.twin_digests: dict[str, str] = {}

    @staticmethod
    def build(model: torch.nn.Module, *, runner_tensors: Iterable[torch.Tensor] = ()) -> StagingBuffers:
        """Raises StagingUnsupportedError as ``WeightMemory.of`` does; allocates nothing yet."""
        return StagingBuffers(WeightMemory.of(model, runner_tensors=runner_tensors))

    @property
    def nbytes(self) -> int:
        """Bytes of one copy of the staged weights: what the twins cost."""
        return sum(s.live.nbytes() for s in self.memory.storages)

    @property
    def spares(self) -> tuple[torch.UntypedStorage | None, ...]:
        """The twins, in the order of ``memory.storages`` (None until allocated)."""
        return tuple(s.twin for s in self.memory.storages)

    @property
    def allocated_bytes(self) -> int:
        return sum(spare.nbytes() for spare in self.spares if spare is not None)

    def allocate(self) -> None:
        """Allocate the twins (once); raises what the allocator raises."""
        for storage in self.memory.storages:
            if storage.twin is None:
                storage.twin = torch.UntypedStorage(storage.live.nbytes(), device=storage.live.device)

    def release(self) -> None:
        """Give the twins' memory back (staging is given up for good)."""
        self._forget()
        self.live_digests, self.twin_digests = {}, {}
        for storage in self.memory.storages:
            storage.twin = None

    def open(self) -> BufferStage:
        """The stage for the next update. Raises RuntimeError when the twins are not allocated or a
        stage is open, StagingRefusedError when a tensor left the storage it was found on."""
        if any(spare is None for spare in self.spares):
            raise RuntimeError("allocate() the staging buffers before opening a stage")
        if self._stage is not None and self._stage.is_open:
            raise RuntimeError("a weight stage is already open; activate or discard it first")
        # The last stage's twin views reference what is now the live memory: they must go before
        # the next swap counts references, and freeing ~400 tensors (0.1 ms) is done here, not
        # under the write lock.
        self._forget()
        moved = self.memory.viewers_moved()
        if moved:
            raise StagingRefusedError("tensors no longer view the memory the staging buffers know", tensors=moved[:5])
        self._stage = BufferStage(self)
        return self._stage

    def view(self, slot: Slot, *, twin: bool) -> torch.Tensor:
        """A tensor viewing ``slot``, in its storage's twin (``twin``) or live."""
        storage = self.memory.storages[slot.storage]
        source = storage.twin if twin else storage.live
        assert source is not None, "the twins are allocated before a stage opens"
        return slot.spec.view(source, slot.dtype)

    def _forget(self) -> None:
        stage, self._stage = self._stage, None
        if stage is not None:
            stage.discard()
            stage._moves = []


class BufferStage(Stage):
    """One update's new weights in the twins, while the live ones serve. Writes may run on several
    threads (of different names), the checksum once they are done."""

    in_place = False
    phases = ("stage_write", "stage_checksum")

    def __init__(self, buffers: StagingBuffers) -> None:
        self._buffers = buffers
        self._slots = buffers.memory.slots
        # Each viewer, its twin view, and where it lies in the live storage (to put it back should
        # the swap fail half-way): built outside the write lock, so the swap only rebinds viewers.
        self._moves: list[tuple[torch.Tensor, torch.Tensor, torch.UntypedStorage, ViewSpec]] = []
        for storage in buffers.memory.storages:
            assert storage.twin is not None
            for tensor in storage.viewers.values():
                spec = ViewSpec.of(tensor)
                self._moves.append((tensor, spec.view(storage.twin, tensor.dtype), storage.live, spec))
        super().__init__({name: (slot.dtype, slot.spec.size) for name, slot in self._slots.items()})

    def checksum(self) -> ModelChecksum:
        if self._checksum is None:
            # Model tensors no checkpoint holds (non-persistent buffers) keep their live values.
            for index, tensor in self._buffers.memory.fills:
                copy_and_digest(self._buffers.view(Slot(index, tensor.dtype, ViewSpec.of(tensor)), twin=True), tensor)
        return super().checksum()

    def write_with(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], copy: Callable[[torch.Tensor], str]
    ) -> str:
        digest = super().write_with(name, dtype, shape, copy)
        self._buffers.twin_digests[name] = digest
        return digest

    def _target(self, name: str) -> torch.Tensor:
        self._buffers.twin_digests.pop(name, None)  # unknown while it is written
        return self._buffers.view(self._slots[name], twin=True)

    def _keep(self, name: str) -> str:
        live = self._buffers.live_digests.get(name)
        if live is not None and self._buffers.twin_digests.get(name) == live:
            return live  # the twin holds these bytes already
        return self.write(name, self._buffers.view(self._slots[name], twin=False))

    def _swap(self) -> None:
        """Re-point every viewer at its twin, then trade live and twin storages; all or nothing.
        Raises StagingRefusedError (the stage discarded) for a viewer of a live storage nobody listed."""
        unknown = self._buffers.memory.unknown_viewers()
        if unknown:
            # A reference cycle can keep a dead temporary view alive until the collector runs;
            # only a viewer that survives a collection is real.
            gc.collect()
            unknown = self._buffers.memory.unknown_viewers()
        if unknown:
            self.discard()
            raise StagingRefusedError(
                "some weight memory is viewed by tensors the staging buffers do not know; swapping would "
                "leave them on the old weights",
                storages=unknown[:3],
            )
        done = 0
        with torch.no_grad():
            try:
                # Assigning .data re-points the tensor object as set_ would, in a sixth of its
                # time (no argument parsing): 0.05 ms for 400 tensors.
                for tensor, twin, _, _ in self._moves:
                    tensor.data = twin
                    done += 1
            except BaseException:
                for tensor, _, live, p in self._moves[:done]:
                    tensor.set_(live, p.offset, p.size, p.stride)
                raise
        for storage in self._buffers.memory.storages:
            assert storage.twin is not None
            storage.live, storage.twin = storage.twin, storage.live
        buffers = self._buffers
        buffers.twin_digests, buffers.live_digests = buffers.live_digests, dict(self._digests)


@dataclass(frozen=True)
class StagingReport:
    """What ``/get_server_info`` says about staging (``weight_staging``)."""

    mode: StagingMode
    budget: float
    weight_bytes: int = 0  # one copy of the weights, what staging costs (0: not staged, or off)
    staging_bytes: int = 0  # allocated now: 0 until the first staged update, then for good
    last_update_staged: bool | None = None  # whether the last verified update was (None: none yet)
    reason: str | None = None  # why updates are copied in place now, when they are

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mode": self.mode.value}


class StagingPolicy:
    """Which stage each change writes into: ``on`` always the buffers, ``auto`` when the twins fit
    in ``budget`` of the memory available then, ``off`` (or weights that cannot be staged) never."""

    def __init__(self, *, mode: StagingMode, budget: float) -> None:
        self._mode = mode
        self._budget = budget
        self._buffers: StagingBuffers | None = None
        off = mode is StagingMode.OFF
        self._report = StagingReport(mode=mode, budget=budget, reason="--weight-staging off" if off else None)

    def attach(self, model: torch.nn.Module, *, runner_tensors: Iterable[torch.Tensor]) -> None:
        """Find the storages of the loaded model's weights (no memory is allocated yet)."""
        if self._mode is StagingMode.OFF:
            return
        try:
            buffers = StagingBuffers.build(model, runner_tensors=runner_tensors)
        except StagingUnsupportedError as exc:
            logger.warning("weight updates will be copied in place: %s", exc)
            self._report = replace(self._report, reason=f"the weights cannot be staged: {exc}")
            return
        self._buffers = buffers
        self._report = replace(self._report, weight_bytes=buffers.nbytes)

    def open_stage(self, model: torch.nn.Module) -> Stage:
        """The buffers (allocated on first use) when the policy allows, else ``model``'s live
        tensors (the report says why)."""
        stage = self._open()
        self._report = replace(self._report, last_update_staged=stage is not None)
        if stage is not None:
            return stage
        if self._buffers is not None:
            self._buffers.live_digests = {}  # what a change in place leaves, no twin knows
        return LiveStage(model)

    def give_up(self, reason: str) -> None:
        """Stop staging for good and free the twins (a swap was refused: see ``BufferStage``)."""
        logger.error("weight updates will be copied in place from now on: %s", reason)
        if self._buffers is not None:
            self._buffers.release()
        self._buffers = None
        self._report = replace(self._report, staging_bytes=0, last_update_staged=False, reason=reason)

    def report(self) -> StagingReport:
        return self._report

    def _open(self) -> BufferStage | None:
        buffers = self._buffers
        if buffers is None:
            return None
        if any(spare is None for spare in buffers.spares):
            if self._mode is StagingMode.AUTO:
                device = buffers.memory.storages[0].live.device  # a twin is missing: there is a storage
                # Bytes the device can allocate now without pushing anything out (None: unknown).
                available = (
                    int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else available_host_memory()
                )
                if available is None or buffers.nbytes > self._budget * available:
                    seen = "unknown" if available is None else f"{available} bytes"
                    self._report = replace(
                        self._report,
                        reason=f"a second copy of the weights ({buffers.nbytes} bytes) does not fit in "
                        f"{self._budget:g} of the available memory ({seen}); raise --weight-staging-budget "
                        "or free memory",
                    )
                    return None
            try:
                buffers.allocate()
            except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                buffers.release()
                logger.warning("could not allocate %d bytes to stage weights: %s", buffers.nbytes, exc)
                self._report = replace(
                    self._report, reason=f"the staging copy ({buffers.nbytes} bytes) could not be allocated: {exc}"
                )
                return None
            self._report = replace(self._report, staging_bytes=buffers.allocated_bytes, reason=None)
        try:
            return buffers.open()
        except StagingRefusedError as exc:
            self.give_up(f"staging was given up: {exc}")
            return None

"""Where the live weights lie: the storages behind a checkpoint's tensors, every tensor object that
views them (fused q/k/v views, tied embeddings, the runner's ``weight_views``), and their twins.
A swap trades whole storages, so a viewer missing here would go on reading the old one; each
tensor object holds one reference to its storage, so a reference count shows one nobody listed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from miles.errors import MilesError
from miles.weights.checksum import saved_state_dict
from miles.weights.safetensors_io import dtype_name


class StagingUnsupportedError(MilesError):
    """The model's weights cannot be staged; updates are copied in place instead."""


@dataclass(frozen=True, slots=True)
class ViewSpec:
    """Where a tensor lies in its storage, in elements of its dtype."""

    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @staticmethod
    def of(tensor: torch.Tensor) -> ViewSpec:
        return ViewSpec(int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()))

    def view(self, storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor viewing this place of ``storage``."""
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, self.offset, self.size, self.stride)

    def byte_span(self, itemsize: int) -> tuple[int, int]:
        """The bytes of the storage this view reaches: ``[begin, end)``."""
        if math.prod(self.size) == 0:
            return (self.offset * itemsize, self.offset * itemsize)
        last = self.offset + sum((d - 1) * s for d, s in zip(self.size, self.stride, strict=True))
        return (self.offset * itemsize, (last + 1) * itemsize)


@dataclass(slots=True)
class StorageViews:
    """One storage the weights live in, every tensor object that views it, and its twin."""

    live: torch.UntypedStorage  # what the viewers view now; a swap trades it for the twin
    viewers: dict[str, torch.Tensor]  # by name, for messages
    twin: torch.UntypedStorage | None = None  # as large, once allocated


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor of the checkpoint's name space lives (a name ``checksum_module`` lists)."""

    storage: int  # index in WeightMemory.storages
    dtype: torch.dtype
    spec: ViewSpec


@dataclass
class WeightMemory:
    """The storages of a model's checkpoint tensors, their viewers, and where each tensor lies."""

    storages: list[StorageViews]
    slots: dict[str, Slot]
    # Model tensors on these storages that no checkpoint holds (a non-persistent buffer), with
    # their storage's index: a stage copies them from the live memory, so a swap keeps them.
    fills: list[tuple[int, torch.Tensor]]

    @staticmethod
    def of(model: torch.nn.Module, *, runner_tensors: Iterable[torch.Tensor] = ()) -> WeightMemory:
        """The map of ``model``'s weights and ``runner_tensors``. Raises StagingUnsupportedError for
        a tensor that is not dense, overlapping tensors, or a viewer neither of them lists."""
        storages, slots = _checkpoint_slots(model)
        index_of = {s.live._cdata: i for i, s in enumerate(storages)}
        canonical = {(s.storage, s.dtype, s.spec) for s in slots.values()}
        fills: list[tuple[int, torch.Tensor]] = []
        seen: set[int] = set()
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        listed = [(name, t, True) for name, t in named]
        listed += [(f"runner tensor {i}", t, False) for i, t in enumerate(runner_tensors)]
        for name, tensor, of_model in listed:
            if id(tensor) in seen:
                continue  # one object listed twice (tied weights): one viewer
            seen.add(id(tensor))
            index = index_of.get(tensor.untyped_storage()._cdata)
            if index is None:
                continue  # memory no checkpoint writes (a rotary table): no update changes it
            _require_dense(tensor, name)
            storages[index].viewers[name] = tensor
            if of_model and (index, tensor.dtype, ViewSpec.of(tensor)) not in canonical:
                fills.append((index, tensor))
        memory = WeightMemory(storages=storages, slots=slots, fills=fills)
        memory._check_layout()
        unknown = memory.unknown_viewers()
        if unknown:
            raise StagingUnsupportedError(
                "some weight memory is viewed by tensors that neither the model nor its runner lists, "
                "so a swap could not re-point them; list them in the runner's weight_views()",
                storages=unknown[:3],
            )
        return memory

    def unknown_viewers(self) -> list[str]:
        """Storages with more references than their known viewers, plus the storage object kept here."""
        return [
            f"{list(s.viewers)[:3]}: {references(s.live) - 1} references, {len(s.viewers)} known"
            for s in self.storages
            if references(s.live) != len(s.viewers) + 1
        ]

    def viewers_moved(self) -> list[str]:
        """Names of viewers that no longer view the storage they were found on."""
        return [
            name
            for s in self.storages
            for name, tensor in s.viewers.items()
            if tensor.untyped_storage()._cdata != s.live._cdata
        ]

    def _check_layout(self) -> None:
        """Refuse tensors that overlap without being the same view: staging could not copy one
        without changing the other."""
        spans: dict[int, list[tuple[int, int, str]]] = {}
        for name, slot in self.slots.items():
            spans.setdefault(slot.storage, []).append((*slot.spec.byte_span(slot.dtype.itemsize), name))
        for index, tensor in self.fills:
            begin, end = ViewSpec.of(tensor).byte_span(tensor.dtype.itemsize)
            spans.setdefault(index, []).append((begin, end, f"a {dtype_name(tensor.dtype)} tensor no checkpoint holds"))
        for entries in spans.values():
            entries.sort()
            for (_, end, first), (begin, _, second) in zip(entries, entries[1:], strict=False):
                if begin < end:
                    raise StagingUnsupportedError(
                        "two weight tensors overlap in memory without being the same view", first=first, second=second
                    )


def references(storage: torch.UntypedStorage) -> int:
    """References to the storage: one per tensor object viewing it or Python object wrapping it."""
    return int(torch._C._storage_Use_Count(storage._cdata))


def _checkpoint_slots(model: torch.nn.Module) -> tuple[list[StorageViews], dict[str, Slot]]:
    """The storages of a checkpoint of ``model``'s tensors and where each lies; a function of its
    own so that the state dict's views (references to the storages) are gone when counted."""
    storages: list[StorageViews] = []
    index_of: dict[int, int] = {}
    slots: dict[str, Slot] = {}
    for name, tensor in saved_state_dict(model).items():
        _require_dense(tensor, name)
        if tensor.numel() == 0:
            continue  # no bytes to stage; its view of whatever storage never changes
        storage = tensor.untyped_storage()
        index = index_of.setdefault(storage._cdata, len(storages))
        if index == len(storages):
            storages.append(StorageViews(live=storage, viewers={}))
        slots[name] = Slot(storage=index, dtype=tensor.dtype, spec=ViewSpec.of(tensor))
    return storages, slots


def _require_dense(tensor: torch.Tensor, name: str) -> None:
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested or tensor.device.type == "meta":
        raise StagingUnsupportedError("only dense tensors with memory can be staged", tensor=name)

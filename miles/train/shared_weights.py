"""A model's weights moved into a shared-memory segment (``PushPublisher.share_memory``), so that
pushes to engines on this machine read each tensor where it lies instead of a copy of it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from miles.weights.transport.segments import Segment

# Where shared storages start: a cache line, which every dtype's alignment divides.
_SHARED_ALIGN = 64


def shareable(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The parameters and buffers of ``module`` that ``share`` moves: dense CPU tensors holding
    any bytes."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
            continue
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes and not nbytes % tensor.element_size():
            yield tensor


def share(module: torch.nn.Module) -> Segment | None:
    """Move every CPU parameter and buffer of ``module`` into a new segment (each storage copied
    once, every tensor viewing it re-pointed, values unchanged); None when there is none. Raises
    PublishError when /dev/shm cannot hold them."""
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for tensor in shareable(module):
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    if not storages:
        return None
    offsets, size = [], 0
    for storage, _ in storages.values():
        offsets.append(size)
        size += -(-storage.nbytes() // _SHARED_ALIGN) * _SHARED_ALIGN
    segment = Segment(size)
    with torch.no_grad():
        for (storage, tensors), at in zip(storages.values(), offsets, strict=True):
            place = segment.flat[at : at + storage.nbytes()]
            place.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for tensor in tensors:
                start = at // tensor.element_size() + tensor.storage_offset()
                tensor.data = place.view(tensor.dtype).as_strided(tensor.size(), tensor.stride(), start)
    return segment

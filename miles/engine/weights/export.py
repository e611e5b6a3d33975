"""What an export (``POST /export_weights``, ``LiveWeights.export``) writes: a copy of the
weights read in sections, at a path named after their version and checksum."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from miles.engine.weights.lock import WeightsLock, read_in_sections

# Each part of a snapshot's directory name stays well inside NAME_MAX (255 bytes) in all.
_MAX_PART_CHARS = 96


def snapshot_path(snapshot_dir: Path, *, model_name: str, weight_version: str, checksum: str) -> Path:
    """Where the weights of ``checksum`` are exported: ``<model>-<version>-<checksum[:16]>``."""
    parts = [re.sub(r"[^A-Za-z0-9._-]", "_", part)[:_MAX_PART_CHARS] or "_" for part in (model_name, weight_version)]
    return snapshot_dir / "-".join([*parts, checksum[:16]])


def copy_weights(model: PreTrainedModel, lock: WeightsLock, *, writes: int, what: str) -> PreTrainedModel:
    """A copy of ``model``, read in short sections of ``lock`` (``read_in_sections``): a change
    waits for one slice, not for the whole copy, and ends it. Raises ConflictError: the weights
    changed since ``writes``."""
    # New, unfilled parameters and buffers (tied ones stay tied), filled from the model's own
    # tensor objects, which add no view of live memory.
    memo: dict[int, Any] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        # Contiguous whatever the live layout: the copy is filled with the bytes in logical order.
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        is_parameter = isinstance(tensor, torch.nn.Parameter)
        memo[id(tensor)] = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad) if is_parameter else empty
        pairs.append((tensor, empty.reshape(-1).view(torch.uint8)))
    copied = copy.deepcopy(model, memo)

    def copy_slice(index: int, start: int, chunk: torch.Tensor) -> None:
        with torch.no_grad():
            pairs[index][1][start : start + chunk.numel()].copy_(chunk)

    read_in_sections(lock, [live for live, _ in pairs], writes=writes, what=what, each=copy_slice)
    return copied

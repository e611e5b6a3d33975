"""The weights a vLLM worker holds, read back under the checkpoint's names and dtypes.

Fused rows are split again, the vocabulary padding cut, and a weight packed into a CPU kernel read
back exactly through that kernel (``I @ W.T``); docs/VLLM.md, "What the worker holds".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Rows of the identity passed through a packed kernel at once.
_IDENTITY_BLOCK = 1024


def held_state(model: torch.nn.Module, *, dtype: torch.dtype, tied_embeddings: bool) -> dict[str, torch.Tensor]:
    """Every tensor ``model`` (a vLLM model, tensor parallel size 1) holds, under the names and in
    the dtype of the checkpoint it was loaded from."""
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    modules = dict(model.named_modules())
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        tensor = _recovered(module, param) if leaf == "weight" else param.detach()
        rows = getattr(module, "org_vocab_size", None)
        if rows is not None and tensor.shape[0] > rows:
            tensor = tensor[:rows]  # the vocabulary padding vLLM added
        tensor = tensor.to(dtype).contiguous()
        if tied_embeddings and name == "lm_head.weight":
            continue  # the checkpoint keeps the embedding only
        parent, _, fused = module_name.rpartition(".")
        parts = packed.get(fused)
        if parts is None:
            state[name] = tensor
            continue
        sizes = list(getattr(module, "output_sizes", ()))
        if len(sizes) != len(parts) or sum(sizes) != tensor.shape[0]:
            raise ValueError(f"{module_name} fuses {parts} but its rows do not split by {sizes}")
        for part, piece in zip(parts, torch.split(tensor, sizes), strict=True):
            state[f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}"] = piece.contiguous()
    return state


def _recovered(module: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight: as it is, or read back through the kernel it was packed into
    (``cpu_linear`` applied to the identity, a block of rows at a time)."""
    if weight.numel() > 0 or not hasattr(module, "cpu_linear"):
        return weight.detach()
    in_features = int(getattr(module, "input_size_per_partition"))  # noqa: B009  # vLLM's, untyped
    kernel: Any = getattr(module, "cpu_linear")  # noqa: B009  # vLLM's, untyped
    # The activation dtype the layer's kernel expects: its parameters'.
    dtype = getattr(module, "params_dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()
    blocks = []
    with torch.inference_mode():
        for start in range(0, in_features, _IDENTITY_BLOCK):
            stop = min(start + _IDENTITY_BLOCK, in_features)
            block = torch.zeros(stop - start, in_features, dtype=dtype)
            rows = torch.arange(stop - start)
            block[rows, rows + start] = 1
            blocks.append(kernel(block, module.weight, None).t())
    return torch.cat(blocks, dim=1)

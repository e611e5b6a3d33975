"""The weights a vLLM worker holds, read back under the checkpoint's names and dtypes.

vLLM does not keep a checkpoint's tensors as they were loaded:

- it fuses rows: ``q_proj|k_proj|v_proj`` into ``qkv_proj`` and ``gate_proj|up_proj`` into
  ``gate_up_proj`` (the model class's ``packed_modules_mapping``; ``output_sizes`` gives each
  part's rows);
- it pads the vocabulary of the embedding and the LM head to a multiple of its padding
  (``org_vocab_size`` is the checkpoint's);
- on CPU, it packs every linear weight into a oneDNN or sgl-kernel handle inside
  ``layer.cpu_linear`` and leaves ``layer.weight`` empty (vLLM's own ``/weight_checker`` then
  hashes zero bytes: it can verify nothing here).

A packed weight is recovered exactly by passing the identity through the layer's own kernel:
``cpu_linear(I, weight, None)`` is ``I @ W.T``, every output one weight times one plus zeros. The
identity goes through in blocks of rows, so no more than a block's output is materialised at once.
The recovered tensors are cast back to the model's dtype (the kernel may answer float32 for a
bfloat16 model; every value it returns is one of the weights, so the cast is exact).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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
    """A linear layer's weight: as it is, or read back through the kernel it was packed into."""
    if weight.numel() > 0 or not hasattr(module, "cpu_linear"):
        return weight.detach()
    in_features = int(getattr(module, "input_size_per_partition"))  # noqa: B009  # vLLM's, untyped
    blocks = [block.t() for block in _identity_through(module, in_features)]
    return torch.cat(blocks, dim=1)


def _identity_through(module: torch.nn.Module, in_features: int) -> Iterator[torch.Tensor]:
    """``cpu_linear`` applied to the identity, a block of rows at a time (each ``rows x out``)."""
    kernel: Any = getattr(module, "cpu_linear")  # noqa: B009  # vLLM's, untyped
    dtype = _input_dtype(module)
    with torch.inference_mode():
        for start in range(0, in_features, _IDENTITY_BLOCK):
            stop = min(start + _IDENTITY_BLOCK, in_features)
            block = torch.zeros(stop - start, in_features, dtype=dtype)
            rows = torch.arange(stop - start)
            block[rows, rows + start] = 1
            yield kernel(block, module.weight, None)


def _input_dtype(module: torch.nn.Module) -> torch.dtype:
    """The activation dtype the layer's kernel expects (its parameters' dtype)."""
    dtype = getattr(module, "params_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()

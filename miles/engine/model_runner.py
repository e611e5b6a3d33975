"""The model on its device, and the batched forward passes the scheduler drives.

A runner (``ModelRunner``) keeps a running batch's KV state left-padded, so rows can join
(``merge``) and leave (``select``) between steps (docs/ENGINE.md, "Continuous batching").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from miles.engine import fused_decoder
from miles.engine.settings import Forward

logger = logging.getLogger("miles.engine")

KV = TypeVar("KV")


class ModelRunner(Protocol[KV]):
    """Batched prefill and decode over a KV state of type ``KV`` that rows can join and leave."""

    name: str

    def prefill(self, prompts: list[list[int]]) -> tuple[KV, torch.Tensor]:
        """Run the prompts as one left-padded batch; returns their KV state and last logits [B, V]."""

    def decode(self, batch: KV, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row; returns the next logits [B, V] and advances ``batch``."""

    def merge(self, left: KV, right: KV) -> KV:
        """One batch holding the rows of ``left`` then ``right`` (the shorter is padded on the left)."""

    def select(self, batch: KV, keep: list[int]) -> KV:
        """Keep only rows ``keep`` and drop leading columns that are padding for every remaining row."""

    def weight_views(self) -> list[torch.Tensor]:
        """Tensors the runner holds, besides the model's parameters and buffers, that view the
        weights' memory: a staged update re-points them with the parameters
        (``weights/buffers.py``), and refuses to swap while any tensor it was not told of does."""
        ...


def build_runner(
    model: PreTrainedModel, *, device: torch.device, pad_token_id: int, forward: Forward = Forward.AUTO
) -> ModelRunner:
    """The runner ``forward`` asks for. Raises ValueError when FUSED cannot run ``model``."""
    if forward is Forward.TRANSFORMERS:
        return TransformersRunner(model, device=device, pad_token_id=pad_token_id)
    reason = fused_decoder.supports(model)
    if reason is None:
        return fused_decoder.FusedDecoderRunner(model, device=device, pad_token_id=pad_token_id)
    if forward is Forward.FUSED:
        raise ValueError(f"--forward fused cannot serve this model: {reason}; use --forward auto or transformers")
    logger.info("serving with the Transformers forward: %s", reason)
    return TransformersRunner(model, device=device, pad_token_id=pad_token_id)


@dataclass
class BatchKV:
    """KV state of the running batch (owned and mutated by the scheduler thread only)."""

    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, T] long, 0 on left padding
    next_positions: torch.Tensor  # [B] long


def load_model(model_path: str | Path, *, device: torch.device) -> PreTrainedModel:
    """Load a Hugging Face causal LM for inference on ``device`` in the checkpoint's dtype."""
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype="auto")
    # from_pretrained may leave parameters as copy-on-write views of the checkpoint's memory map:
    # the first update would then pay a page fault per page (10x slower), and a start file cut
    # short in place would crash the process. Give every tensor memory of its own, once. Tied
    # weights stay tied: both modules hold the same Parameter object, changed in place here.
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.data = tensor.data.clone()
    # transformers wraps ``to`` with functools.wraps, whose stub drops the method's binding.
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    return model


class TransformersRunner:
    """Prefill and decode through the model's own Transformers forward, any causal LM."""

    name = "transformers"

    def __init__(self, model: PreTrainedModel, *, device: torch.device, pad_token_id: int) -> None:
        self.model = model
        self.device = device
        self.pad_token_id = pad_token_id

    def weight_views(self) -> list[torch.Tensor]:
        """None: the model's own forward reads its parameters and nothing else."""
        return []

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[BatchKV, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            cache=DynamicCache(),
            use_cache=True,
            logits_to_keep=1,
        )
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        batch = BatchKV(cache=out.cache, attention_mask=mask.to(self.device), next_positions=lengths.to(self.device))
        return batch, out.logits[:, -1, :]

    @torch.inference_mode()
    def decode(self, batch: BatchKV, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        ones = torch.ones((batch.attention_mask.shape[0], 1), dtype=torch.long, device=self.device)
        batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.next_positions.unsqueeze(1),
            cache=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch.cache = out.cache
        batch.next_positions = batch.next_positions + 1
        return out.logits[:, -1, :]

    @staticmethod
    def merge(left: BatchKV, right: BatchKV) -> BatchKV:
        width = max(left.attention_mask.shape[1], right.attention_mask.shape[1])
        # Keys and values are [B, heads, T, head_dim]; the zeros padded in are masked out.
        layers = [
            (
                torch.cat([_pad_left(lk, width, 2), _pad_left(rk, width, 2)]),
                torch.cat([_pad_left(lv, width, 2), _pad_left(rv, width, 2)]),
            )
            for (lk, lv), (rk, rv) in zip(_layers(left.cache), _layers(right.cache), strict=True)
        ]
        mask = torch.cat([_pad_left(left.attention_mask, width, 1), _pad_left(right.attention_mask, width, 1)])
        return BatchKV(
            cache=DynamicCache(ddp_cache_data=layers),
            attention_mask=mask,
            next_positions=torch.cat([left.next_positions, right.next_positions]),
        )

    @staticmethod
    def select(batch: BatchKV, keep: list[int]) -> BatchKV:
        index = torch.tensor(keep, dtype=torch.long, device=batch.attention_mask.device)
        mask = batch.attention_mask.index_select(0, index)
        # Leading columns that no remaining row uses are dead weight in every later step.
        used = mask.any(dim=0).nonzero()
        start = int(used[0].item()) if used.numel() else mask.shape[1]
        layers = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in _layers(batch.cache)
        ]
        return BatchKV(
            cache=DynamicCache(ddp_cache_data=layers),
            attention_mask=mask[:, start:],
            next_positions=batch.next_positions.index_select(0, index),
        )


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values; a layer kind without them (linear attention) cannot be re-batched."""
    pairs = []
    for layer in cache.layers:
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise TypeError(f"cache layer {type(layer).__name__} holds no keys and values to select rows of")
        pairs.append((layer.keys, layer.values))
    return pairs


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``tensor`` padded with zeros at the start of ``dim`` to ``width``."""
    missing = width - tensor.shape[dim]
    return F.pad(tensor, (0, 0) * (tensor.dim() - 1 - dim) + (missing, 0)) if missing else tensor

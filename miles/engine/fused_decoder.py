"""A lean forward for the Llama family (Llama, Mistral, Qwen2, Qwen3), with fused projections.

On a small model most of a Transformers decode step goes to its generality (about 30 module calls
per layer, a mask rebuilt every step); this runs the same math with plain tensor ops, as
docs/ENGINE.md ("Two forwards") describes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

# Model classes whose decoder layers this module reproduces exactly (same norms, same order).
SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})

# Free KV columns a batch gets when it is built or runs out (a decode step then writes in place).
_HEADROOM = 128


def supports(model: PreTrainedModel) -> str | None:
    """None when ``model`` can run on this forward, else why not (for logs and errors)."""
    config = model.config
    architecture = type(model).__name__
    if architecture not in SUPPORTED_ARCHITECTURES:
        return f"{architecture} is not one of {sorted(SUPPORTED_ARCHITECTURES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    mistral_window = architecture == "MistralForCausalLM" and getattr(config, "sliding_window", None) is not None
    if mistral_window or any(getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers):
        return "sliding-window attention"
    shared = _shared_projection_weights(model)
    if shared:
        return f"projection weights shared with other modules: {shared[:3]}"
    return None


@dataclass
class DecoderKV:
    """KV state of the running batch (owned and mutated by the scheduler thread only)."""

    keys: list[torch.Tensor]  # per layer [B, kv_heads, capacity, head_dim]
    values: list[torch.Tensor]
    valid: torch.Tensor  # [B, capacity] bool: True where a column holds one of the row's tokens
    length: int  # columns in use; columns past it are free
    next_positions: torch.Tensor  # [B] long

    @property
    def size(self) -> int:
        return int(self.valid.shape[0])


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head of q and k, before RoPE
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


class FusedDecoderRunner:
    """Prefill and decode for a Llama-family model that ``supports`` accepts (``build_runner``
    checks); see the module docstring."""

    name = "fused-decoder"

    def __init__(self, model: PreTrainedModel, *, device: torch.device, pad_token_id: int) -> None:
        config = model.config
        self.model = model
        self.device = device
        self.pad_token_id = pad_token_id
        self._body = model.model
        self._head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self._heads = int(config.num_attention_heads)
        self._kv_heads = int(config.num_key_value_heads)
        self._eps = float(config.rms_norm_eps)
        self._intermediate = int(config.intermediate_size)
        self._dtype = model.dtype
        with torch.no_grad():
            self._layers = [self._fuse_layer(layer) for layer in self._body.layers]
        self._scaling = float(self._body.layers[0].self_attn.scaling)
        self._split = [self._heads * self._head_dim, self._kv_heads * self._head_dim, self._kv_heads * self._head_dim]

    def _fuse_layer(self, layer: Any) -> _Layer:
        """Fuse one decoder layer of a supported architecture (``self_attn``'s q/k/v/o projections,
        ``mlp``'s gate/up/down, ``input_layernorm`` and ``post_attention_layernorm``)."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv_weight, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up_weight, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return _Layer(
            input_norm=layer.input_layernorm.weight,
            qkv_weight=qkv_weight,
            qkv_bias=qkv_bias,
            q_norm=q_norm.weight if q_norm is not None else None,
            k_norm=k_norm.weight if k_norm is not None else None,
            o_weight=attn.o_proj.weight,
            o_bias=attn.o_proj.bias,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up_weight=gate_up_weight,
            gate_up_bias=gate_up_bias,
            down_weight=mlp.down_proj.weight,
            down_bias=mlp.down_proj.bias,
        )

    def weight_views(self) -> list[torch.Tensor]:
        """The fused weights (and the parameters each layer keeps at hand): views of the weights'
        memory that are not the model's parameters, so a staged update must re-point them too."""
        views = (getattr(layer, field.name) for layer in self._layers for field in fields(layer))
        return [tensor for tensor in views if isinstance(tensor, torch.Tensor)]

    # --- the batch's KV state --------------------------------------------------------------

    def _empty(self, rows: int, capacity: int) -> DecoderKV:
        shape = (rows, self._kv_heads, capacity, self._head_dim)
        # Zeros, not empty: padding columns are read (and masked), and 0 * NaN would still be NaN.
        return DecoderKV(
            keys=[torch.zeros(shape, dtype=self._dtype, device=self.device) for _ in self._layers],
            values=[torch.zeros(shape, dtype=self._dtype, device=self.device) for _ in self._layers],
            valid=torch.zeros((rows, capacity), dtype=torch.bool, device=self.device),
            length=0,
            next_positions=torch.zeros(rows, dtype=torch.long, device=self.device),
        )

    def _grow(self, batch: DecoderKV) -> None:
        grown = self._empty(batch.size, batch.length + max(_HEADROOM, batch.length // 2))
        for new, old in zip(grown.keys + grown.values, batch.keys + batch.values, strict=True):
            new[:, :, : batch.length] = old[:, :, : batch.length]
        grown.valid[:, : batch.length] = batch.valid[:, : batch.length]
        batch.keys, batch.values, batch.valid = grown.keys, grown.values, grown.valid

    # --- the runner interface --------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[DecoderKV, torch.Tensor]:
        width = max(len(p) for p in prompts)
        batch = self._empty(len(prompts), width + _HEADROOM)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            batch.valid[row, width - len(prompt) : width] = True
        valid = batch.valid[:, :width]
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        # Causal over the row's own tokens. Padding queries attend to themselves only, so their
        # (unused) outputs stay finite and cannot poison later layers' padding keys.
        causal = torch.ones((width, width), dtype=torch.bool, device=self.device).tril()
        mask = (causal & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device)
        logits = self._forward(ids.to(self.device), positions, batch, mask[:, None])
        batch.length = width
        batch.next_positions = valid.sum(dim=-1)
        return batch, logits

    @torch.inference_mode()
    def decode(self, batch: DecoderKV, tokens: list[int]) -> torch.Tensor:
        if batch.length == batch.valid.shape[1]:  # no free column left
            self._grow(batch)
        column = batch.length
        batch.valid[:, column] = True
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        mask = batch.valid[:, None, None, : column + 1]
        logits = self._forward(ids, batch.next_positions.unsqueeze(1), batch, mask)
        batch.length += 1
        batch.next_positions = batch.next_positions + 1
        return logits

    @torch.inference_mode()
    def merge(self, left: DecoderKV, right: DecoderKV) -> DecoderKV:
        width = max(left.length, right.length)
        merged = self._empty(left.size + right.size, width + _HEADROOM)
        for rows, part in ((slice(0, left.size), left), (slice(left.size, None), right)):
            offset = width - part.length
            for new, old in zip(merged.keys + merged.values, part.keys + part.values, strict=True):
                new[rows, :, offset:width] = old[:, :, : part.length]
            merged.valid[rows, offset:width] = part.valid[:, : part.length]
        merged.length = width
        merged.next_positions = torch.cat([left.next_positions, right.next_positions])
        return merged

    @torch.inference_mode()
    def select(self, batch: DecoderKV, keep: list[int]) -> DecoderKV:
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        valid = batch.valid[:, : batch.length].index_select(0, index)
        used = valid.any(dim=0).nonzero()
        start = int(used[0].item()) if used.numel() else batch.length
        length = batch.length - start
        kept = self._empty(len(keep), length + _HEADROOM)
        for new, old in zip(kept.keys + kept.values, batch.keys + batch.values, strict=True):
            new[:, :, :length] = old[:, :, start : batch.length].index_select(0, index)
        kept.valid[:, :length] = valid[:, start:]
        kept.length = length
        kept.next_positions = batch.next_positions.index_select(0, index)
        return kept

    # --- the forward -----------------------------------------------------------------------

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, batch: DecoderKV, mask: torch.Tensor
    ) -> torch.Tensor:
        """Run ``ids`` [B, T] at ``positions``, writing their keys and values into ``batch``'s
        columns ``length .. length + T``; ``mask`` [B, 1, T, length + T] says what each query sees.
        Returns the logits of the last position [B, V]."""
        rows, steps = ids.shape
        start, end = batch.length, batch.length + ids.shape[1]
        hidden = self._body.embed_tokens(ids)
        cos, sin = self._body.rotary_emb(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_size, kv_size, _ = self._split
        for index, layer in enumerate(self._layers):
            x = self._rms_norm(hidden, layer.input_norm)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            q = qkv[..., :q_size].view(rows, steps, self._heads, self._head_dim)
            k = qkv[..., q_size : q_size + kv_size].view(rows, steps, self._kv_heads, self._head_dim)
            v = qkv[..., q_size + kv_size :].view(rows, steps, self._kv_heads, self._head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = self._rms_norm(q, layer.q_norm), self._rms_norm(k, layer.k_norm)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = batch.keys[index], batch.values[index]
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
            attended = self._attend(q, keys[:, :, :end], values[:, :, :end], mask)
            attended = attended.transpose(1, 2).reshape(rows, steps, q_size)
            hidden = hidden + F.linear(attended, layer.o_weight, layer.o_bias)
            x = self._rms_norm(hidden, layer.post_norm)
            gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
            gate, up = gate_up[..., : self._intermediate], gate_up[..., self._intermediate :]
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)
        last = self._rms_norm(hidden[:, -1, :], self._body.norm.weight)
        return self.model.lm_head(last)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` [B, H, T, D] over ``keys``/``values`` [B, KV, L, D] where ``mask`` allows."""
        rows, heads, steps, dim = q.shape
        if steps > 1 or q.dtype == torch.float32 or q.device.type != "cpu":
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self._scaling, enable_gqa=True)
        # One query per row in bfloat16 / float16 on a CPU: SDPA's CPU kernel has a large fixed
        # cost at reduced precision (~300 us per layer for 8 rows of the 500m preset, against
        # ~40 us in float32), so a decode step uses two small batched matmuls with the query heads
        # of a KV group side by side (~65 us). The arithmetic follows SDPA's: float32 scores and
        # softmax sums, the exponentials rounded to the model's dtype before the product with the
        # values, one rounding of the output; results differ from it by about one unit in the
        # last place.
        group = heads // self._kv_heads
        grouped = q.reshape(rows, self._kv_heads, group, dim).float()
        scores = torch.matmul(grouped, keys.float().transpose(-1, -2)).mul_(self._scaling)
        scores.masked_fill_(~mask, float("-inf"))
        weights = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
        total = weights.sum(dim=-1, keepdim=True)
        out = torch.matmul(weights.to(q.dtype).float(), values.float()).div_(total)
        return out.to(q.dtype).reshape(rows, heads, 1, dim)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Transformers' RMSNorm to the bit: normalise in float32, round to the input dtype, scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self._eps)
        return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking ``linears``' outputs; each module's parameters become views of it."""
    weight = torch.cat([linear.weight for linear in linears])
    has_bias = [linear.bias is not None for linear in linears]
    bias = torch.cat([linear.bias for linear in linears]) if all(has_bias) else None
    if any(has_bias) and bias is None:
        raise ValueError("cannot fuse projections where only some have a bias")
    offset = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = weight[offset : offset + rows]
        if bias is not None:
            linear.bias.data = bias[offset : offset + rows]
        offset += rows
    return weight, bias


def _shared_projection_weights(model: PreTrainedModel) -> list[str]:
    """Names of fused projection parameters that some other module also holds (tied weights)."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    fused = ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.")
    return sorted(
        name for names in owners.values() if len(names) > 1 for name in names if any(f in name for f in fused)
    )

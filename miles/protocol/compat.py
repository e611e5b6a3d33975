"""SGLang's request fields that the engine does not use: accepted and ignored, or refused by name.

SGLang's clients send many of them at their defaults: refusing those would break the clients, and
ignoring one that asks for something (an image, a grammar) would answer a question nobody asked.
The tables (``ignored_fields``, ``unsupported_fields``) and their rules: docs/ENGINE.md, "SGLang
compatibility"; ``tests/fast/engine/test_sglang_fields.py`` checks them against SGLang's source.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import model_validator

from miles.protocol.base import RequestModel

# The SGLang release whose request fields the engine follows (and sglang-router's, which fronts it).
SGLANG_VERSION = "0.5.23"
SGLANG_ROUTER_VERSION = "0.3.2"


@dataclass(frozen=True)
class Unsupported:
    """A field the engine cannot honour: why, and the values that leave it unset."""

    reason: str
    # SGLang's default for the field (always accepted), and other values that mean "unset".
    default: Any = None
    unset: tuple[Any, ...] = ()

    def is_unset(self, value: Any) -> bool:
        if value is None or _same(value, self.default) or any(_same(value, u) for u in self.unset):
            return True
        if isinstance(value, list):  # a batch: one value per prompt, each unset
            return all(self.is_unset(v) for v in value)
        return isinstance(value, dict) and not value


def _same(value: Any, other: Any) -> bool:
    # 0 == False in Python; a bool default must only match a bool (and a number a number).
    return type(value) is type(other) and value == other


# Reasons shared by several models, so every route words a refusal the same way.
MULTIMODAL = "the engine serves text-only causal LMs (no image, video or audio input)"
GRAMMAR = "constrained decoding (json_schema, regex, ebnf, structural tags) is not implemented"
LORA = "LoRA adapters are not supported; load merged weights with /update_weights_from_disk"
LOGIT_PROCESSOR = "custom logit processors and their parameters are not supported"
WATERMARK = "watermarking is not implemented"
DISAGGREGATION = "prefill/decode (and encoder) disaggregation is not supported; the engine runs whole requests"
DP_RANK = "the engine has one data-parallel rank, 0"
HIDDEN = "hidden states, routed experts and indexer top-k are not returned by this engine"
REASONING = "the engine has no reasoning parser or thinking budget"
EXTRA_OUTPUT = "the engine does not return this extra output"
SESSION = "SGLang sessions (continual prompting with session_params) are not supported"
INTERNAL = "an internal SGLang field, set by SGLang itself; clients do not send it"

# Fields that SGLang's native and OpenAI requests both carry, refused alike on every route.
SHARED_UNSUPPORTED: Mapping[str, Unsupported] = {
    "bootstrap_host": Unsupported(DISAGGREGATION),
    "bootstrap_port": Unsupported(DISAGGREGATION),
    "bootstrap_room": Unsupported(DISAGGREGATION),
    "routed_dp_rank": Unsupported(DP_RANK, unset=(0,)),
    "data_parallel_rank": Unsupported(DP_RANK, unset=(0,)),
    "disagg_prefill_dp_rank": Unsupported(DP_RANK, unset=(0,)),
    "return_hidden_states": Unsupported(HIDDEN, default=False),
    "return_routed_experts": Unsupported(HIDDEN, default=False),
    "routed_experts_start_len": Unsupported(HIDDEN, default=0),
    "lora_path": Unsupported(LORA),
    "session_params": Unsupported(SESSION),
    "custom_logit_processor": Unsupported(LOGIT_PROCESSOR),
    "watermark": Unsupported(WATERMARK),
    "images_config": Unsupported(MULTIMODAL),
    "mm_processor_kwargs": Unsupported(MULTIMODAL),
}


class SGLangFields(RequestModel):
    """Base of request models that follow an SGLang request class (see the module docstring)."""

    ignored_fields: ClassVar[frozenset[str]] = frozenset()
    unsupported_fields: ClassVar[Mapping[str, Unsupported]] = {}
    # Fields of this model that SGLang's class lacks, each documented in docs/ENGINE.md.
    extension_fields: ClassVar[frozenset[str]] = frozenset()
    # Fields whose null SGLang reads as "the default", so a client may send it.
    null_is_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _sglang_fields(cls, data: Any) -> Any:
        data = _drop_nulls(data, cls.null_is_default)
        if not isinstance(data, dict):
            return data
        refused = [
            f"field {name!r} is not supported by the miles engine ({rule.reason})"
            for name, rule in cls.unsupported_fields.items()
            if name in data and not rule.is_unset(data[name])
        ]
        if refused:
            raise ValueError(
                "; ".join(refused)
                + ". Leave it unset (null or its default), or send the request to a full SGLang server"
            )
        if not (data.keys() & (cls.ignored_fields | cls.unsupported_fields.keys())):
            return data
        return {k: v for k, v in data.items() if k not in cls.ignored_fields and k not in cls.unsupported_fields}


def _drop_nulls(data: Any, fields: frozenset[str]) -> Any:
    if not isinstance(data, dict) or not any(data.get(k, 0) is None for k in fields):
        return data
    return {k: v for k, v in data.items() if not (k in fields and v is None)}

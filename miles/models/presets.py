"""Named model presets: tiny Hugging Face causal LMs built from configs with a seeded init.

Every preset uses the miles byte-level tokenizer (``miles.models.tokenizer``), so its vocabulary
and special token ids are fixed. Same preset and seed give bit-identical weights on every run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import transformers

from miles.errors import UnknownPresetError
from miles.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE, build_tokenizer
from miles.weights.checkpoint import save_checkpoint

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from miles.weights.manifest import Manifest


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """A model of ``PRESETS``: the transformers class, the config keyword arguments, the weight dtype."""

    architecture: str
    config_kwargs: Mapping[str, Any]
    dtype: torch.dtype

    def build_config(self) -> PretrainedConfig:
        """The transformers config of this preset, special token ids and dtype included."""
        model_cls = getattr(transformers, self.architecture)
        return model_cls.config_class(
            **self.config_kwargs,
            vocab_size=VOCAB_SIZE,
            bos_token_id=BOS_TOKEN_ID,
            eos_token_id=EOS_TOKEN_ID,
            pad_token_id=PAD_TOKEN_ID,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def num_parameters(self) -> int:
        """The parameter count, computed on the meta device (no memory, no init)."""
        model_cls = getattr(transformers, self.architecture)
        with torch.device("meta"):
            model = model_cls(self.build_config())
        return sum(p.numel() for p in model.parameters())


_TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
_TINY_TIED = _TINY | dict(tie_word_embeddings=True)
_SMALL = _TINY | dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, max_position_embeddings=2048)
# Qwen2-0.5B's body (24 layers, GQA, biased qkv) sized to ~498M parameters with our small
# vocabulary; for benchmarks. Built directly in bfloat16: ~6 s and ~1.3 GB on 2 cores.
_500M = _TINY | dict(
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=5888,
    max_position_embeddings=4096,
)

PRESETS: Mapping[str, ModelPreset] = MappingProxyType(
    {
        "tiny": ModelPreset("LlamaForCausalLM", MappingProxyType(_TINY), torch.float32),
        "tiny-tied": ModelPreset("LlamaForCausalLM", MappingProxyType(_TINY_TIED), torch.float32),
        "small": ModelPreset("Qwen2ForCausalLM", MappingProxyType(_SMALL), torch.float32),
        "500m": ModelPreset("Qwen2ForCausalLM", MappingProxyType(_500M), torch.bfloat16),
    }
)


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; UnknownPresetError (listing the known ones) when none is."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(f"unknown model preset; choose one of {sorted(PRESETS)}", preset=name) from None


def build_model(preset: str, *, seed: int) -> PreTrainedModel:
    """A freshly initialised model of ``preset`` in eval mode, weights fixed by ``seed`` (the
    caller's RNG state untouched); UnknownPresetError for no such preset."""
    spec = get_preset(preset)
    config = spec.build_config()
    # fork_rng: seed the init without disturbing the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=spec.dtype)
    generation = model.generation_config
    generation.bos_token_id, generation.eos_token_id, generation.pad_token_id = BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID
    return model.eval()


def init_checkpoint(
    out_dir: str | os.PathLike[str],
    *,
    model_name: str,
    preset: str = "tiny",
    seed: int = 0,
    step: int = 0,
    overwrite: bool = False,
) -> Manifest:
    """Build ``preset`` with ``seed`` and save it with the tokenizer as a checkpoint at ``out_dir``
    (atomically, loadable with ``from_pretrained``).

    Raises:
        UnknownPresetError: no such preset.
        CheckpointExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    model = build_model(preset, seed=seed)
    return save_checkpoint(
        out_dir, model=model, tokenizer=build_tokenizer(), model_name=model_name, step=step, overwrite=overwrite
    )

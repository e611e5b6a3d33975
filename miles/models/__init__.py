"""Tiny Hugging Face causal LMs built locally from configs, and the byte-level tokenizer they share."""

from miles.models.presets import PRESETS, ModelPreset, build_model, get_preset, init_checkpoint
from miles.models.tokenizer import build_tokenizer

__all__ = ["PRESETS", "ModelPreset", "build_model", "build_tokenizer", "get_preset", "init_checkpoint"]

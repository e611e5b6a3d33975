"""Alias kept for the seed's import path: ``miles.ray.rollout.sft_rollout.SFTRollout``."""

from miles.rollout.sft_rollout import SFTRollout as SFTRollout

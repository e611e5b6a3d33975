"""The SGLang server type at the seed's rollout path: ``miles.ray.rollout.sglang_rollout.SGLangRollout``."""

from miles.rollout.sglang_rollout import SGLangRollout as SGLangRollout

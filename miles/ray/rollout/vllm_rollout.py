"""The vLLM server type at the seed's rollout path: ``miles.ray.rollout.vllm_rollout.VLLMRollout``."""

from miles.rollout.vllm_rollout import VLLMRollout as VLLMRollout

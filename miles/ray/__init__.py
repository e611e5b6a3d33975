"""Ray adapters (every Ray API call of miles lives under this package), and the seed's two import
paths, ``miles.ray.rollout.inference_controller`` and ``miles.ray.rollout.sft_rollout``."""

"""The seed's import path: ``from miles.ray.rollout.inference_controller import InferenceController``."""

from miles.controller.core import AsyncInferenceController as AsyncInferenceController
from miles.inference_controller import InferenceController as InferenceController

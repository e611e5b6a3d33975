"""The reference trainer: a tiny causal LM, SFT warm-up then GRPO on samples from the servers."""

from miles.train.config import TrainerConfig
from miles.train.publisher import DiskPublisher
from miles.train.reports import Phase, StepReport
from miles.train.sampling import HttpSampler
from miles.train.trainer import Trainer, write_initial_checkpoint

__all__ = [
    "DiskPublisher",
    "HttpSampler",
    "Phase",
    "StepReport",
    "Trainer",
    "TrainerConfig",
    "write_initial_checkpoint",
]

"""The reference trainer: a tiny causal LM, SFT warm-up then GRPO on samples from the servers.

``Trainer(config, sampler=..., publisher=...).run()`` trains and publishes every step's weights
through a ``Publisher`` (``DiskPublisher``: checkpoint, checksum event, verified apply).
"""

from miles.train.config import TrainerConfig
from miles.train.grpo import PolicyLoss, clipped_policy_loss, group_advantages
from miles.train.publisher import ApplyFn, DiskPublisher, Publisher, PublishResult, ReadyFn, always_ready
from miles.train.reports import Phase, Staleness, StepReport, TrainingSummary, VersionReward
from miles.train.sampling import Group, HttpSampler, Sample, Sampler
from miles.train.task import Completion, Ending, Problem, ReverseTask, parse_completion, score
from miles.train.trainer import OnStep, Trainer, write_initial_checkpoint

__all__ = [
    "ApplyFn",
    "Completion",
    "DiskPublisher",
    "Ending",
    "Group",
    "HttpSampler",
    "OnStep",
    "Phase",
    "PolicyLoss",
    "Problem",
    "PublishResult",
    "Publisher",
    "ReadyFn",
    "ReverseTask",
    "Sample",
    "Sampler",
    "Staleness",
    "StepReport",
    "Trainer",
    "TrainerConfig",
    "TrainingSummary",
    "VersionReward",
    "always_ready",
    "clipped_policy_loss",
    "group_advantages",
    "parse_completion",
    "score",
    "write_initial_checkpoint",
]

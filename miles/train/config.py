"""``TrainerConfig``: every knob of the reference trainer, with defaults sized for ``miles demo``.

The defaults train the ``tiny`` preset on string reversal: 250 SFT steps, then 300 GRPO steps on
samples from the servers, publishing after every step. Measured on a 2-core CPU against two engine
processes: about 45 s alone, about 100 s with four simulated users hammering the same engines,
with the servers' mean reward going from ~0.00 to ~0.77 (exact answers ~0.00 to ~0.62). A
controller in the path adds its own update latency per publish; raise ``publish_every`` to trade
update count for speed.

Sampling runs at temperature 1.0, always: the loss compares the trainer's logprobs with the
servers' raw (temperature-1) logprobs, which is only an importance ratio when both describe the
distribution the tokens were drawn from.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles.models.presets import PRESETS
from miles.train.task import ReverseTask

TEMPERATURE = 1.0


class LoopMode(StrEnum):
    """How GRPO steps and sampling follow each other."""

    # Sample a batch, train on it, publish, repeat: the fleet idles while the trainer trains.
    SYNC = "sync"
    # A producer keeps the fleet generating the batches of the next steps while the trainer
    # trains on finished ones, never starting a group that would be trained on more than
    # ``max_staleness`` versions after the one it is generated on.
    ASYNC = "async"


class TrainerConfig(BaseModel):
    """Settings of one training run (model, task, both phases, publishing, resources)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: Annotated[str, Field(min_length=1)] = "tiny-reverse"
    preset: str = "tiny"
    # Seeds the model's initial weights and the task's problem streams.
    seed: int = 0
    task: ReverseTask = ReverseTask()

    # SFT warm-up: teacher forcing on correct answers; each step also samples
    # ``sft_eval_prompts`` prompts x ``group_size`` completions from the servers to measure reward.
    sft_steps: Annotated[int, Field(ge=0)] = 250
    sft_batch_size: Annotated[int, Field(ge=1)] = 64
    sft_learning_rate: Annotated[float, Field(gt=0)] = 3e-3
    sft_eval_prompts: Annotated[int, Field(ge=1)] = 4

    # GRPO: each step samples ``prompts_per_step`` prompts x ``group_size`` completions.
    grpo_steps: Annotated[int, Field(ge=0)] = 300
    prompts_per_step: Annotated[int, Field(ge=1)] = 8
    group_size: Annotated[int, Field(ge=2, le=64)] = 8
    # Much lower than SFT's: Adam turns the noisy policy gradient of a small batch into full-size
    # steps, and at 1e-3 and above that noise undoes what SFT taught faster than rewards teach.
    grpo_learning_rate: Annotated[float, Field(gt=0)] = 3e-4
    clip_eps: Annotated[float, Field(gt=0, lt=1)] = 0.2
    loop: LoopMode = LoopMode.SYNC
    # Async only: how many published versions a sample's first token may be behind the weights
    # it is trained on (0 makes the async loop sample each batch after the publish before it).
    max_staleness: Annotated[int, Field(ge=0, le=16)] = 1
    advantage_eps: Annotated[float, Field(gt=0)] = 1e-6

    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0
    # Completion budget; must leave room for the longest answer plus its terminator.
    max_new_tokens: Annotated[int, Field(ge=2, le=256)] = 12

    # Publish after every ``publish_every`` optimizer steps (and always after the last one).
    publish_every: Annotated[int, Field(ge=1)] = 1
    # Torch intra-op threads of the trainer (process-wide); engines share the same cores.
    num_threads: Annotated[int, Field(ge=1)] = 1
    # The summary's first and last reward average this many steps at each end of the run.
    summary_window: Annotated[int, Field(ge=1)] = 5

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"unknown model preset {value!r}; choose one of {sorted(PRESETS)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.sft_steps + self.grpo_steps == 0:
            raise ValueError("sft_steps and grpo_steps are both 0; give at least one training step")
        if self.loop is LoopMode.ASYNC and self.publish_every - 1 > self.max_staleness:
            raise ValueError(
                f"with loop='async', publish_every ({self.publish_every}) may be at most max_staleness + 1 "
                f"({self.max_staleness + 1}): samples for a step could otherwise never be admitted; publish "
                "more often or raise max_staleness"
            )
        needed = self.task.max_length + 1  # the longest answer (a token per character) and its end
        if self.max_new_tokens < needed:
            raise ValueError(
                f"max_new_tokens ({self.max_new_tokens}) cannot fit the longest answer plus its terminator; "
                f"raise it to at least {needed} or lower task.max_length"
            )
        return self

    @property
    def total_steps(self) -> int:
        """Optimizer steps in the whole run (SFT then GRPO)."""
        return self.sft_steps + self.grpo_steps

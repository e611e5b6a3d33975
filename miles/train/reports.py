"""What the trainer reports: one ``StepReport`` per optimizer step and a ``TrainingSummary``.

Rewards are always measured on samples the servers generated (never on the trainer's own
model), so the curve shows what serving actually delivered, version by version.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from miles.train.publisher import PublishResult


class Phase(StrEnum):
    """Which objective a step optimised."""

    SFT = "sft"
    GRPO = "grpo"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class VersionReward(_Frozen):
    """Mean reward of the samples one weight version produced within a step."""

    weight_version: str
    mean_reward: float
    num_samples: Annotated[int, Field(ge=1)]


class Staleness(_Frozen):
    """How many versions the samples' first tokens were behind the weights the step trained:
    ``steps taken when training on the sample - int(its first token's version)``; ``counts[k]``
    samples were ``k`` behind. Versions that are no step number count in ``unparsed`` only."""

    min: int = 0
    max: int = 0
    mean: float = 0.0
    counts: tuple[int, ...] = ()
    unparsed: Annotated[int, Field(ge=0)] = 0

    @classmethod
    def of(cls, versions: Sequence[str], *, trainer_step: int) -> Staleness:
        """Of samples first generated on ``versions``, trained on after ``trainer_step`` steps."""
        gaps: list[int] = []
        for version in versions:
            with contextlib.suppress(ValueError):
                gaps.append(trainer_step - int(version))
        unparsed = len(versions) - len(gaps)
        if not gaps:
            return cls(unparsed=unparsed)
        behind = Counter(max(gap, 0) for gap in gaps)
        counts = tuple(behind[k] for k in range(max(behind) + 1))
        return cls(min=min(gaps), max=max(gaps), mean=sum(gaps) / len(gaps), counts=counts, unparsed=unparsed)

    @classmethod
    def combined(cls, parts: Sequence[Staleness]) -> Staleness:
        """Of all the samples ``parts`` describe."""
        measured = [p for p in parts if p.counts]
        unparsed = sum(p.unparsed for p in parts)
        if not measured:
            return cls(unparsed=unparsed)
        counts = [sum(c) for c in itertools.zip_longest(*(p.counts for p in measured), fillvalue=0)]
        return cls(
            min=min(p.min for p in measured),
            max=max(p.max for p in measured),
            mean=sum(p.mean * sum(p.counts) for p in measured) / sum(counts),
            counts=tuple(counts),
            unparsed=unparsed,
        )


def rewards_by_version(versions: Sequence[str], rewards: Sequence[float]) -> tuple[VersionReward, ...]:
    """Group ``rewards`` by the version that produced each, in order of first appearance."""
    return _version_means((v, r, 1) for v, r in zip(versions, rewards, strict=True))


def _version_means(totals: Iterable[tuple[str, float, int]]) -> tuple[VersionReward, ...]:
    """The mean reward per version of ``(version, reward total, sample count)`` triples."""
    by_version: dict[str, tuple[float, int]] = {}
    for version, total, count in totals:
        was_total, was_count = by_version.get(version, (0.0, 0))
        by_version[version] = (was_total + total, was_count + count)
    return tuple(VersionReward(weight_version=v, mean_reward=t / c, num_samples=c) for v, (t, c) in by_version.items())


class StepReport(_Frozen):
    """One optimizer step: its loss, the reward of the samples it saw, and what it published."""

    step: Annotated[int, Field(ge=1)]
    phase: Phase
    loss: float
    # Over the step's server samples (0 when there were none): partial credit included, and
    # the share of exact answers.
    mean_reward: float
    exact_rate: float
    rewards_by_version: tuple[VersionReward, ...]
    num_samples: Annotated[int, Field(ge=0)]
    # Samples a pause or update cut short; they are left out of rewards and the loss.
    num_interrupted: Annotated[int, Field(ge=0)] = 0
    staleness: Staleness
    # GRPO only: groups whose rewards were all equal (no learning signal; a sign of collapse).
    num_flat_groups: Annotated[int, Field(ge=0)] = 0
    # GRPO only (0 in SFT): share of tokens whose gradient the clip cut, the mean ratio, and the
    # estimated KL from the behaviour policy (the servers' logprobs) to the trainer's.
    clip_fraction: float = 0.0
    mean_ratio: float = 1.0
    behaviour_kl: float = 0.0
    # None on steps that did not publish (``publish_every`` > 1).
    publish: PublishResult | None = None
    step_s: float
    # Of ``step_s``: the trainer waiting for samples (idle), and the fleet generating none of the
    # trainer's (idle for training; it may serve users meanwhile).
    trainer_idle_s: Annotated[float, Field(ge=0)] = 0.0
    fleet_idle_s: Annotated[float, Field(ge=0)] = 0.0

    @classmethod
    def combined(cls, parts: Sequence[StepReport]) -> StepReport:
        """One step from each data-parallel rank's report of its share (rank 0's first): the loss
        and policy figures averaged over the ranks (as their gradients are), sample figures over all
        samples. Raises ValueError for no reports, or reports of different steps."""
        if not parts or len({(p.step, p.phase) for p in parts}) != 1:
            raise ValueError(f"combine the reports of one step, got {[(p.step, p.phase.value) for p in parts]}")

        def mean(value: Callable[[StepReport], float]) -> float:
            return sum(value(p) for p in parts) / len(parts)

        return parts[0].model_copy(
            update={
                "loss": mean(lambda p: p.loss),
                "mean_reward": _sample_mean(parts, lambda p: p.mean_reward),
                "exact_rate": _sample_mean(parts, lambda p: p.exact_rate),
                "rewards_by_version": _version_means(
                    (v.weight_version, v.mean_reward * v.num_samples, v.num_samples)
                    for p in parts
                    for v in p.rewards_by_version
                ),
                "num_samples": sum(p.num_samples for p in parts),
                "num_interrupted": sum(p.num_interrupted for p in parts),
                "staleness": Staleness.combined([p.staleness for p in parts]),
                "num_flat_groups": sum(p.num_flat_groups for p in parts),
                "clip_fraction": mean(lambda p: p.clip_fraction),
                "mean_ratio": mean(lambda p: p.mean_ratio),
                "behaviour_kl": mean(lambda p: p.behaviour_kl),
                "step_s": max(p.step_s for p in parts),
                "trainer_idle_s": mean(lambda p: p.trainer_idle_s),
                "fleet_idle_s": mean(lambda p: p.fleet_idle_s),
            }
        )


class TrainingSummary(_Frozen):
    """A whole run: reward at the start and the end (means over ``window`` steps), every step."""

    reward_first: float
    reward_last: float
    exact_first: float
    exact_last: float
    window: Annotated[int, Field(ge=1)]
    steps: tuple[StepReport, ...]
    wall_s: float
    # The last checkpoint published: what the servers serve when the run ends.
    final_publish: PublishResult

    @property
    def samples_dropped(self) -> int:
        """Samples generated but left out of training (cut short by an update or a pause)."""
        return sum(s.num_interrupted for s in self.steps)

    @property
    def max_staleness(self) -> int:
        """The most versions any trained sample's first token was behind."""
        return max((s.staleness.max for s in self.steps), default=0)

    def idle_fractions(self, phase: Phase = Phase.GRPO) -> tuple[float, float]:
        """The shares of ``phase``'s time the trainer waited for samples and the fleet idled."""
        steps = [s for s in self.steps if s.phase is phase]
        total = sum(s.step_s for s in steps)
        if total <= 0:
            return 0.0, 0.0
        return sum(s.trainer_idle_s for s in steps) / total, sum(s.fleet_idle_s for s in steps) / total

    @classmethod
    def of(cls, steps: Sequence[StepReport], *, window: int, wall_s: float) -> TrainingSummary:
        """Summarise ``steps`` (at least one, the last of them published)."""
        publishes = [s.publish for s in steps if s.publish is not None]
        if not steps or not publishes:
            raise ValueError("a summary needs at least one step and one publish")
        first, last = steps[:window], steps[-window:]
        return cls(
            reward_first=_sample_mean(first, lambda s: s.mean_reward),
            reward_last=_sample_mean(last, lambda s: s.mean_reward),
            exact_first=_sample_mean(first, lambda s: s.exact_rate),
            exact_last=_sample_mean(last, lambda s: s.exact_rate),
            window=window,
            steps=tuple(steps),
            wall_s=wall_s,
            final_publish=publishes[-1],
        )


def _sample_mean(steps: Sequence[StepReport], value: Callable[[StepReport], float]) -> float:
    # Weighted by sample count, so a step whose samples were all interrupted counts for nothing.
    total = sum(s.num_samples for s in steps)
    return sum(value(s) * s.num_samples for s in steps) / total if total else 0.0

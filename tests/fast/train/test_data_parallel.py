"""Data-parallel ranks without processes: how a batch is shared out, how rank 0 combines the ranks'
reports of one step into the whole step's, and the configurations ranks refuse by name."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from miles.config import TransferPath
from miles.demo.run import DemoConfig
from miles.errors import TrainerError
from miles.train import Trainer, TrainerConfig
from miles.train.config import LoopMode
from miles.train.parallel import share
from miles.train.publisher import PublishResult
from miles.train.ranks import RankSpec
from miles.train.reports import Phase, Staleness, StepReport, VersionReward


@pytest.mark.parametrize(
    ("count", "world", "shares"),
    [(8, 2, [4, 4]), (7, 2, [4, 3]), (4, 3, [2, 1, 1]), (1, 1, [1]), (2, 4, [1, 1, 0, 0])],
)
def test_every_item_of_a_batch_goes_to_exactly_one_rank(count: int, world: int, shares: list[int]) -> None:
    assert [share(count, rank=r, world_size=world) for r in range(world)] == shares


def _published(step: int) -> PublishResult:
    return PublishResult(
        step=step,
        weight_version=str(step),
        checksum="c",
        checkpoint_dir=None,
        path="shm, direct shards",
        save_s=0.0,
        ready_wait_s=0.0,
        apply_s=0.1,
        latency_s=0.1,
    )


def _report(*, rewards: dict[str, tuple[float, int]], loss: float, step_s: float, **staleness: object) -> StepReport:
    samples = sum(n for _, n in rewards.values())
    return StepReport(
        step=3,
        phase=Phase.GRPO,
        loss=loss,
        mean_reward=sum(r * n for r, n in rewards.values()) / samples if samples else 0.0,
        exact_rate=0.5 if samples else 0.0,
        rewards_by_version=tuple(
            VersionReward(weight_version=v, mean_reward=r, num_samples=n) for v, (r, n) in rewards.items()
        ),
        num_samples=samples,
        staleness=Staleness.model_validate(staleness) if staleness else Staleness(),
        num_flat_groups=1,
        publish=_published(3),
        step_s=step_s,
        trainer_idle_s=step_s / 2,
    )


def test_rank_0_reports_the_whole_step_from_every_ranks_share() -> None:
    rank0 = _report(rewards={"2": (1.0, 6)}, loss=1.0, step_s=0.5, min=0, max=0, mean=0.0, counts=(6,))
    rank1 = _report(
        rewards={"2": (0.0, 2), "1": (0.5, 4)}, loss=3.0, step_s=0.7, min=0, max=1, mean=4 / 6, counts=(2, 4)
    )
    whole = StepReport.combined([rank0, rank1])
    assert whole.step == 3 and whole.publish == rank0.publish
    assert whole.num_samples == 12
    assert whole.mean_reward == pytest.approx((6 * 1.0 + 4 * 0.5) / 12)
    assert whole.exact_rate == pytest.approx(0.5)
    assert {v.weight_version: (v.mean_reward, v.num_samples) for v in whole.rewards_by_version} == {
        "2": (pytest.approx(6 / 8), 8),
        "1": (0.5, 4),
    }
    # The gradients are averaged over the ranks; so is the loss.
    assert whole.loss == pytest.approx(2.0)
    assert whole.staleness.counts == (8, 4)
    assert (whole.staleness.min, whole.staleness.max) == (0, 1)
    assert whole.staleness.mean == pytest.approx(4 / 12)
    assert whole.num_flat_groups == 2
    assert whole.step_s == 0.7
    assert whole.trainer_idle_s == pytest.approx(0.3)


def test_a_rank_without_samples_adds_nothing_to_the_sample_figures() -> None:
    rank0 = _report(rewards={"5": (0.25, 4)}, loss=1.0, step_s=0.5, min=1, max=1, mean=1.0, counts=(0, 4))
    empty = _report(rewards={}, loss=0.0, step_s=0.5)
    whole = StepReport.combined([rank0, empty])
    assert (whole.num_samples, whole.mean_reward, whole.exact_rate) == (4, 0.25, 0.5)
    assert whole.staleness == rank0.staleness


def test_reports_of_different_steps_are_not_combined() -> None:
    report = _report(rewards={}, loss=0.0, step_s=0.1)
    with pytest.raises(ValueError, match="one step"):
        StepReport.combined([report, report.model_copy(update={"step": 4})])
    with pytest.raises(ValueError, match="one step"):
        StepReport.combined([])


@dataclass(frozen=True)
class TwoRanks:
    """Rank 0 of two, as far as the trainer's checks are concerned (they run before any sharding)."""

    rank: int = 0
    world_size: int = 2


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"loop": LoopMode.ASYNC}, "loop='sync'"),
        ({"prompts_per_step": 1}, "prompts_per_step"),
        ({"sft_batch_size": 1}, "sft_batch_size"),
    ],
)
def test_a_trainer_refuses_by_name_what_two_ranks_cannot_split(settings: dict[str, object], named: str) -> None:
    with pytest.raises(TrainerError, match=named):
        Trainer(TrainerConfig(**settings), sampler=None, publisher=None, parallel=TwoRanks())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "named"),
    [({"transfer": TransferPath.DISK}, "--transfer disk"), ({"loop": LoopMode.ASYNC}, "--async")],
)
def test_the_demo_refuses_by_name_what_its_ranks_cannot_honour(settings: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        DemoConfig(trainer_ranks=2, **settings)  # type: ignore[arg-type]
    DemoConfig(trainer_ranks=1, **settings)  # type: ignore[arg-type]


def test_ranks_publish_from_memory() -> None:
    with pytest.raises(ValidationError, match="from memory"):
        RankSpec(trainer=TrainerConfig(), controller_url="http://127.0.0.1:1", transfer=TransferPath.DISK)

"""The async GRPO loop's admission, against a scripted fleet that answers on the version it is
told to wait for: no group starts that would be trained more than ``max_staleness`` versions
after its first token, nothing is dropped, and a failing fleet stops the run without leaving
tasks behind."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from miles.errors import RolloutRequestError
from miles.train import Trainer, TrainerConfig
from miles.train.config import LoopMode
from miles.train.publisher import PublishResult
from miles.train.sampling import Group, Sample

SMALL = dict(sft_steps=0, prompts_per_step=2, group_size=2, max_new_tokens=8, summary_window=1, preset="tiny")


class ScriptedFleet:
    """Serves the newest published version (never older than asked), after ``delay_s``."""

    def __init__(self, *, delay_s: float = 0.01, fail_after: int | None = None) -> None:
        self.published = 0
        self.delay_s = delay_s
        self.fail_after = fail_after
        self.started: list[tuple[int, int]] = []  # (version asked for, version published) per group
        self.running = 0
        self.most_running = 0

    async def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        min_weight_version: str | None = None,
    ) -> list[Group]:
        asked = int(min_weight_version) if min_weight_version is not None else self.published
        assert asked <= self.published, "asked for a version nobody published"
        self.started.append((asked, self.published))
        if self.fail_after is not None and len(self.started) > self.fail_after:
            raise RolloutRequestError("the fleet is gone")
        version = str(self.published)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.running -= 1
        sample = Sample(
            output_ids=(5, 6),
            logprobs=(-1.0, -1.0),
            weight_version=version,
            weight_version_start=version,
            interrupted=False,
        )
        return [Group(prompt_ids=tuple(p), samples=(sample,) * group_size) for p in prompts]


class CountingPublisher:
    def __init__(self, fleet: ScriptedFleet, *, delay_s: float = 0.0) -> None:
        self.fleet = fleet
        self.delay_s = delay_s

    async def publish(self, model: object, tokenizer: object, *, step: int) -> PublishResult:
        await asyncio.sleep(self.delay_s)
        self.fleet.published = step
        return PublishResult(
            step=step,
            weight_version=str(step),
            checksum="c",
            checkpoint_dir=None,
            path="test",
            save_s=0.0,
            ready_wait_s=0.0,
            apply_s=0.0,
            latency_s=0.0,
        )


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
async def test_no_group_starts_beyond_the_staleness_bound(max_staleness: int) -> None:
    config = TrainerConfig(**SMALL, grpo_steps=6, loop=LoopMode.ASYNC, max_staleness=max_staleness)
    fleet = ScriptedFleet()
    trainer = Trainer(config, sampler=fleet, publisher=CountingPublisher(fleet, delay_s=0.02))
    summary = await trainer.run()
    per_step = config.prompts_per_step
    assert len(fleet.started) == 6 * per_step
    for index, (asked, published) in enumerate(fleet.started):
        trained_on = index // per_step  # the trainer's version when it trains on this group
        assert trained_on - asked <= max_staleness
        assert asked == published  # it asks for the newest version there is
    assert summary.max_staleness <= max_staleness
    assert summary.samples_dropped == 0
    assert all(step.staleness.min >= 0 for step in summary.steps)
    if max_staleness > 0:
        # Groups of later steps ran while the trainer trained: some samples were stale.
        assert any(sum(step.staleness.counts[1:]) for step in summary.steps)
        assert fleet.most_running > per_step
    else:
        assert all(step.staleness.max == 0 for step in summary.steps)
        assert fleet.most_running <= per_step


async def test_a_failing_fleet_stops_the_run_and_leaves_no_task() -> None:
    config = TrainerConfig(**SMALL, grpo_steps=5, loop=LoopMode.ASYNC, max_staleness=1)
    fleet = ScriptedFleet(fail_after=5)
    trainer = Trainer(config, sampler=fleet, publisher=CountingPublisher(fleet))
    before = asyncio.all_tasks()
    with pytest.raises(RolloutRequestError, match="gone"):
        await trainer.run()
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == before


def test_async_publishing_must_keep_up_with_the_bound() -> None:
    with pytest.raises(ValueError, match="publish_every"):
        TrainerConfig(**SMALL, grpo_steps=2, loop=LoopMode.ASYNC, max_staleness=0, publish_every=2)
    TrainerConfig(**SMALL, grpo_steps=2, loop=LoopMode.ASYNC, max_staleness=1, publish_every=2)

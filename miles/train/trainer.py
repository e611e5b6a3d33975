"""The training loop: an SFT warm-up, then GRPO on completions sampled from the servers.

Every ``publish_every`` optimizer steps (and after the last) the weights are published. GRPO runs
sync or async (``TrainerConfig.loop``; docs/ARCHITECTURE.md, "Processes and threads", Trainer).
Torch work runs in a worker thread so the event loop (which may also run a controller or a UI)
stays responsive.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import os
import random
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.errors import TrainerError
from miles.models.presets import build_model
from miles.models.tokenizer import build_tokenizer
from miles.train.config import LoopMode, TrainerConfig
from miles.train.grpo import PolicyLoss, clipped_policy_loss, group_advantages
from miles.train.parallel import Parallelism, SingleProcess, share
from miles.train.policy import completion_logprobs, encode_answer, encode_prompt, pack, sft_loss
from miles.train.publisher import Publisher, PublishResult
from miles.train.reports import Phase, Staleness, StepReport, TrainingSummary, rewards_by_version
from miles.train.sampling import Group, Sample, Sampler
from miles.train.task import Problem, parse_completion, score
from miles.weights.checkpoint import Manifest, save_checkpoint

OnStep = Callable[[StepReport], None]
"""Called with each step's report as soon as the step (and its publish) is done; must be quick."""


def write_initial_checkpoint(
    out_dir: str | os.PathLike[str], config: TrainerConfig, *, overwrite: bool = False
) -> Manifest:
    """Write the untrained model a ``Trainer(config)`` starts from as the step-0 checkpoint (the
    importance ratios rely on the servers and the trainer starting from identical weights). Raises
    UnknownPresetError for an unknown ``config.preset``, CheckpointExistsError as ``save_checkpoint``."""
    return save_checkpoint(
        out_dir,
        model=build_model(config.preset, seed=config.seed),
        tokenizer=build_tokenizer(),
        model_name=config.model_name,
        step=0,
        overwrite=overwrite,
    )


@dataclass(frozen=True, slots=True)
class _Scored:
    prompt_ids: tuple[int, ...]
    sample: Sample
    reward: float


class Trainer:
    """Trains a fresh ``config.preset`` model on ``config.task`` with samples from ``sampler``."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        sampler: Sampler,
        publisher: Publisher,
        on_step: OnStep | None = None,
        parallel: Parallelism | None = None,
    ) -> None:
        """Build the model (seeded as ``write_initial_checkpoint`` does, sharded by ``parallel``).
        Raises UnknownPresetError for an unknown ``config.preset``, TrainerError when ``config``
        cannot be split over ``parallel``'s ranks."""
        self.config = config
        self._parallel = parallel or SingleProcess()
        rank, world = self._parallel.rank, self._parallel.world_size
        if world > 1:
            _check_splittable(config, world)
        # This rank's share of each batch (all of it in one process).
        self._prompts_per_step = share(config.prompts_per_step, rank=rank, world_size=world)
        self._sft_batch_size = share(config.sft_batch_size, rank=rank, world_size=world)
        self._sft_eval_prompts = share(config.sft_eval_prompts, rank=rank, world_size=world)
        self.tokenizer = build_tokenizer()
        self.model = self._parallel.shard(build_model(config.preset, seed=config.seed).train())
        self._sampler = sampler
        self._publisher = publisher
        self._on_step = on_step
        # Separate streams: how many problems measuring takes must not change what training sees.
        # Each rank draws its own problems; rank 0 draws what a single process does.
        stream = f"{config.seed}" if rank == 0 else f"{config.seed}/rank-{rank}"
        self._train_rng = random.Random(f"{stream}/train")
        self._eval_rng = random.Random(f"{stream}/eval")
        self._steps_done = 0
        # The last step published (0: the initial checkpoint, which the servers start on).
        self._published = 0
        self._fleet = _FleetClock()

    async def run(self) -> TrainingSummary:
        """Run every SFT step, then every GRPO step; return the summary. Raises RolloutRequestError
        when sampling failed, PublishError when publishing did (the servers may serve an older version)."""
        torch.set_num_threads(self.config.num_threads)
        started = time.monotonic()
        reports: list[StepReport] = []
        cfg = self.config
        for phase, count, learning_rate in (
            (Phase.SFT, cfg.sft_steps, cfg.sft_learning_rate),
            (Phase.GRPO, cfg.grpo_steps, cfg.grpo_learning_rate),
        ):
            if count == 0:
                continue
            # A fresh optimizer per phase: SFT's moment estimates describe another objective.
            optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate, weight_decay=0.0)
            steps = (
                self._grpo_async(count, optimizer)
                if phase is Phase.GRPO and cfg.loop is LoopMode.ASYNC
                else self._sync(phase, count, optimizer)
            )
            # Closed on the way out whatever happens: the async loop's producer stops with it.
            async with aclosing(steps):
                async for mine in steps:
                    report = await self._parallel.combine(mine)
                    reports.append(report)
                    if self._on_step is not None:
                        self._on_step(report)
        return TrainingSummary.of(reports, window=cfg.summary_window, wall_s=time.monotonic() - started)

    async def _sync(self, phase: Phase, count: int, optimizer: torch.optim.Optimizer) -> AsyncGenerator[StepReport]:
        cfg = self.config
        for _ in range(count):
            started = time.monotonic()
            idle_before = self._fleet.idle_s()
            waited = 0.0
            if phase is Phase.SFT:
                measured = [cfg.task.sample(self._eval_rng) for _ in range(self._sft_eval_prompts)]
                lesson = [cfg.task.sample(self._train_rng) for _ in range(self._sft_batch_size)]
                # Measuring and training overlap: the samples come from the weights already served.
                groups, update = await asyncio.gather(
                    self._sample(measured), asyncio.to_thread(self._sft_update, lesson, optimizer)
                )
                scored = self._score(measured, groups)
            else:
                problems = [cfg.task.sample(self._train_rng) for _ in range(self._prompts_per_step)]
                waiting = time.monotonic()
                groups = await self._sample(problems)
                waited = time.monotonic() - waiting
                scored = self._score(problems, groups)
                update = await asyncio.to_thread(self._grpo_update, scored, optimizer)
            step = self._count_step()
            publish = None
            if self._due(step):
                publish = await self._publisher.publish(self.model, self.tokenizer, step=step)
                self._published = step
            yield self._report(
                phase,
                step,
                groups,
                scored,
                update,
                publish=publish,
                step_s=time.monotonic() - started,
                trainer_idle_s=waited,
                fleet_idle_s=self._fleet.idle_s() - idle_before,
            )

    async def _grpo_async(self, count: int, optimizer: torch.optim.Optimizer) -> AsyncGenerator[StepReport]:
        """``count`` GRPO steps with sampling overlapped; a step's weights are published from a copy
        while the next step trains, and its report comes once that publish is done."""
        cfg = self.config
        per_step = self._prompts_per_step
        first = self._steps_done
        started_groups: list[tuple[Problem, asyncio.Task[list[Group]]]] = []
        changed = asyncio.Condition()
        stopped = asyncio.Event()
        # What a publish reads while the model trains on (allocated once, refreshed per publish).
        published_copy = copy.deepcopy(self.model).eval()
        # Publishing while the next step trains delays the version the next groups may start on
        # by a step: worth it only when the bound leaves room for sampling, training and
        # publishing to overlap all three (max_staleness >= 2); otherwise sampling overlaps
        # training and publishing, one after the other.
        overlap_publish = cfg.max_staleness >= 2

        def admitted(trained_on: int) -> Callable[[], bool]:
            return lambda: trained_on - self._published <= cfg.max_staleness

        async def produce() -> None:
            try:
                for index in range(count * per_step):
                    # The trainer's version when it trains on this group: the group may start once
                    # the version max_staleness before it is published, and asks for it or later.
                    async with changed:
                        await changed.wait_for(admitted(first + index // per_step))
                        floor = self._published
                    problem = cfg.task.sample(self._train_rng)
                    task = asyncio.create_task(self._sample([problem], min_weight_version=str(floor)))
                    async with changed:
                        started_groups.append((problem, task))
                        changed.notify_all()
            finally:
                async with changed:
                    stopped.set()
                    changed.notify_all()  # the trainer sees the producer stop, whatever stopped it

        async def publish(step: int) -> PublishResult:
            result = await self._publisher.publish(published_copy, self.tokenizer, step=step)
            async with changed:
                self._published = step
                changed.notify_all()
            return result

        producer = asyncio.create_task(produce())
        publishing: asyncio.Task[PublishResult] | None = None
        # The last step's report, waiting for its publish.
        pending: Callable[..., StepReport] | None = None
        try:
            for step_index in range(count):
                started = time.monotonic()
                idle_before = self._fleet.idle_s()
                needed = (step_index + 1) * per_step

                def startable(needed: int = needed) -> bool:
                    return len(started_groups) >= needed or stopped.is_set()

                waiting = time.monotonic()
                async with changed:
                    await changed.wait_for(startable)
                if len(started_groups) < needed:
                    await producer  # raises what stopped it
                batch = started_groups[step_index * per_step : needed]
                groups = [group for sampled in await asyncio.gather(*(task for _, task in batch)) for group in sampled]
                waited = time.monotonic() - waiting
                scored = self._score([problem for problem, _ in batch], groups)
                update = await asyncio.to_thread(self._grpo_update, scored, optimizer)
                step = self._count_step()
                # The copy is free once the last publish is done: the report of its step goes out.
                last = await publishing if publishing is not None else None
                if pending is not None:
                    yield pending(publish=last)
                publishing = None
                if self._due(step):
                    await asyncio.to_thread(_copy_weights, published_copy, self.model)
                    publishing = asyncio.create_task(publish(step))
                    if not overlap_publish:
                        await asyncio.wait([publishing])
                pending = functools.partial(
                    self._report,
                    Phase.GRPO,
                    step,
                    groups,
                    scored,
                    update,
                    step_s=time.monotonic() - started,
                    trainer_idle_s=waited,
                    fleet_idle_s=self._fleet.idle_s() - idle_before,
                )
            if pending is not None:
                ending = time.monotonic()
                idle_before = self._fleet.idle_s()
                last = await publishing if publishing is not None else None
                report = pending(publish=last)
                yield report.model_copy(
                    update={
                        "step_s": report.step_s + time.monotonic() - ending,
                        "fleet_idle_s": report.fleet_idle_s + self._fleet.idle_s() - idle_before,
                    }
                )
        finally:
            tasks: list[asyncio.Future[Any]] = [producer, *(task for _, task in started_groups)]
            if publishing is not None:
                tasks.append(publishing)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _count_step(self) -> int:
        self._steps_done += 1
        return self._steps_done

    def _due(self, step: int) -> bool:
        return step % self.config.publish_every == 0 or step == self.config.total_steps

    def _report(
        self,
        phase: Phase,
        step: int,
        groups: Sequence[Group],
        scored: Sequence[Sequence[_Scored]],
        update: PolicyLoss,
        *,
        publish: PublishResult | None,
        step_s: float,
        trainer_idle_s: float,
        fleet_idle_s: float,
    ) -> StepReport:
        samples = [s for group in scored for s in group]
        rewards = [s.reward for s in samples]
        return StepReport(
            step=step,
            phase=phase,
            loss=float(update.loss),
            mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
            exact_rate=sum(s.reward == 1.0 for s in samples) / len(samples) if samples else 0.0,
            rewards_by_version=rewards_by_version([s.sample.weight_version for s in samples], rewards),
            num_samples=len(samples),
            num_interrupted=sum(len(g.samples) for g in groups) - len(samples),
            staleness=Staleness.of([s.sample.weight_version_start for s in samples], trainer_step=step - 1),
            num_flat_groups=0 if phase is Phase.SFT else sum(_flat(group) for group in scored),
            clip_fraction=update.clip_fraction,
            mean_ratio=update.mean_ratio,
            behaviour_kl=update.behaviour_kl,
            publish=publish,
            step_s=step_s,
            trainer_idle_s=trainer_idle_s,
            fleet_idle_s=fleet_idle_s,
        )

    async def _sample(self, problems: Sequence[Problem], *, min_weight_version: str | None = None) -> list[Group]:
        prompts = [encode_prompt(p, tokenizer=self.tokenizer) for p in problems]
        with self._fleet.busy():
            return await self._sampler.sample(
                prompts,
                group_size=self.config.group_size,
                max_new_tokens=self.config.max_new_tokens,
                min_weight_version=min_weight_version,
            )

    def _score(self, problems: Sequence[Problem], groups: Sequence[Group]) -> list[list[_Scored]]:
        parse = functools.partial(parse_completion, tokenizer=self.tokenizer)
        return [
            [_Scored(g.prompt_ids, s, score(problem, parse(s.output_ids))) for s in g.samples if not s.interrupted]
            for problem, g in zip(problems, groups, strict=True)
        ]

    def _sft_update(self, problems: Sequence[Problem], optimizer: torch.optim.Optimizer) -> PolicyLoss:
        batch = pack(
            [encode_prompt(p, tokenizer=self.tokenizer) for p in problems],
            [encode_answer(p, tokenizer=self.tokenizer) for p in problems],
            pad_token_id=self.tokenizer.pad_token_id,
        )
        loss = sft_loss(self.model, batch)
        self._apply_gradients(loss, optimizer)
        return PolicyLoss(loss=loss.detach())

    def _grpo_update(self, scored: Sequence[Sequence[_Scored]], optimizer: torch.optim.Optimizer) -> PolicyLoss:
        # A group cut below two samples by interruptions has no baseline to compare against.
        kept = [group for group in scored if len(group) >= 2]
        rows = [s for group in kept for s in group]
        if not rows:
            if self._parallel.world_size > 1:
                self._apply_gradients(self._nothing_learned(), optimizer)
            return PolicyLoss(loss=torch.zeros(()))
        batch = pack(
            [r.prompt_ids for r in rows], [r.sample.output_ids for r in rows], pad_token_id=self.tokenizer.pad_token_id
        )
        server = torch.zeros(batch.completion_mask.shape)
        for row, item in enumerate(rows):
            server[row, : len(item.sample.logprobs)] = torch.tensor(item.sample.logprobs)
        advantages = [
            group_advantages(torch.tensor([[s.reward for s in group]]), eps=self.config.advantage_eps)[0]
            for group in kept
        ]
        result = clipped_policy_loss(
            logp_trainer=completion_logprobs(self.model, batch),
            logp_server=server,
            advantages=torch.cat(advantages),
            mask=batch.completion_mask,
            clip_eps=self.config.clip_eps,
        )
        self._apply_gradients(result.loss, optimizer)
        # Detached: the report may wait a step for its publish, and must not keep the graph alive.
        return dataclasses.replace(result, loss=result.loss.detach())

    def _nothing_learned(self) -> torch.Tensor:
        """A loss of 0 with the model in its graph, for a rank whose share of a step left nothing to
        train on: every rank takes part in every step's collectives, so it contributes a zero gradient."""
        batch = pack(
            [[self.tokenizer.bos_token_id]], [[self.tokenizer.eos_token_id]], pad_token_id=self.tokenizer.pad_token_id
        )
        return completion_logprobs(self.model, batch).sum() * 0.0

    def _apply_gradients(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        optimizer.step()


def _check_splittable(config: TrainerConfig, world: int) -> None:
    """Raises TrainerError when ``config`` cannot be trained by ``world`` data-parallel ranks."""
    if config.loop is not LoopMode.SYNC:
        raise TrainerError(
            f"the {config.loop.value} loop publishes from a copy of the whole model, which ranks that each hold "
            f"a shard of it do not make; train {world} ranks with loop='sync'"
        )
    for name in ("prompts_per_step", "sft_batch_size"):
        if getattr(config, name) < world:
            raise TrainerError(
                f"{name} ({getattr(config, name)}) is below the number of ranks ({world}): each rank trains its "
                f"share of every batch; raise {name} to at least {world} or use fewer ranks"
            )


@dataclass
class _FleetClock:
    """How long the fleet had none of the trainer's generations to run."""

    running: int = 0
    idle_since: float | None = field(default_factory=time.monotonic)
    idle: float = 0.0

    def idle_s(self) -> float:
        return self.idle + (time.monotonic() - self.idle_since if self.idle_since is not None else 0.0)

    @contextmanager
    def busy(self) -> Iterator[None]:
        if self.running == 0 and self.idle_since is not None:
            self.idle += time.monotonic() - self.idle_since
            self.idle_since = None
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            if self.running == 0:
                self.idle_since = time.monotonic()


@torch.no_grad()
def _copy_weights(target: torch.nn.Module, source: torch.nn.Module) -> None:
    for into, value in zip(target.state_dict().values(), source.state_dict().values(), strict=True):
        into.copy_(value)


def _flat(group: Sequence[_Scored]) -> bool:
    return len(group) >= 2 and len({s.reward for s in group}) == 1

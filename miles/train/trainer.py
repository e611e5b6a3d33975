"""The training loop: an SFT warm-up, then GRPO on completions sampled from the servers.

Every step is one optimizer step. An SFT step trains on correct answers (teacher forcing) while,
concurrently, a few prompts are sampled from the servers to measure reward. A GRPO step samples
``prompts_per_step`` groups of ``group_size`` completions from the servers, scores them, and
trains on them with the clipped policy-gradient loss against the servers' logprobs. After every
``publish_every`` steps (and after the last) the weights are published, so the next samples come
from the new version. Torch work runs in a worker thread so the event loop (which may also run a
controller or a UI) stays responsive.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from miles.models.presets import build_model
from miles.models.tokenizer import build_tokenizer
from miles.train.config import TrainerConfig
from miles.train.grpo import clipped_policy_loss, group_advantages
from miles.train.policy import completion_logprobs, encode_answer, encode_prompt, pack, sft_loss
from miles.train.publisher import Publisher
from miles.train.reports import Phase, Staleness, StepReport, TrainingSummary, rewards_by_version
from miles.train.sampling import Group, Sample, Sampler
from miles.train.task import Problem, parse_completion, score
from miles.weights.checkpoint import Manifest, save_checkpoint

OnStep = Callable[[StepReport], None]
"""Called with each step's report as soon as the step (and its publish) is done; must be quick."""


def write_initial_checkpoint(
    out_dir: str | os.PathLike[str], config: TrainerConfig, *, overwrite: bool = False
) -> Manifest:
    """Write the untrained model a ``Trainer(config)`` starts from, as the step-0 checkpoint.

    Serve this checkpoint before training starts: the servers and the trainer then begin from
    identical weights (same preset, same seed), which the importance ratios rely on.

    Raises:
        UnknownPresetError: ``config.preset`` is not a preset.
        CheckpointExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    return save_checkpoint(
        out_dir,
        model=build_model(config.preset, seed=config.seed),
        tokenizer=build_tokenizer(),
        model_name=config.model_name,
        step=0,
        overwrite=overwrite,
    )


@dataclass(frozen=True, slots=True)
class _Update:
    """What one optimizer step reports (SFT leaves the GRPO-only figures at their neutral values)."""

    loss: float
    clip_fraction: float = 0.0
    mean_ratio: float = 1.0


@dataclass(frozen=True, slots=True)
class _Scored:
    """A served sample with its reward, ready for the loss."""

    prompt_ids: tuple[int, ...]
    sample: Sample
    reward: float
    exact: bool


class Trainer:
    """Trains a fresh ``config.preset`` model on ``config.task`` with samples from ``sampler``."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        sampler: Sampler,
        publisher: Publisher,
        on_step: OnStep | None = None,
    ) -> None:
        """Build the model (seeded, as ``write_initial_checkpoint`` does) and the tokenizer.

        Raises:
            UnknownPresetError: ``config.preset`` is not a preset.
        """
        self.config = config
        self.tokenizer = build_tokenizer()
        self.model = build_model(config.preset, seed=config.seed).train()
        self._sampler = sampler
        self._publisher = publisher
        self._on_step = on_step
        # Separate streams: how many problems measuring takes must not change what training sees.
        self._train_rng = random.Random(f"{config.seed}/train")
        self._eval_rng = random.Random(f"{config.seed}/eval")
        self._steps_done = 0

    async def run(self) -> TrainingSummary:
        """Run every SFT step, then every GRPO step; return the summary.

        Sets torch's intra-op threads to ``config.num_threads`` for the whole process.

        Raises:
            RolloutRequestError: sampling failed.
            PublishError: publishing failed (the servers may serve an older version).
        """
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
            for _ in range(count):
                report = await self._step(phase, optimizer)
                reports.append(report)
                if self._on_step is not None:
                    self._on_step(report)
        return TrainingSummary.of(reports, window=cfg.summary_window, wall_s=time.monotonic() - started)

    async def _step(self, phase: Phase, optimizer: torch.optim.Optimizer) -> StepReport:
        cfg = self.config
        step = self._steps_done + 1
        started = time.monotonic()
        update: _Update
        if phase is Phase.SFT:
            measured = [cfg.task.sample(self._eval_rng) for _ in range(cfg.sft_eval_prompts)]
            lesson = [cfg.task.sample(self._train_rng) for _ in range(cfg.sft_batch_size)]
            # Measuring and training overlap: the samples come from the weights already served.
            groups, update = await asyncio.gather(
                self._sample(measured), asyncio.to_thread(self._sft_update, lesson, optimizer)
            )
            scored = self._score(measured, groups)
        else:
            problems = [cfg.task.sample(self._train_rng) for _ in range(cfg.prompts_per_step)]
            groups = await self._sample(problems)
            scored = self._score(problems, groups)
            update = await asyncio.to_thread(self._grpo_update, scored, optimizer)
        self._steps_done = step
        publish = None
        if step % cfg.publish_every == 0 or step == cfg.total_steps:
            publish = await self._publisher.publish(self.model, self.tokenizer, step=step)
        samples = [s for group in scored for s in group]
        versions = [s.sample.weight_version for s in samples]
        rewards = [s.reward for s in samples]
        return StepReport(
            step=step,
            phase=phase,
            loss=update.loss,
            mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
            exact_rate=sum(s.exact for s in samples) / len(samples) if samples else 0.0,
            rewards_by_version=rewards_by_version(versions, rewards),
            num_samples=len(samples),
            num_interrupted=sum(len(g.samples) for g in groups) - len(samples),
            staleness=Staleness.of(versions, trainer_step=step - 1),
            num_flat_groups=0 if phase is Phase.SFT else sum(_flat(group) for group in scored),
            clip_fraction=update.clip_fraction,
            mean_ratio=update.mean_ratio,
            publish=publish,
            step_s=time.monotonic() - started,
        )

    async def _sample(self, problems: Sequence[Problem]) -> list[Group]:
        prompts = [encode_prompt(p, tokenizer=self.tokenizer) for p in problems]
        return await self._sampler.sample(
            prompts, group_size=self.config.group_size, max_new_tokens=self.config.max_new_tokens
        )

    def _score(self, problems: Sequence[Problem], groups: Sequence[Group]) -> list[list[_Scored]]:
        scored: list[list[_Scored]] = []
        for problem, group in zip(problems, groups, strict=True):
            kept: list[_Scored] = []
            for sample in group.samples:
                if sample.interrupted:
                    continue
                reward = score(problem, parse_completion(sample.output_ids, tokenizer=self.tokenizer))
                kept.append(_Scored(prompt_ids=group.prompt_ids, sample=sample, reward=reward, exact=reward == 1.0))
            scored.append(kept)
        return scored

    def _sft_update(self, problems: Sequence[Problem], optimizer: torch.optim.Optimizer) -> _Update:
        batch = pack(
            [encode_prompt(p, tokenizer=self.tokenizer) for p in problems],
            [encode_answer(p, tokenizer=self.tokenizer) for p in problems],
            pad_token_id=self.tokenizer.pad_token_id,
        )
        loss = sft_loss(self.model, batch)
        self._apply_gradients(loss, optimizer)
        return _Update(loss=float(loss.detach()))

    def _grpo_update(self, scored: Sequence[Sequence[_Scored]], optimizer: torch.optim.Optimizer) -> _Update:
        rows: list[_Scored] = []
        advantages: list[torch.Tensor] = []
        for group in scored:
            # A group cut below two samples by interruptions has no baseline to compare against.
            if len(group) < 2:
                continue
            rewards = torch.tensor([[s.reward for s in group]])
            advantages.append(group_advantages(rewards, eps=self.config.advantage_eps)[0])
            rows.extend(group)
        if not rows:
            return _Update(loss=0.0)
        batch = pack(
            [r.prompt_ids for r in rows],
            [r.sample.output_ids for r in rows],
            pad_token_id=self.tokenizer.pad_token_id,
        )
        server = torch.zeros(batch.completion_mask.shape)
        for row, item in enumerate(rows):
            server[row, : len(item.sample.logprobs)] = torch.tensor(item.sample.logprobs)
        result = clipped_policy_loss(
            logp_trainer=completion_logprobs(self.model, batch),
            logp_server=server,
            advantages=torch.cat(advantages),
            mask=batch.completion_mask,
            clip_eps=self.config.clip_eps,
        )
        self._apply_gradients(result.loss, optimizer)
        return _Update(
            loss=float(result.loss.detach()), clip_fraction=result.clip_fraction, mean_ratio=result.mean_ratio
        )

    def _apply_gradients(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        optimizer.step()


def _flat(group: Sequence[_Scored]) -> bool:
    return len(group) >= 2 and len({s.reward for s in group}) == 1

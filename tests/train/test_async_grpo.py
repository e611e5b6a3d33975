"""Asynchronous GRPO against a real controller and engines: the fleet generates the next steps'
samples while the trainer trains, every update is pushed, verified and committed, in-flight
generations continue across updates (retract), and no sample is staler than the bound."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from miles.config import UpdatePauseMode
from miles.controller.results import UpdateStatus
from miles.testing import running_controller
from miles.train import HttpSampler, Phase, Trainer, TrainerConfig, write_initial_checkpoint
from miles.train.config import LoopMode
from miles.train.push import PushPublisher

pytestmark = pytest.mark.timeout(240)

SMALL = dict(sft_batch_size=8, sft_eval_prompts=2, prompts_per_step=2, group_size=4, max_new_tokens=8)


async def test_async_grpo_overlaps_sampling_and_keeps_staleness_bounded(tmp_path: Path) -> None:
    config = TrainerConfig(**SMALL, sft_steps=1, grpo_steps=6, loop=LoopMode.ASYNC, max_staleness=1)
    initial = tmp_path / "step-0"
    write_initial_checkpoint(initial, config)
    results = []
    async with running_controller(
        model_checkpoint=initial, num_servers=2, default_pause_mode=UpdatePauseMode.RETRACT
    ) as (ctl, url):
        ctl.on_update(results.append)
        assert url is not None
        async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
            publisher = PushPublisher(ctl, model_name=config.model_name, timeout_s=60)
            try:
                trainer = Trainer(config, sampler=HttpSampler([url], http=http), publisher=publisher)
                summary = await trainer.run()
            finally:
                await publisher.close()
        servers = ctl.health().servers
    assert len(results) == 7 and all(r.status is UpdateStatus.COMMITTED for r in results)
    assert all(s.weight_version == "7" and s.checksum == summary.final_publish.checksum for s in servers)
    grpo = [s for s in summary.steps if s.phase is Phase.GRPO]
    assert len(grpo) == 6 and all(s.num_samples == 8 for s in grpo)
    # Nothing thrown away, nothing staler than the bound, and sampling did overlap training.
    assert summary.samples_dropped == 0
    assert summary.max_staleness <= 1 and all(s.staleness.min >= 0 for s in grpo)
    assert sum(sum(s.staleness.counts[1:]) for s in grpo) > 0
    trainer_idle, fleet_idle = summary.idle_fractions()
    assert 0.0 <= trainer_idle < 1.0 and 0.0 <= fleet_idle < 1.0

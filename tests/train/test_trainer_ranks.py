"""Two FSDP2 data-parallel trainer ranks (torchrun, gloo) on a scripted fleet: each trains its share
of every batch, rank 0 reports whole steps, and a rank whose share of a step leaves nothing to
learn from (every sample cut short) still takes part in the step's collectives instead of leaving
the other rank waiting in them."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from miles.rollout.engine_process import free_port

# Every rank: a Trainer on the tiny preset, FSDP2 data parallel, sampling from a fleet that answers
# on this rank (from version 3 on, rank 1's answers are all cut short by an update, so it has no
# row to train on), publishing nowhere. Rank 0 writes its summary to OUT/reports.json.
TRAINER = """
import asyncio, os, sys
import torch, torch.distributed as dist
from miles.train import Trainer, TrainerConfig
from miles.train.parallel import FSDP2DataParallel
from miles.train.publisher import PublishResult
from miles.train.sampling import Group, Sample

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()

class Fleet:
    published = 0
    async def sample(self, prompts, *, group_size, max_new_tokens, min_weight_version=None):
        version = str(self.published)
        cut = rank == 1 and self.published >= 3
        samples = tuple(
            Sample(output_ids=(5 + i, 6), logprobs=(-1.0, -2.0), weight_version=version,
                   weight_version_start=version, interrupted=cut)
            for i in range(group_size)
        )
        return [Group(prompt_ids=tuple(p), samples=samples) for p in prompts]

class Publisher:
    def __init__(self, fleet):
        self.fleet = fleet
    async def publish(self, model, tokenizer, *, step):
        self.fleet.published = step
        return PublishResult(step=step, weight_version=str(step), checksum="c", checkpoint_dir=None, path="none",
                             save_s=0.0, ready_wait_s=0.0, apply_s=0.0, latency_s=0.0)

fleet = Fleet()
config = TrainerConfig(sft_steps=2, grpo_steps=3, prompts_per_step=4, group_size=2, sft_batch_size=4,
                       sft_eval_prompts=2, summary_window=1)
parallel = FSDP2DataParallel(timeout_s=30)
trainer = Trainer(config, sampler=fleet, publisher=Publisher(fleet), parallel=parallel)
summary = asyncio.run(trainer.run())
if rank == 0:
    with open(os.path.join(out, "reports.json"), "w") as f:
        f.write(summary.model_dump_json())
dist.destroy_process_group()
"""


async def test_two_ranks_train_their_shares_and_a_rank_with_nothing_to_learn_still_steps(tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    torchrun = Path(sys.executable).parent / "torchrun"
    ranks = await asyncio.create_subprocess_exec(
        str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(script), str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        # TMPDIR: torchrun's agent leaves its error-file directory in the temp dir.
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    try:
        output, _ = await asyncio.wait_for(ranks.communicate(), timeout=180)
    finally:
        if ranks.returncode is None:
            ranks.kill()
            await ranks.wait()
    assert ranks.returncode == 0, output.decode()[-4000:]
    summary = json.loads((tmp_path / "reports.json").read_text())
    steps = summary["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    # SFT measures 1 prompt per rank; GRPO trains 2 prompts per rank, 2 samples each. From step 4
    # on, rank 1's samples are all cut short: rank 0's are the only ones trained.
    assert [s["num_samples"] for s in steps] == [4, 4, 8, 4, 4]
    assert [s["num_interrupted"] for s in steps] == [0, 0, 0, 4, 4]
    assert all(s["publish"]["weight_version"] == str(s["step"]) for s in steps)

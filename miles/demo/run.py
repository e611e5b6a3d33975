"""``miles demo``: train a tiny model with GRPO while a controller serves it to simulated users.

One process hosts the controller and its HTTP API, the trainer and the user traffic; the rollout
servers are real engine processes, and with ``trainer_ranks`` > 1 so are the trainer's FSDP2 ranks
(``TrainerRanks``), each publishing its own shards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator
from rich.console import Console

from miles.config import TransferPath, UpdatePauseMode, UpdateStrategy
from miles.controller.core import AsyncInferenceController
from miles.demo.display import LiveDisplay
from miles.demo.report import DemoSummary, UpdateRecord, write_report
from miles.demo.traffic import UserTraffic
from miles.http.runner import HttpServer
from miles.train.config import LoopMode, TrainerConfig
from miles.train.publisher import DiskPublisher, Publisher
from miles.train.push import PushPublisher
from miles.train.ranks import RankSpec, TrainerRanks
from miles.train.sampling import HttpSampler
from miles.train.trainer import Trainer, write_initial_checkpoint
from miles.utils.progress_bars import disable_library_progress_bars
from miles.weights.checkpoint import Manifest


class DemoConfig(BaseModel):
    """Everything ``miles demo`` can be told; defaults finish in a few minutes on 2 CPU cores."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sft_steps: Annotated[int, Field(ge=0)] = TrainerConfig().sft_steps
    grpo_steps: Annotated[int, Field(ge=0)] = TrainerConfig().grpo_steps
    servers: Annotated[int, Field(ge=1, le=8)] = 2
    strategy: UpdateStrategy = UpdateStrategy.BARRIER
    pause_mode: UpdatePauseMode = UpdatePauseMode.DRAIN
    publish_every: Annotated[int, Field(ge=1)] = 1
    users: Annotated[int, Field(ge=0)] = 2
    user_think_s: Annotated[float, Field(gt=0)] = 0.25
    seed: int = 0
    runs_dir: Path = Path("runs")
    live: bool = True
    # How the trainer's weights reach the servers: a checkpoint on disk, or pushed from memory
    # (auto: shared memory when every engine is on this machine, else torch.distributed).
    transfer: TransferPath = TransferPath.AUTO
    # GRPO's loop: sync, or async (sampling the next steps while training, staleness bounded).
    loop: LoopMode = LoopMode.SYNC
    max_staleness: Annotated[int, Field(ge=0, le=16)] = TrainerConfig().max_staleness
    # The servers on the Ray cluster this process is connected to (``miles demo --ray`` starts a
    # local one of two nodes), not as child processes.
    ray: bool = False
    # The rollout servers' type, by short name: the embedded engine, or real vLLM servers.
    server_cls: Literal["SFTRollout", "VLLMRollout"] = "SFTRollout"
    # The model trained and served; default: the ``tiny`` preset, ``small`` on vLLM (whose CPU
    # attention refuses tiny's head size).
    preset: str | None = None
    # Trainer processes: 1 trains in this process; N > 1 starts N FSDP2 ranks over gloo.
    trainer_ranks: Annotated[int, Field(ge=1, le=8)] = 1

    @model_validator(mode="after")
    def _ranks_can_train(self) -> DemoConfig:
        if self.trainer_ranks == 1:
            return self
        if self.transfer is TransferPath.DISK:
            raise ValueError(
                "--trainer-ranks above 1 publishes each rank's own shards from memory, and --transfer disk writes "
                "one checkpoint from one process: use --transfer auto, shm or distributed, or --trainer-ranks 1"
            )
        if self.loop is LoopMode.ASYNC:
            raise ValueError(
                "--async publishes from a copy of the whole model, which ranks that each hold a shard of it do "
                "not make: drop --async, or use --trainer-ranks 1"
            )
        return self

    @property
    def trainer_description(self) -> str:
        """Who trains, as the summary says it."""
        return "in this process" if self.trainer_ranks == 1 else f"{self.trainer_ranks} FSDP2 ranks (gloo)"

    @property
    def model_preset(self) -> str:
        if self.preset is not None:
            return self.preset
        return "small" if self.server_cls == "VLLMRollout" else TrainerConfig().preset


def _run_dir(root: Path) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = root / stamp
    suffix = 1
    while run_dir.exists():
        suffix += 1
        run_dir = root / f"{stamp}-{suffix}"
    run_dir.mkdir(parents=True)
    latest = root / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    latest.symlink_to(run_dir.name)
    return run_dir.resolve()


# One engine per (logical) GPU, spread over the nodes; a fraction of a CPU each, since the nodes'
# CPUs are the same two cores.
_RAY_PLACEMENT: dict[str, Any] = {
    "runtime": "ray",
    "num_gpus_per_engine": 1,
    "num_cpus_per_engine": 0.25,
    "placement_strategy": "SPREAD",
}


def _servers(config: DemoConfig, checkpoint: Path, model_name: str) -> dict[str, Any]:
    """The controller's servers, of the demo's type, on ``checkpoint``. vLLM's run eagerly: on a
    few cores torch.compile's warm-up is most of a start, and a recompile can stall a worker past
    its health checks."""
    if config.server_cls != "VLLMRollout":
        return {"rollout_server_cls": config.server_cls, "model_checkpoint": checkpoint, "num_servers": config.servers}
    spec = {
        "cls": "VLLMRollout",
        "checkpoint": checkpoint,
        "num_servers": config.servers,
        "engine_args": ["--enforce-eager"],
    }
    return {"rollout_server_cls": {model_name: spec}}


async def run_demo(config: DemoConfig, *, console: Console) -> DemoSummary:
    """Run the whole demo and write its run directory; returns the summary."""
    run_dir = await asyncio.to_thread(_run_dir, config.runs_dir)
    checkpoints, events_dir = run_dir / "checkpoints", run_dir / "events"
    trainer_config = TrainerConfig(
        preset=config.model_preset,
        model_name=f"{config.model_preset}-reverse",
        sft_steps=config.sft_steps,
        grpo_steps=config.grpo_steps,
        publish_every=config.publish_every,
        seed=config.seed,
        loop=config.loop,
        max_staleness=config.max_staleness,
        summary_window=max(1, min(10, (config.sft_steps + config.grpo_steps) // 10)),
    )
    console.print(f"run directory: {run_dir}")
    initial: Manifest = await asyncio.to_thread(write_initial_checkpoint, checkpoints / "step-000000", trainer_config)
    t0 = time.monotonic()
    updates: list[UpdateRecord] = []
    controller = AsyncInferenceController(
        **_servers(config, checkpoints / "step-000000", trainer_config.model_name),
        port=0,
        seed=config.seed,
        events_dir=events_dir,
        log_dir=run_dir / "logs",
        allowed_checkpoint_roots=(checkpoints,),
        default_strategy=config.strategy,
        default_pause_mode=config.pause_mode,
        health_interval_s=1.0,
        **(_RAY_PLACEMENT if config.ray else {}),
    )
    controller.on_update(lambda result: updates.append(UpdateRecord(at=time.monotonic() - t0, result=result)))
    display = LiveDisplay(console, total_steps=trainer_config.total_steps, controller=controller, live=config.live)
    # Closed in the reverse order: the users, their client, the HTTP API, the controller.
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(controller.close)
        console.print(f"starting {config.servers} {config.server_cls} servers on {initial.model_name} step 0 ...")
        await controller.start()
        if config.ray:
            for server in controller.health().servers:
                node = (server.node_id or "?")[:8]
                console.print(f"  {server.server_id}: Ray node {node} at {server.node_address}, GPU {server.gpu_ids}")
        http_server = HttpServer(controller)
        await http_server.start()
        stack.push_async_callback(http_server.stop)
        url = http_server.url
        console.print(
            f"controller at {url}; training {trainer_config.sft_steps} SFT + {trainer_config.grpo_steps} GRPO steps"
            + (f" (async, max staleness {config.max_staleness})" if config.loop is LoopMode.ASYNC else "")
            + (f" on {config.trainer_description}" if config.trainer_ranks > 1 else "")
        )
        console.print(f"status page: {url}/ (open it in a browser while the demo runs)")
        display.link(f"{url}/")
        # The demo's own clients present the controller's credential when one is configured.
        token = controller.settings.api_key or controller.settings.admin_token
        headers = {"authorization": f"Bearer {token.get_secret_value()}"} if token else None
        http = await stack.enter_async_context(httpx.AsyncClient(trust_env=False, timeout=300.0, headers=headers))
        traffic = UserTraffic(
            url, clients=config.users, think_s=config.user_think_s, t0=t0, seed=config.seed, headers=headers
        )
        stack.push_async_callback(traffic.stop)
        display.attach_traffic(traffic.stats)
        trainer: Trainer | TrainerRanks
        if config.trainer_ranks > 1:
            trainer = TrainerRanks(
                RankSpec(trainer=trainer_config, controller_url=url, transfer=config.transfer),
                world_size=config.trainer_ranks,
                log_dir=run_dir / "logs",
                on_step=display.step,
            )
        else:
            trainer = Trainer(
                trainer_config,
                sampler=HttpSampler([url], http=http, timeout_s=300.0),
                publisher=_publisher(config, trainer_config, controller, http=http, url=url, checkpoints=checkpoints),
                on_step=display.step,
            )
        traffic.start()
        with display:
            training = await trainer.run()
    # Reading the event log back and writing the report: files, off the loop.
    summary = await asyncio.to_thread(
        write_report,
        run_dir,
        training=training,
        updates=updates,
        traffic=traffic.stats,
        events_dir=events_dir,
        servers=config.servers,
        server_cls=config.server_cls,
        strategy=config.strategy.value,
        pause_mode=config.pause_mode.value,
        wall_s=time.monotonic() - t0,
        loop=config.loop.value,
        trainer=config.trainer_description,
    )
    display.final(summary)
    return summary


def _publisher(
    config: DemoConfig,
    trainer_config: TrainerConfig,
    controller: AsyncInferenceController,
    *,
    http: httpx.AsyncClient,
    url: str,
    checkpoints: Path,
) -> Publisher:
    """How the in-process trainer publishes: a checkpoint per step (``--transfer disk``), or
    pushed from memory through a window (the same checksum gate)."""
    if config.transfer is not TransferPath.DISK:
        return PushPublisher(controller, model_name=trainer_config.model_name, path=config.transfer)

    async def ready() -> bool:
        # The seed's discipline: poll /health before pushing a checkpoint.
        return (await http.get(f"{url}/health")).status_code == 200

    async def apply(checkpoint_dir: Path, manifest: Manifest) -> None:
        result = await controller.update_rollout_weights(checkpoint_dir)
        result.raise_for_status()

    return DiskPublisher(
        checkpoints,
        model_name=trainer_config.model_name,
        event_logger=controller.event_logger,
        apply=apply,
        ready=ready,
    )


def quiet_logs() -> None:
    """Keep the live display readable: only warnings from libraries and our own loggers."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "miles.rollout", "miles.controller", "miles.events"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # save_pretrained draws a progress bar per checkpoint; hundreds of them would bury the view.
    disable_library_progress_bars()

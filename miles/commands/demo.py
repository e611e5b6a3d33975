"""``miles demo``: train a tiny model with GRPO while a fleet serves it, every update verified."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
import uvloop
from rich.console import Console

from miles.config import TransferPath, UpdatePauseMode, UpdateStrategy


class DemoServer(StrEnum):
    """The rollout servers ``miles demo`` can run (SGLang's need a GPU: ``miles serve`` runs them)."""

    EMBEDDED = "SFTRollout"
    VLLM = "VLLMRollout"


@contextmanager
def _local_ray_cluster(servers: int, console: Console) -> Iterator[None]:
    """A head and one worker node on this machine (on loopback), each with logical GPUs for half
    the servers; this process connected to it. Started on the main thread, as Ray requires."""
    from miles.ray.cluster import NodeSpec, connect, local_cluster

    gpus = -(-servers // 2)
    console.print(f"starting a local Ray cluster of two nodes with {gpus} logical GPU(s) each ...")
    with local_cluster([NodeSpec(num_cpus=2, num_gpus=gpus)], head=NodeSpec(num_cpus=2, num_gpus=gpus)) as cluster:
        connect(cluster.address)
        yield


def demo(
    steps: Annotated[int | None, typer.Option(help="GRPO steps (default: the trainer's).")] = None,
    sft_steps: Annotated[int | None, typer.Option(help="SFT warm-up steps (default: the trainer's).")] = None,
    servers: Annotated[int, typer.Option(help="Rollout servers (engine processes).")] = 2,
    strategy: Annotated[
        UpdateStrategy, typer.Option(help="How updates move through the fleet.")
    ] = UpdateStrategy.BARRIER,
    pause_mode: Annotated[
        UpdatePauseMode | None,
        typer.Option(
            help="What updates do to running requests (default: drain; retract with --async, so generations "
            "in flight continue on the new weights)."
        ),
    ] = None,
    publish_every: Annotated[int, typer.Option(help="Publish weights after every N trainer steps.")] = 1,
    users: Annotated[int, typer.Option(help="Simulated users sending requests meanwhile.")] = 2,
    seed: Annotated[int, typer.Option(help="Seeds the model, the task and the users.")] = 0,
    runs_dir: Annotated[Path, typer.Option(help="Where run directories go (and runs/latest).")] = Path("runs"),
    live: Annotated[bool, typer.Option(help="Live terminal view (off: a line every 25 steps).")] = True,
    transfer: Annotated[
        TransferPath,
        typer.Option(
            help="How weights reach the servers: auto (pushed from memory: shared memory on one machine, "
            "torch.distributed across machines), shm, distributed, or disk (a checkpoint per step)."
        ),
    ] = TransferPath.AUTO,
    async_loop: Annotated[
        bool,
        typer.Option(
            "--async", help="Asynchronous GRPO: the fleet generates the next steps' samples while the trainer trains."
        ),
    ] = False,
    max_staleness: Annotated[
        int | None,
        typer.Option(help="With --async: how many versions a sample may be behind the weights it trains (default 1)."),
    ] = None,
    ray: Annotated[
        bool, typer.Option("--ray", help="Run the servers on a local Ray cluster of two nodes (one engine per GPU).")
    ] = False,
    server_cls: Annotated[
        DemoServer,
        typer.Option(
            help="The rollout servers: miles' embedded engine (SFTRollout), or real vLLM servers (VLLMRollout, "
            "installed by `make vllm`; the model is then the small preset)."
        ),
    ] = DemoServer.EMBEDDED,
    preset: Annotated[
        str | None, typer.Option(help="The model preset trained and served (default: tiny; small on vLLM).")
    ] = None,
    trainer_ranks: Annotated[
        int,
        typer.Option(
            help="Trainer processes: 1 trains in this process; N > 1 starts N FSDP2 ranks over gloo, each training "
            "its share of every batch and publishing its own shards (ShardedPublisher; not with --transfer disk "
            "or --async)."
        ),
    ] = 1,
) -> None:
    """Train while serving: a controller, 2 rollout servers, a GRPO trainer and user traffic.

    With --trainer-ranks 2 the trainer is two FSDP2 rank processes (gloo), started and ended here.

    Exits 1 if any user request failed, any checksum mismatched, or the event audit found a problem.
    """
    from miles.demo.run import DemoConfig, quiet_logs, run_demo
    from miles.train.config import LoopMode

    quiet_logs()
    console = Console()
    # Options left out keep DemoConfig's defaults.
    optional = {"grpo_steps": steps, "sft_steps": sft_steps, "max_staleness": max_staleness}
    config = DemoConfig(
        **{name: value for name, value in optional.items() if value is not None},
        servers=servers,
        strategy=strategy,
        pause_mode=pause_mode or (UpdatePauseMode.RETRACT if async_loop else UpdatePauseMode.DRAIN),
        loop=LoopMode.ASYNC if async_loop else LoopMode.SYNC,
        publish_every=publish_every,
        users=users,
        seed=seed,
        runs_dir=runs_dir,
        live=live and sys.stdout.isatty(),
        ray=ray,
        transfer=transfer,
        server_cls=server_cls.value,
        preset=preset,
        trainer_ranks=trainer_ranks,
    )
    with _local_ray_cluster(servers, console) if ray else contextlib.nullcontext():
        summary = uvloop.run(run_demo(config, console=console))
    raise typer.Exit(0 if summary.passed else 1)

"""Weight sync: from "checkpoint published" to "every server serves it, checksum verified".

For a ~500M-parameter bf16 model built from config, with 1 and 2 servers, side by side in one run:

- miles: ``update_rollout_weights`` through the controller (validate, stage and verify beside the
  live weights, pause, swap, confirm checksums, admit), page cache warm (the trainer just wrote
  the checkpoint);
- the memory-copy floor: bytes x servers at the memcpy bandwidth measured in this run;
- restarting the server processes on the new checkpoint until each answers a generation (what a
  naive integration does; a generation, not /health, so weights mapped lazily are counted);
- plain ``AutoModelForCausalLM.from_pretrained`` of the checkpoint in this process.

    .venv/bin/python benchmarks/weight_sync.py [--preset 500m] [--repeats 3] [--servers 1 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
import transformers

from miles.models.presets import get_preset, init_checkpoint
from miles.rollout.engine_process import EngineProcess, engine_command, free_port
from miles.testing import running_controller
from miles.utils.progress_bars import disable_library_progress_bars
from miles.weights.checkpoint import read_manifest


def memcpy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of a plain tensor copy of ``num_bytes`` (best of ``repeats``)."""
    source = torch.empty(num_bytes, dtype=torch.uint8)
    source.random_()
    target = torch.empty_like(source)
    target.copy_(source)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return num_bytes / best


async def restart_time(checkpoint: Path, servers: int, log_dir: Path, threads: int) -> float:
    """Start ``servers`` fresh engines on ``checkpoint`` until each answers a generation."""
    started = time.perf_counter()
    processes = []
    async with httpx.AsyncClient(trust_env=False) as http:
        try:
            waits = []
            for i in range(servers):
                port = free_port()
                process = EngineProcess(
                    command=engine_command(checkpoint, port=port, num_threads=threads),
                    log_path=log_dir / f"restart-{i}-{port}.log",
                )
                process.start()
                processes.append(process)
                waits.append(first_answer(process, f"http://127.0.0.1:{port}", http))
            await asyncio.gather(*waits)
            return time.perf_counter() - started
        finally:
            for process in processes:
                process.kill()


async def first_answer(process: EngineProcess, url: str, http: httpx.AsyncClient) -> None:
    """Once the engine at ``url`` is healthy, its first generated token."""
    await process.wait_healthy(url, timeout_s=600, http=http)
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    answer = await http.post(f"{url}/generate", json=body, timeout=600)
    answer.raise_for_status()


def from_pretrained_time(checkpoint: Path) -> float:
    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype="auto")
    elapsed = time.perf_counter() - started
    del model
    return elapsed


# What an engine reports for a load: verified and staged beside the live weights, then swapped
# (or, without staging, verified then copied in place).
ENGINE_PHASES = ("open", "verify", "match", "stage_open", "stage_write", "copy_and_checksum", "pause", "activate")


async def sync_times(
    root: Path, servers: int, repeats: int, threads: int
) -> tuple[list[float], list[dict[str, float]]]:
    times, breakdowns = [], []
    specs = {"bench": {"checkpoint": root / "a", "num_servers": servers, "num_threads": threads}}
    async with running_controller(specs, http=False, health_interval_s=5.0) as (controller, _):
        for i in range(repeats + 1):
            target = root / ("b" if i % 2 == 0 else "a")
            # Read the files once, as the trainer that just wrote them would have left them cached.
            for path in target.glob("*.safetensors"):
                path.read_bytes()
            started = time.perf_counter()
            result = await controller.update_rollout_weights(target, weight_version=str(10 + i))
            elapsed = time.perf_counter() - started
            assert result.ok, result.message
            if i == 0:
                continue  # the first load also faults in the engines' fresh pages
            times.append(elapsed)
            phase = dict(result.timings)
            engine = [o.load_timings for o in result.servers]
            for key in ENGINE_PHASES:
                phase[f"engine_{key}"] = max(t.get(key, 0.0) for t in engine)
            breakdowns.append(phase)
    return times, breakdowns


async def main(args: argparse.Namespace) -> None:
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="miles-bench-sync-") as tmp:
        root = Path(tmp)
        built = time.perf_counter()
        for name, seed in (("a", 0), ("b", 1)):
            init_checkpoint(root / name, model_name="bench", preset=args.preset, seed=seed, step=1)
        manifest = read_manifest(root / "b")
        params = get_preset(args.preset).num_parameters()
        print(
            f"model: preset {args.preset}, {params / 1e6:.0f}M parameters, {manifest.num_bytes / 1e9:.2f} GB "
            f"({time.perf_counter() - built:.0f}s to build two checkpoints)"
        )
        bandwidth = memcpy_bandwidth(manifest.num_bytes, repeats=5)
        print(f"memcpy bandwidth: {bandwidth / 1e9:.1f} GB/s")
        loaded = statistics.median(from_pretrained_time(root / "b") for _ in range(args.repeats))
        rows = []
        for servers in args.servers:
            times, phases = await sync_times(root, servers, args.repeats, max(1, args.threads // servers))
            restart = statistics.median(
                [
                    await restart_time(root / "b", servers, root / "logs", max(1, args.threads // servers))
                    for _ in range(2)
                ]
            )
            floor = manifest.num_bytes * servers / bandwidth
            rows.append((servers, statistics.median(times), floor, restart, phases))

    print()
    print(
        f"{'servers':>7} {'miles s':>9} {'floor s':>9} {'x floor':>8} {'restart s':>10} {'restart/miles':>14} "
        f"{'from_pretrained s':>18}"
    )
    for servers, sync, floor, restart, _ in rows:
        print(
            f"{servers:>7} {sync:>9.3f} {floor:>9.3f} {sync / floor:>8.2f} {restart:>10.2f} {restart / sync:>14.1f} "
            f"{loaded:>18.2f}"
        )
    print()
    print("where the time goes (median seconds; engine phases are the slowest server's):")
    keys = ["lock_wait", "validate", "transaction", *(f"engine_{k}" for k in ENGINE_PHASES)]
    print(f"{'servers':>7} " + " ".join(f"{k.removeprefix('engine_'):>17}" for k in keys) + f" {'protocol':>9}")
    for servers, sync, _, _, phases in rows:
        med = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in keys}
        engine = sum(med[f"engine_{k}"] for k in ENGINE_PHASES)
        protocol = sync - med["validate"] - engine
        print(f"{servers:>7} " + " ".join(f"{med[k]:>17.3f}" for k in keys) + f" {protocol:>9.3f}")
    print()
    print("targets: miles within 2x of the floor; restart (to the first generation) at least 10x slower than miles")


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="500m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=2)
    asyncio.run(main(parser.parse_args()))

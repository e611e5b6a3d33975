"""Weights pushed from the trainer's memory, each path next to its own floor, in one run.

On one preset (default the ~500M bfloat16 one), with 1 and then 2 engines behind a controller:
- shared memory (``PushPublisher(path="shm")``) vs the memory-copy floor: the bytes times the
  engines divided by this machine's memcpy bandwidth (measured in this run); from tensors of the
  trainer's own (copied into the push's segment) and from a model whose weights the publisher moved
  into shared memory (``share_memory``: the engines read them where they lie);
- torch.distributed, gloo (``path="distributed"``) vs a bare gloo broadcast of the same bytes
  from this process to as many helper processes as engines (measured in this run);
- each path against its verified floor too: the same floor plus one hash pass over the bytes by
  the sender and by each engine (the digest's own rate, measured in this run), the least a
  transfer that verifies what it moves does;
- the calls each update made per engine (constant in the number of tensors);
- the time generation was blocked per update (what each engine waited for and held its weights'
  write lock for, reported by the engine), with requests in flight;
- a delta push with 10% of the tensors changed vs a full push: bytes moved and time;
- where each path's transfer went: the sender's packing, group forming, broadcasts and waits
  for the engines' answers, and what the engines reported spending on each phase.
Each path's transfer is measured alone (no requests, the engines' background write-out of the
push before done), as its floor is, and then with requests in flight. Every push is a whole
verified update: window, transfer, per-tensor digests, the engines'
checksum of their live weights, the controller's commit.

    .venv/bin/python benchmarks/transfer.py [--preset 500m] [--engines 1 2] [--repeats 3]
        [--loaded-repeats N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from miles.models.presets import init_checkpoint
from miles.rollout.engine_process import free_port
from miles.testing import running_controller
from miles.train.engine_calls import PushStats
from miles.train.push import PushPublisher
from miles.utils.progress_bars import disable_library_progress_bars
from miles.weights.checksum import saved_state_dict
from miles.weights.digest import digest_buffer

# Seconds between two pushes measured alone (see ``one_fleet``).
QUIET_GAP_S = 4.0


def memcpy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of one in-process copy of ``nbytes`` (the best of ``repeats``)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return nbytes / best


def hash_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of one pass of the weights' digest (xxh3 over 256 KiB chunks, one
    thread) over ``nbytes`` in memory (the best of ``repeats``)."""
    data = torch.ones(nbytes, dtype=torch.uint8).numpy()
    best = min(_timed(lambda: digest_buffer(data)) for _ in range(repeats))
    return nbytes / best


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


def _timed(job: Any) -> float:
    started = time.perf_counter()
    job()
    return time.perf_counter() - started


RECEIVER = textwrap.dedent(
    """
    import sys, datetime, torch, torch.distributed as dist
    port, rank, world, nbytes, repeats = map(int, sys.argv[1:6])
    timeout = datetime.timedelta(seconds=300)
    store = dist.PrefixStore("bare", dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout))
    group = dist.ProcessGroupGloo(store, rank, world, timeout)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats):
        group.broadcast(flat, 0).wait()
    # Torn down before the interpreter exits: a group whose threads are still running when the
    # process ends aborts it ("terminate called without an active exception").
    del group, store
    """
)


def bare_gloo_broadcast(nbytes: int, receivers: int, repeats: int) -> float:
    """Seconds of one gloo broadcast of ``nbytes`` from this process to ``receivers`` processes."""
    port, world = free_port(), receivers + 1
    timeout = timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, wait_for_workers=False)
    helpers = [
        subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(r), str(world), str(nbytes), str(repeats)])
        for r in range(1, world)
    ]
    try:
        group = dist.ProcessGroupGloo(dist.PrefixStore("bare", store), 0, world, timeout)
        flat = torch.ones(nbytes, dtype=torch.uint8)
        times = [_timed(lambda: group.broadcast(flat, 0).wait()) for _ in range(repeats)]
        for helper in helpers:
            helper.wait(timeout=300)
    finally:
        for helper in helpers:
            if helper.poll() is None:
                helper.kill()
                helper.wait()
    return min(times)


def perturbed(named: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of the weights with ``fraction`` of the tensors (by count) changed."""
    generator = torch.Generator().manual_seed(seed)
    names = list(named)
    chosen = set(names[: max(1, round(len(names) * fraction))]) if fraction < 1 else set(names)
    out = {}
    for name, tensor in named.items():
        if name in chosen and tensor.is_floating_point():
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * 1e-3
            out[name] = (tensor.float() + noise).to(tensor.dtype)
        else:
            out[name] = tensor
    return out


async def traffic(url: str, stop: asyncio.Event) -> int:
    """Requests kept in flight during the pushes; returns how many were served."""
    served = 0
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    async with httpx.AsyncClient(trust_env=False, timeout=600) as http:
        while not stop.is_set():
            if (await http.post(f"{url}/generate", json=body)).status_code == 200:
                served += 1
    return served


def push_phases(sender: dict[str, float], engine: list[dict[str, float]], engines: int) -> dict[str, float]:
    """The sender's phases of one push, and each engine's phases summed over its calls (mean of
    the engines), prefixed ``engine_``."""
    phases = {k: v for k, v in sender.items() if k in ("pack", "join", "broadcast", "engines")}
    for timings in engine:
        for key, seconds in timings.items():
            phases[f"engine_{key}"] = phases.get(f"engine_{key}", 0.0) + seconds / engines
    return phases


def blocked_s(bucket_timings: list[dict[str, float]], activations: list[dict[str, float]], engines: int) -> list[float]:
    """The time one update kept each engine's generation from running: its scheduler thread, between
    two steps, checks the swap, waits for the write side of the weights lock (while an export or a
    checksum reads the weights), swaps a staged update in and releases the lock (``generation_held``);
    or, in place, does that for every bucket's copy and checksum. (Engines that do not report
    ``generation_held``: the lock's wait and the swap.)"""

    def held(t: dict[str, float], *, work: float) -> float:
        return t.get("generation_held", t.get("write_lock_wait", 0.0) + work)

    swaps = [held(t, work=t["activate"]) for t in activations if "activate" in t]
    if swaps:
        return swaps
    in_place = sum(held(t, work=t.get("copy", 0.0) + t.get("checksum", 0.0)) for t in bucket_timings)
    return [in_place / engines] * engines


async def one_fleet(
    args: argparse.Namespace, checkpoint: Path, named: dict[str, torch.Tensor], engines: int
) -> dict[str, Any]:
    total_bytes = sum(t.numel() * t.element_size() for t in named.values())
    figures: dict[str, Any] = {"engines": engines, "bytes": total_bytes, "tensors": len(named)}
    async with running_controller(
        model_checkpoint=checkpoint, num_servers=engines, update_timeout_s=1800, request_timeout_s=1800
    ) as (controller, url):
        assert url is not None
        step = 1000
        # A model whose weights the publisher moved into shared memory: what the engines read
        # where it lies; each push first writes the step's weights into it, as training would.
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        for variant in ("shm", "shm_shared", "distributed"):
            path = "distributed" if variant == "distributed" else "shm"
            publisher = PushPublisher(controller, path=path, delta=False, timeout_s=600, ttl_s=1800)
            shared = variant == "shm_shared"
            if shared:
                publisher.share_memory(model)

            async def one_push(
                step: int, publisher: PushPublisher = publisher, shared: bool = shared
            ) -> tuple[float, PushStats]:
                weights = perturbed(named, 1.0, seed=step)
                if shared:
                    with torch.no_grad():
                        for name, tensor in saved_state_dict(model).items():
                            tensor.copy_(weights[name])
                    weights = saved_state_dict(model)
                started = time.perf_counter()
                await publisher.push(weights, step=step)
                assert publisher.last is not None
                return time.perf_counter() - started, publisher.last

            # Alone, as the floors run: no requests, and each push once the engines' background
            # write-out of the one before (about 2 s for this preset here) is done.
            quiet: list[float] = []
            for _ in range(args.repeats + 1):
                step += 1
                await asyncio.sleep(QUIET_GAP_S)
                quiet.append((await one_push(step))[1].timings["push"])
            quiet = quiet[1:]  # the first push allocates what the next ones reuse
            times, transfers, blocked, calls = [], [], [], []
            phases: list[dict[str, float]] = []
            stop = asyncio.Event()
            users = asyncio.create_task(traffic(url, stop))
            try:
                for _ in range(args.loaded_repeats or args.repeats):
                    step += 1
                    took, last = await one_push(step)
                    times.append(took)
                    transfers.append(last.timings["push"])
                    result = controller.last_update
                    assert result is not None
                    activations = [o.load_timings for o in result.servers]
                    blocked += blocked_s(last.engine_timings, activations, engines)
                    calls.append(last.calls // engines)
                    phases.append(push_phases(last.timings, last.engine_timings, engines))
            finally:
                stop.set()
                served = await users
                await publisher.close()
            figures[variant] = {
                "quiet_transfer_s": statistics.median(quiet),
                "update_s": statistics.median(times),
                "transfer_s": statistics.median(transfers),
                "calls_per_engine": calls[-1],
                "blocked_p50_ms": statistics.median(blocked) * 1e3,
                "blocked_p99_ms": _p99(blocked) * 1e3,
                "blocked_max_ms": max(blocked) * 1e3,
                "swaps": len(blocked),
                "requests_served_meanwhile": served,
                # Where the transfer's time went (medians, seconds): the sender's phases summed over
                # buckets, and each engine's (as it reported them) summed over its calls.
                "phases_s": {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[-1]},
            }
        # Delta: 10% of the tensors changed, against a push where every tensor changed, both
        # whole updates through the same warmed-up delta publisher, each alone (as the floors run:
        # once the engines' background write-out of the push before is done).
        publisher = PushPublisher(controller, path="shm", delta=True, timeout_s=600, ttl_s=1800)
        try:
            step += 1
            await publisher.push(perturbed(named, 1.0, seed=step), step=step)  # warm-up
            step += 1
            base = perturbed(named, 1.0, seed=step)
            await asyncio.sleep(QUIET_GAP_S)
            started = time.perf_counter()
            await publisher.push(base, step=step)
            full_s, full_bytes = time.perf_counter() - started, publisher.last.bytes  # type: ignore[union-attr]
            full_transfer_s = publisher.last.timings["open"] + publisher.last.timings["push"]  # type: ignore[union-attr]
            # Training that changes the same tenth of the tensors every step: the first delta after
            # a full push also copies back what that push changed; from the next one on, only
            # what changes moves (measured there).
            step += 1
            await publisher.push(perturbed(base, 0.1, seed=step), step=step)
            step += 1
            changed = perturbed(base, 0.1, seed=step)
            await asyncio.sleep(QUIET_GAP_S)
            started = time.perf_counter()
            await publisher.push(changed, step=step)
            delta_s = time.perf_counter() - started
            assert publisher.last is not None
            figures["delta"] = {
                "full_bytes": full_bytes,
                "delta_bytes": publisher.last.bytes,
                "full_update_s": full_s,
                "delta_update_s": delta_s,
                # Finding what changed (hashing every tensor) and sending it, without the commit.
                "full_transfer_s": full_transfer_s,
                "delta_transfer_s": publisher.last.timings["open"] + publisher.last.timings["push"],
                "tensors_sent": publisher.last.tensors,
                "tensors_skipped": publisher.last.skipped,
            }
        finally:
            await publisher.close()
    figures["memcpy_floor_s"] = total_bytes * engines / memcpy_bandwidth(total_bytes)
    # What verifying adds at the least: one hash pass over the bytes on each side, the sender
    # and every engine (each on its own core, at best).
    figures["hash_s"] = total_bytes / hash_bandwidth(total_bytes)
    figures["gloo_floor_s"] = bare_gloo_broadcast(total_bytes, engines, repeats=args.repeats)
    return figures


def report(results: list[dict[str, Any]]) -> None:
    for r in results:
        gib = r["bytes"] / 2**30
        print(f"\n{r['engines']} engine(s), {r['tensors']} tensors, {gib:.2f} GiB per push")
        memcpy, gloo_floor = r["memcpy_floor_s"], r["gloo_floor_s"]
        hashed = r["hash_s"] * (1 + r["engines"])
        print(
            f"  floors: memcpy {memcpy:.3f} s, bare gloo broadcast {gloo_floor:.3f} s; one hash pass "
            f"{r['hash_s']:.3f} s, so verified (plus a hash by the sender and by each engine): memcpy "
            f"{memcpy + hashed:.3f} s, gloo {gloo_floor + hashed:.3f} s"
        )
        for name, label in (
            ("shm", "shared memory"),
            ("shm_shared", "shared memory, shared weights"),
            ("distributed", "gloo"),
        ):
            f = r[name]
            if name == "distributed":
                alone, loaded = gloo_floor / f["quiet_transfer_s"], gloo_floor / f["transfer_s"]
                verified = f["quiet_transfer_s"] / (gloo_floor + hashed)
                ratio = f"floor/transfer {alone:.2f}x alone, {loaded:.2f}x loaded; x verified floor {verified:.2f}"
            else:
                alone, loaded = f["quiet_transfer_s"] / memcpy, f["transfer_s"] / memcpy
                verified = f["quiet_transfer_s"] / (memcpy + hashed)
                ratio = f"transfer/floor {alone:.2f}x alone, {loaded:.2f}x loaded; x verified floor {verified:.2f}"
            print(
                f"  {label:30s} transfer {f['quiet_transfer_s']:.3f} s alone, {f['transfer_s']:.3f} s with requests "
                f"(whole update {f['update_s']:.3f} s)  {ratio}  calls/engine {f['calls_per_engine']}"
            )
            print(
                f"    blocked per update ({f['swaps']} engine updates): p50 {f['blocked_p50_ms']:.2f} ms, "
                f"p99 {f['blocked_p99_ms']:.2f} ms, max {f['blocked_max_ms']:.2f} ms; "
                f"requests served meanwhile {f['requests_served_meanwhile']}"
            )
            print(
                "    where the loaded transfer went (s): " + ", ".join(f"{k} {v:.3f}" for k, v in f["phases_s"].items())
            )
        d = r["delta"]
        print(
            f"  delta (10% of tensors): {d['delta_bytes'] / 2**20:.1f} MiB vs {d['full_bytes'] / 2**20:.1f} MiB, "
            f"whole update {d['delta_update_s']:.3f} s vs {d['full_update_s']:.3f} s, "
            f"of which finding and sending the changes {d['delta_transfer_s']:.3f} s vs {d['full_transfer_s']:.3f} s "
            f"({d['tensors_sent']} sent, {d['tensors_skipped']} unchanged)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="500m")
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--loaded-repeats",
        type=int,
        default=0,
        help="pushes per path with requests in flight, back to back (default: --repeats); more give the "
        "blocked time's tail",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="miles-bench-transfer-") as tmp:
        checkpoint = Path(tmp) / "model"
        init_checkpoint(checkpoint, model_name="bench", preset=args.preset, seed=0, step=1)
        named = {n: t.detach() for n, t in saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoint)).items()}
        results = [asyncio.run(one_fleet(args, checkpoint, named, engines)) for engines in args.engines]
    report(results)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    main()

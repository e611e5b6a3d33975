"""A sharded trainer publishes: its ranks push their own shards, or rank 0 gathers and pushes.

Two ranks (gloo on CPU, started here with ``torch.multiprocessing``) hold a preset (default the
~500M bfloat16 one) sharded by FSDP2 (``fully_shard`` per decoder layer and on the model) and
publish it into 1 and then 2 engines behind a controller, two ways, in turn:
- sharded: ``ShardedPublisher.publish`` on every rank (each rank writes its rows into the push's
  shared-memory buckets and hashes them; collectives per bucket, not per tensor);
- naive: every parameter ``full_tensor()``-gathered (one all-gather per tensor, as FSDP2 offers
  it), then rank 0 pushes the full state dict with ``PushPublisher.push`` and tells rank 1 how it
  ended.
Both ways publish the same weights after each simulated step and must publish the same checksum.
Per publish and rank:
- the time from "step done" (both ranks leave a barrier) to the publish returning on every rank,
  every engine serving the step with its checksum confirmed (checked in ``GET /health`` after);
- the collectives the rank called, and the tensor collectives that crossed between the ranks
  (object collectives send sizes, then bytes): the ranks wrap torch.distributed's functions;
- the peak extra memory: VmHWM above VmRSS, both from /proc/self/status, the high-water mark
  reset through /proc/self/clear_refs just before the publish (freed heap handed back to the
  system first, ``malloc_trim``, so that memory reused during the publish counts);
- the bytes the rank sent and received in collectives and wrote into the push's buckets.
Floors, measured in the same run: the memcpy floor (bytes x engines at this machine's memcpy
bandwidth) and one bare all-gather of the model's bytes between the two ranks in one piece.

    .venv/bin/python benchmarks/sharded_push.py [--preset 500m] [--engines 1 2] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import gc
import inspect
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
from _common import load_line, machine_line
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import miles.train.sharded as sharded_module
from miles.errors import PublishError
from miles.models import build_model
from miles.models.presets import init_checkpoint
from miles.rollout.engine_process import free_port
from miles.testing import running_controller
from miles.train.publisher import PublishResult
from miles.train.push import PushPublisher
from miles.train.sharded import ShardedPublisher
from miles.utils.progress_bars import disable_library_progress_bars
from miles.weights.buckets import DEFAULT_BUCKET_BYTES
from miles.weights.checksum import saved_state_dict

WORLD = 2
WAYS = ("sharded", "naive")
# Seconds after the warm-up publishes: the controller writes the first pushed weights out to disk
# in the background (one engine copies and writes ~1 GB), which must not overlap a measured one.
SETTLE_S = 8.0
# Seconds between two measured publishes, for whatever an engine tidies up after a commit.
GAP_S = 1.0

# --- what a rank measures of itself ----------------------------------------------------------

# Collectives that move tensors, each with the argument holding this rank's tensor: the bytes it
# sends and receives follow from it and from whether the rank is the source (broadcast) or the
# destination (gather). ``funcol_all_gather`` is the functional all-gather ``full_tensor`` runs.
_TENSOR_OPS = {
    "broadcast": "tensor",
    "all_gather": "tensor",
    "all_gather_single": "input_tensor",
    "gather": "tensor",
    "all_reduce": "tensor",
    "funcol_all_gather": "self",
}
# Collectives a caller asks for that move no tensor of their own, or move them through the above.
_OTHER_OPS = (
    "barrier",
    "monitored_barrier",
    "all_gather_into_tensor",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
)


class Collectives:
    """Counts the torch.distributed collectives of this process (every thread) and their bytes:
    ``calls`` are what the code asked for (outermost calls), ``on_wire`` the tensor collectives
    that ran (an object collective is two: sizes, then bytes). Installed by wrapping the functions
    in ``torch.distributed`` (where callers look them up), in ``distributed_c10d`` (where object
    collectives look up the tensor ones) and the functional all-gather (``full_tensor``'s)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._depth = threading.local()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.calls = self.on_wire = self.sent = self.received = 0
            self.seconds = 0.0

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "calls": self.calls,
                "on_wire": self.on_wire,
                "sent": self.sent,
                "received": self.received,
                "seconds": self.seconds,
            }

    def install(self) -> None:
        for name in (*_TENSOR_OPS, *_OTHER_OPS):
            if hasattr(c10d, name):
                wrapped = self._wrap(getattr(c10d, name), name)
                setattr(c10d, name, wrapped)
                setattr(dist, name, wrapped)
        funcol.all_gather_single = self._wrap(funcol.all_gather_single, "funcol_all_gather")

    def _wrap(self, call: Callable[..., Any], name: str) -> Callable[..., Any]:
        signature = inspect.signature(call)

        @functools.wraps(call)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self._depth.n = depth
                moved = self._bytes(name, signature.bind(*args, **kwargs).arguments) if name in _TENSOR_OPS else None
                with self._lock:
                    if depth == 0:
                        self.calls += 1
                        self.seconds += time.perf_counter() - started
                    if moved is not None:
                        self.on_wire += 1
                        self.sent += moved[0]
                        self.received += moved[1]

        return counted

    def _bytes(self, name: str, arguments: dict[str, Any]) -> tuple[int, int]:
        """(sent, received) by this rank; every group here spans all ranks, so group ranks are ranks."""
        tensor = arguments[_TENSOR_OPS[name]]
        n, peers = tensor.numel() * tensor.element_size(), WORLD - 1
        if name == "broadcast":
            src = arguments.get("src", arguments.get("group_src"))
            return (n * peers, 0) if src == self.rank else (0, n)
        if name == "gather":
            dst = arguments.get("dst", arguments.get("group_dst"))
            return (0, n * peers) if dst == self.rank else (n, 0)
        # All-gathers send this rank's tensor to every peer and receive theirs; a ring all-reduce
        # sends and receives about the tensor once.
        return n * peers, n * peers


class Phases:
    """Seconds spent in wrapped calls, by phase, summed since the last ``reset``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.seconds = {}

    def add(self, phase: str, since: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - since

    def timed(self, call: Callable[..., Any], phase: str) -> Callable[..., Any]:
        if asyncio.iscoroutinefunction(call):

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await call(*args, **kwargs)
                finally:
                    self.add(phase, started)

            return timed_async

        def timed_sync(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.add(phase, started)

        return timed_sync


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _steady() -> int:
    """This process's resident bytes once garbage is collected and freed heap is handed back (so
    that heap a publish reuses shows in the high-water mark), with the high-water mark reset."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    _reset_peak()
    return _status("VmRSS")


def _reset_peak() -> None:
    """Reset VmHWM to VmRSS (proc(5), /proc/pid/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def _now() -> float:
    # One clock for both ranks' processes, so that the parent can take the first start and the
    # last end.
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# --- a rank ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankJob:
    url: str
    preset: str
    repeats: int
    port: int
    out: str


def rank_main(rank: int, job: RankJob) -> None:
    """One trainer rank (``torch.multiprocessing`` calls it): publish, write what it measured."""
    disable_library_progress_bars()
    # One core per rank: the two ranks share this machine's cores with the engines.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{job.port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=1800),
    )
    try:
        figures = asyncio.run(Rank(rank, job).run())
        Path(job.out, f"rank-{rank}.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


class Rank:
    def __init__(self, rank: int, job: RankJob) -> None:
        self.rank, self.job = rank, job
        self.wire = Collectives(rank)
        self.phases = Phases()
        self.model = build_model(job.preset, seed=0)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        named = saved_state_dict(self.model)
        # What a rank writes into the buckets in the sharded way: its rows, and (rank 0) the
        # tensors no rank splits.
        self.own_bytes = sum(
            _nbytes(t.to_local()) if isinstance(t, DTensor) else _nbytes(t) * (rank == 0) for t in named.values()
        )
        self.model_bytes = sum(_nbytes(t) for t in named.values())
        self.tensors = len(named)
        self.sharded = ShardedPublisher(job.url, timeout_s=600, ttl_s=60)
        self.naive = PushPublisher(job.url, delta=False, timeout_s=600, ttl_s=60) if rank == 0 else None
        # Where the sharded way's time goes, on this rank.
        self.sharded._contribute = self.phases.timed(self.sharded._contribute, "contribute")  # type: ignore[method-assign]
        sharded_module._finish = self.phases.timed(sharded_module._finish, "finish")  # type: ignore[assignment]
        if self.sharded.windows is not None:
            for call, phase in (("open", "open"), ("publish", "announce"), ("end", "commit")):
                setattr(self.sharded.windows, call, self.phases.timed(getattr(self.sharded.windows, call), phase))

    async def run(self) -> dict[str, Any]:
        base = _steady()
        self.wire.install()
        step, kept = 100, {}  # past the checkpoint the engines start on (versions only go up)
        for way in WAYS:  # warm-up: each way allocates what its next publishes reuse
            before = _steady()
            step += 1
            await self.publish(way, step)
            kept[way] = _steady() - before
        await asyncio.sleep(SETTLE_S)
        records = []
        for repeat in range(self.job.repeats):
            self.step_done(repeat)
            checksums = set()
            for way in WAYS if repeat % 2 == 0 else WAYS[::-1]:
                step += 1
                await asyncio.sleep(GAP_S)
                record = await self.measured(way, step)
                checksums.add(record["checksum"])
                records.append(record)
            if len(checksums) != 1:
                raise PublishError(f"the two ways published different checksums for the same weights: {checksums}")
        floor = self.bare_all_gather()
        await self.sharded.close()
        if self.naive is not None:
            await self.naive.close()
        return {
            "rank": self.rank,
            "tensors": self.tensors,
            "model_bytes": self.model_bytes,
            "own_bytes": self.own_bytes,
            "rss_base": base,
            "kept": kept,
            "records": records,
            "bare_all_gather_s": floor,
        }

    def step_done(self, repeat: int) -> None:
        """New weights, as an optimizer step leaves them: every local shard changed in place."""
        with torch.no_grad():
            for tensor in self.model.parameters():
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                local.add_(1e-3 * (repeat + 1))

    async def measured(self, way: str, step: int) -> dict[str, Any]:
        rss = _steady()
        dist.barrier()  # the step is done on both ranks
        self.wire.reset()
        self.phases.reset()
        _reset_peak()
        started = _now()
        result = await self.publish(way, step)
        ended = _now()
        peak = _status("VmHWM") - rss
        record = {
            "way": way,
            "step": step,
            "started": started,
            "ended": ended,
            "peak_extra": peak,
            "rss": rss,
            "checksum": result.checksum,
            "collectives": self.wire.snapshot(),
            "phases": dict(self.phases.seconds),
            "written": self.own_bytes if way == "sharded" else (self.naive.last.bytes if self.naive else 0),  # type: ignore[union-attr]
        }
        if way == "sharded" and self.sharded.last is not None:
            record["phases"]["engines"] = self.sharded.last.timings.get("engines", 0.0)
            record["path"] = self.sharded.last.path
        if way == "naive" and self.naive is not None and self.naive.last is not None:
            record["phases"] |= {f"push_{k}": v for k, v in self.naive.last.timings.items()}
        if self.rank == 0:
            record["update"] = await self.verify(result, step)
        return record

    async def publish(self, way: str, step: int) -> PublishResult:
        if way == "sharded":
            return await self.sharded.publish(self.model, step=step)
        return await self.naive_publish(step)

    async def naive_publish(self, step: int) -> PublishResult:
        """Every tensor gathered whole (both ranks take part, rank 0 keeps it), pushed by rank 0;
        rank 1 learns the outcome from one broadcast."""
        started = time.perf_counter()
        full = {}
        for name, tensor in saved_state_dict(self.model).items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.rank == 0:
                full[name] = whole
        self.phases.add("gather", started)
        outcome: list[Any] = [None]
        if self.naive is not None:
            pushing = time.perf_counter()
            try:
                outcome[0] = await self.naive.push(full, step=step)
            except PublishError as exc:
                outcome[0] = exc.message
            self.phases.add("push", pushing)
        del full
        telling = time.perf_counter()
        dist.broadcast_object_list(outcome, src=0)
        self.phases.add("outcome", telling)
        if isinstance(outcome[0], str):
            raise PublishError(f"rank 0 could not publish step {step}: {outcome[0]}")
        return outcome[0]

    async def verify(self, result: PublishResult, step: int) -> dict[str, Any]:
        """Rank 0: every server serves ``step`` with the published checksum, as the controller
        confirmed; returns the update's phases."""
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            health = (await http.get(f"{self.job.url}/health")).json()
        update = health["last_update"]
        servers = health["servers"]
        if not (
            update["status"] == "committed"
            and update["step"] == step
            and update["expected_checksum"] == result.checksum
            and all(s["confirmed_checksum"] == result.checksum and s["matched"] for s in update["servers"])
            and all(s["state"] == "serving" and s["checksum"] == result.checksum for s in servers)
        ):
            raise PublishError(f"step {step} is not what every server serves, verified: {health}")
        return {"timings": update["timings"], "load_timings": [s["load_timings"] for s in update["servers"]]}

    def bare_all_gather(self) -> float:
        """Seconds of one all-gather of the model's bytes between the ranks in one piece (best of 3):
        what the naive way's per-tensor gathers move."""
        mine = torch.ones(self.model_bytes // WORLD, dtype=torch.uint8)
        whole = torch.empty(mine.numel() * WORLD, dtype=torch.uint8)
        times = []
        for _ in range(3):
            dist.barrier()
            started = time.perf_counter()
            dist.all_gather_single(whole, mine)
            times.append(time.perf_counter() - started)
        return min(times)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- the benchmark -----------------------------------------------------------------------------


def memcpy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of one in-process copy of ``nbytes`` (the best of ``repeats``)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


async def run_ranks(job: RankJob) -> list[dict[str, Any]]:
    """Start the two ranks, wait for both, return what each measured; on any failure both are
    ended (by their process ids) before the error goes on."""
    context = mp.start_processes(rank_main, args=(job,), nprocs=WORLD, join=False, start_method="spawn")
    try:
        while not await asyncio.to_thread(context.join, 5):
            pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return await asyncio.to_thread(
        lambda: [json.loads(Path(job.out, f"rank-{r}.json").read_text()) for r in range(WORLD)]
    )


async def one_fleet(args: argparse.Namespace, checkpoint: Path, out: Path, engines: int) -> dict[str, Any]:
    load_before = load_line()
    # No write-out of pushed weights but the first (during the warm-up): each would copy and write
    # the model to disk on the engines' cores while the next publish runs.
    async with running_controller(
        model_checkpoint=checkpoint,
        num_servers=engines,
        update_timeout_s=1800,
        request_timeout_s=1800,
        write_out_interval_s=3600,
    ) as (_, url):
        assert url is not None
        ranks = await run_ranks(
            RankJob(url=url, preset=args.preset, repeats=args.repeats, port=free_port(), out=str(out))
        )
    model_bytes = ranks[0]["model_bytes"]
    figures: dict[str, Any] = {
        "engines": engines,
        "tensors": ranks[0]["tensors"],
        "bytes": model_bytes,
        "load_before": load_before,
        "load_after": load_line(),
        "memcpy_floor_s": model_bytes * engines / memcpy_bandwidth(model_bytes),
        "bare_all_gather_s": max(r["bare_all_gather_s"] for r in ranks),
        "path": next(rec["path"] for rec in ranks[0]["records"] if rec["way"] == "sharded"),
    }
    for way in WAYS:
        mine = [[rec for rec in r["records"] if rec["way"] == way] for r in ranks]
        ends = [
            max(recs[i]["ended"] for recs in mine) - min(recs[i]["started"] for recs in mine)
            for i in range(len(mine[0]))
        ]
        phases = {k: statistics.median(rec["phases"].get(k, 0.0) for rec in mine[0]) for k in mine[0][-1]["phases"]}
        figures[way] = {
            "publish_s": statistics.median(ends),
            "publish_all_s": ends,
            "rank0_phases_s": phases,
            "update_timings_s": {
                k: statistics.median(rec["update"]["timings"].get(k, 0.0) for rec in mine[0])
                for k in mine[0][-1]["update"]["timings"]
            },
            "ranks": [
                {
                    "calls": statistics.median(rec["collectives"]["calls"] for rec in recs),
                    "on_wire": statistics.median(rec["collectives"]["on_wire"] for rec in recs),
                    "in_collectives_s": statistics.median(rec["collectives"]["seconds"] for rec in recs),
                    "sent": statistics.median(rec["collectives"]["sent"] for rec in recs),
                    "received": statistics.median(rec["collectives"]["received"] for rec in recs),
                    "written": statistics.median(rec["written"] for rec in recs),
                    "peak_extra": statistics.median(rec["peak_extra"] for rec in recs),
                    "peak_extra_max": max(rec["peak_extra"] for rec in recs),
                    "kept": r["kept"][way],
                    "rss_base": r["rss_base"],
                }
                for r, recs in zip(ranks, mine, strict=True)
            ],
        }
    return figures


def report(results: list[dict[str, Any]], bucket_bytes: int) -> None:
    mib = 2**20
    for r in results:
        s, n = r["sharded"], r["naive"]
        gib = r["bytes"] / 2**30
        print(f"\n{r['engines']} engine(s), {r['tensors']} tensors, {gib:.2f} GiB; sharded path: {r['path']}")
        print(f"  {r['load_before']} (before), {r['load_after']} (after)")
        print(f"  {'figure':44s} {'sharded':>12s} {'naive':>12s} {'sharded/naive':>14s}")

        def row(label: str, a: float, b: float, fmt: str = "{:.3f}") -> None:
            ratio = f"{a / b:.2f}x" if b else "-"
            print(f"  {label:44s} {fmt.format(a):>12s} {fmt.format(b):>12s} {ratio:>14s}")

        row("publish, step done to verified on every rank, s", s["publish_s"], n["publish_s"])
        for way in WAYS:
            print(f"    {way}, every repeat: " + ", ".join(f"{t:.3f}" for t in r[way]["publish_all_s"]) + " s")
        for rank in range(WORLD):
            a, b = s["ranks"][rank], n["ranks"][rank]
            row(f"rank {rank}: collectives called", a["calls"], b["calls"], "{:.0f}")
            row(f"rank {rank}: tensor collectives between ranks", a["on_wire"], b["on_wire"], "{:.0f}")
            row(f"rank {rank}: time in collectives, s", a["in_collectives_s"], b["in_collectives_s"])
            row(f"rank {rank}: peak extra memory, MiB", a["peak_extra"] / mib, b["peak_extra"] / mib, "{:.0f}")
            row(f"rank {rank}: kept between publishes, MiB", a["kept"] / mib, b["kept"] / mib, "{:.0f}")
            row(
                f"rank {rank}: sent + received, MiB",
                (a["sent"] + a["received"]) / mib,
                (b["sent"] + b["received"]) / mib,
                "{:.0f}",
            )
            row(f"rank {rank}: written into buckets, MiB", a["written"] / mib, b["written"] / mib, "{:.0f}")
        memcpy, gather = r["memcpy_floor_s"], r["bare_all_gather_s"]
        print(
            f"  floors: memcpy {memcpy:.3f} s (sharded {s['publish_s'] / memcpy:.1f}x, naive "
            f"{n['publish_s'] / memcpy:.1f}x); bare all-gather of the model {gather:.3f} s (naive's "
            f"gathers {n['rank0_phases_s'].get('gather', 0.0) / gather:.1f}x)"
        )
        print(f"  one bucket: {bucket_bytes / mib:.0f} MiB; each rank's shards: {r['bytes'] / WORLD / mib:.0f} MiB")
        for way in WAYS:
            phases = ", ".join(f"{k} {v:.3f}" for k, v in r[way]["rank0_phases_s"].items())
            update = ", ".join(f"{k} {v:.3f}" for k, v in r[way]["update_timings_s"].items())
            print(f"  {way}: rank 0's phases (s): {phases}")
            print(f"  {way}: the controller's update (s): {update}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="500m")
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print(machine_line())
    results = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-sharded-") as tmp:
        checkpoint = Path(tmp) / "model"
        init_checkpoint(checkpoint, model_name="bench", preset=args.preset, seed=0, step=1)
        for engines in args.engines:
            out = Path(tmp) / f"engines-{engines}"
            out.mkdir()
            results.append(asyncio.run(one_fleet(args, checkpoint, out, engines)))
    report(results, DEFAULT_BUCKET_BYTES)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    main()

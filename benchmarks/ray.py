"""The Ray runtime against the local one, side by side in one run on the same tiny model:

- update latency: ``update_rollout_weights`` alternating between two checkpoints, through a
  controller whose engine is a local child process vs one whose engine is a Ray actor on another
  node of a local cluster (rounds interleaved, so drift on a shared machine hits both alike);
- routed-request latency: ``POST /generate`` (one new token) through each controller, sequential
  from a separate client process; median and p90;
- recovery: the time from losing the node of a serving engine to that server serving again
  (re-created on another node, last verified weights loaded and confirmed) vs a cold start of
  the same controller (placement group, actor, engine, confirmation).

    .venv/bin/python benchmarks/ray.py [--requests 300] [--updates 20] [--recoveries 3]

Everything runs on this machine on loopback: a head and worker nodes of a ``LocalCluster``,
declared with logical GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# This file has the Ray package's name: its directory must not shadow the package.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]

from miles.controller.core import AsyncInferenceController  # noqa: E402
from miles.models.presets import init_checkpoint  # noqa: E402
from miles.ray.cluster import LocalCluster, NodeSpec, connect  # noqa: E402
from miles.rollout.state import ServerState  # noqa: E402
from miles.testing import running_controller, wait_until  # noqa: E402
from miles.utils.progress_bars import disable_library_progress_bars  # noqa: E402

# The same request client as benchmarks/controller.py.
_spec = importlib.util.spec_from_file_location("bench_controller", _HERE / "controller.py")
assert _spec is not None and _spec.loader is not None
_controller_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_controller_bench)
latencies, p = _controller_bench.latencies, _controller_bench.p

RAY = {
    "runtime": "ray",
    "num_gpus_per_engine": 1,
    "num_cpus_per_engine": 0.1,
    "placement_strategy": "SPREAD",
    "health_interval_s": 0.5,
}


_versions = itertools.count(1000)  # serving versions only go forward


async def update_latencies(controller: AsyncInferenceController, checkpoints: list[Path], n: int) -> list[float]:
    times = []
    for i in range(n):
        version = str(next(_versions))
        started = time.perf_counter()
        result = await controller.update_rollout_weights(checkpoints[i % 2], weight_version=version)
        result.raise_for_status()
        times.append(time.perf_counter() - started)
    return times


async def recovery_time(cluster: LocalCluster, controller: AsyncInferenceController) -> float:
    (server,) = controller.health().servers
    (node,) = [n for n in cluster.worker_nodes if n.node_id == server.node_id]
    started = time.perf_counter()
    cluster.remove_node(node)

    def back() -> bool:
        (now,) = controller.health().servers
        return now.state is ServerState.SERVING and now.restarts > server.restarts

    await wait_until(back, what="the lost server to serve again", timeout=300, interval=0.01)
    return time.perf_counter() - started


async def cold_start(checkpoint: Path, **settings: Any) -> float:
    started = time.perf_counter()
    async with running_controller(model_checkpoint=checkpoint, num_servers=1, http=False, **settings):
        return time.perf_counter() - started


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": statistics.median(values) * 1e3, "p90_ms": p(values, 0.9) * 1e3}


async def main(args: argparse.Namespace, cluster: LocalCluster, root: Path) -> dict[str, Any]:
    checkpoints = [root / "a", root / "b"]
    results: dict[str, Any] = {}
    async with (
        running_controller(model_checkpoint=checkpoints[0], num_servers=1, health_interval_s=2.0) as (local, local_url),
        running_controller(model_checkpoint=checkpoints[0], num_servers=1, **{**RAY, "health_interval_s": 2.0}) as (
            on_ray,
            ray_url,
        ),
    ):
        assert local_url is not None and ray_url is not None
        updates: dict[str, list[float]] = {"local": [], "ray": []}
        requests: dict[str, list[float]] = {"local": [], "ray": []}
        rounds = 4
        for _ in range(rounds):
            updates["local"] += await update_latencies(local, checkpoints, args.updates // rounds)
            updates["ray"] += await update_latencies(on_ray, checkpoints, args.updates // rounds)
            requests["local"] += await asyncio.to_thread(latencies, local_url, args.requests // rounds)
            requests["ray"] += await asyncio.to_thread(latencies, ray_url, args.requests // rounds)
        results["update"] = {k: summary(v) for k, v in updates.items()}
        results["request"] = {k: summary(v) for k, v in requests.items()}

    colds, recoveries = [], []
    for _ in range(args.recoveries):
        while len(cluster.worker_nodes) < 2:
            cluster.add_node(NodeSpec(num_cpus=1, num_gpus=1))
        colds.append(await cold_start(checkpoints[0], **RAY))
        async with running_controller(model_checkpoint=checkpoints[0], num_servers=1, http=False, **RAY) as (ctl, _):
            recoveries.append(await recovery_time(cluster, ctl))
    results["cold_start_s"] = statistics.median(colds)
    results["recovery_s"] = statistics.median(recoveries)
    results["local_cold_start_s"] = await cold_start(checkpoints[0])
    return results


def report(results: dict[str, Any]) -> None:
    update, request = results["update"], results["request"]
    print(f"{'':28}{'local':>12}{'ray':>12}{'ray/local':>12}")
    for label, figures in (("update latency", update), ("routed request latency", request)):
        for q in ("p50_ms", "p90_ms"):
            local, ray = figures["local"][q], figures["ray"][q]
            print(f"{label + ' ' + q[:3]:28}{local:10.2f}ms{ray:10.2f}ms{ray / local:11.2f}x")
    cold, recovery = results["cold_start_s"], results["recovery_s"]
    print(f"{'ray cold start (median)':28}{'':12}{cold:11.2f}s")
    print(f"{'lost node -> serving again':28}{'':12}{recovery:11.2f}s{recovery / cold:11.2f}x of a cold start")
    print(f"{'local cold start':28}{results['local_cold_start_s']:11.2f}s")


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--recoveries", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="miles-bench-ray-") as tmp:
        for name, seed in (("a", 0), ("b", 1)):
            init_checkpoint(Path(tmp) / name, model_name="tiny", seed=seed, step=1)
        # A head (the controllers' node, no GPUs) and two GPU workers: the Ray engine runs on
        # another node than its controller, as in a cluster; a lost node leaves one to move to.
        ray_cluster = LocalCluster([NodeSpec(num_cpus=1, num_gpus=1), NodeSpec(num_cpus=1, num_gpus=1)]).start()
        try:
            connect(ray_cluster.address)
            figures = asyncio.run(main(arguments, ray_cluster, Path(tmp)))
        finally:
            ray_cluster.stop()
    report(figures)
    if arguments.json:
        print(json.dumps(figures, indent=2))

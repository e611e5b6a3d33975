"""What the controller costs: latency added per routed request, and its own overhead per update.

Side by side in one run, on one tiny-model engine per controller:
- a request sent straight to the engine vs. the same request through the controller's router
  (``POST /generate``, one new token, sequential from a separate client process; median and p90);
- the same through a second controller with the admin token and the API key set (every request
  presents its key, and the engines behind it require their secret), against the first;
- the same through a third controller with metrics off (``metrics_enabled=False``: routed requests
  record nothing), against the first, whose metrics are on (the default);
- ``update_rollout_weights`` through the controller vs. the engine's own
  ``/update_weights_from_disk`` of the same checkpoint (the data movement): the difference is the
  protocol's overhead (lock, validation, pause, checksum confirmation, admission, events).

    .venv/bin/python benchmarks/controller.py [--requests 500] [--updates 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from miles.models.presets import init_checkpoint
from miles.testing import running_controller

TOKEN = "bench-admin-" + "a" * 32
KEY = "bench-key-" + "k" * 32

CLIENT = r"""
import json, statistics, sys, time, httpx
url, n, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
headers = {"authorization": "Bearer " + token} if token else None
with httpx.Client(trust_env=False, headers=headers) as http:
    for _ in range(50):
        http.post(url + "/generate", json=body)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        http.post(url + "/generate", json=body).raise_for_status()
        times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def latencies(url: str, n: int, token: str = "") -> list[float]:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, url, str(n), token], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="miles-bench-controller-") as tmp:
        root = Path(tmp)
        for name, seed in (("a", 0), ("b", 1)):
            init_checkpoint(root / name, model_name="tiny", seed=seed, step=1)
        guarded_settings = {"admin_token": TOKEN, "api_key": KEY}
        async with (
            running_controller(model_checkpoint=root / "a", num_servers=1, health_interval_s=2.0) as (controller, url),
            running_controller(
                model_checkpoint=root / "a", num_servers=1, health_interval_s=2.0, **guarded_settings
            ) as (_, guarded_url),
            running_controller(
                model_checkpoint=root / "a", num_servers=1, health_interval_s=2.0, metrics_enabled=False
            ) as (_, unmetered_url),
        ):
            assert url is not None and guarded_url is not None and unmetered_url is not None
            engine = controller.health().servers[0].url
            assert engine is not None
            # Interleave rounds so drift on a shared machine hits every path alike.
            direct: list[float] = []
            routed: list[float] = []
            guarded: list[float] = []
            unmetered: list[float] = []
            for _ in range(args.rounds):
                per_round = args.requests // args.rounds
                direct += await asyncio.to_thread(latencies, engine, per_round)
                routed += await asyncio.to_thread(latencies, url, per_round)
                unmetered += await asyncio.to_thread(latencies, unmetered_url, per_round)
                guarded += await asyncio.to_thread(latencies, guarded_url, per_round, KEY)

            # Updates: the engine alone (data movement + its own verification) vs. the protocol.
            secret = {"authorization": f"Bearer {controller.engine_secret}"}
            async with httpx.AsyncClient(trust_env=False, timeout=120, headers=secret) as http:
                engine_only = []
                for i in range(args.updates):
                    target = root / ("b" if i % 2 == 0 else "a")
                    t = time.perf_counter()
                    answer = await http.post(f"{engine}/update_weights_from_disk", json={"model_path": str(target)})
                    engine_only.append(time.perf_counter() - t)
                    assert answer.json()["success"], answer.text
                # Put the engine back on what the controller verified before the protocol runs.
                await http.post(f"{engine}/update_weights_from_disk", json={"model_path": str(root / "a")})
            protocol = []
            phases: dict[str, list[float]] = {}
            for i in range(args.updates):
                target = root / ("b" if i % 2 == 0 else "a")
                t = time.perf_counter()
                result = await controller.update_rollout_weights(target, weight_version=str(10 + i))
                protocol.append(time.perf_counter() - t)
                assert result.ok, result.message
                for phase, seconds in result.timings.items():
                    phases.setdefault(phase, []).append(seconds)

    d50, r50 = statistics.median(direct), statistics.median(routed)
    print(f"Routed request latency ({len(direct)} requests per path, 1 new token, sequential client)")
    print(f"{'path':<22}{'p50 ms':>10}{'p90 ms':>10}")
    print(f"{'engine directly':<22}{d50 * 1e3:>10.3f}{p(direct, 0.9) * 1e3:>10.3f}")
    print(f"{'through controller':<22}{r50 * 1e3:>10.3f}{p(routed, 0.9) * 1e3:>10.3f}")
    print(
        f"added by routing: p50 {(r50 - d50) * 1e3:.3f} ms (target < 1 ms), "
        f"p90 {(p(routed, 0.9) - p(direct, 0.9)) * 1e3:.3f} ms"
    )
    print(f"ratio routed/direct p50: {r50 / d50:.2f}x")
    g50 = statistics.median(guarded)
    print(f"{'guarded controller':<22}{g50 * 1e3:>10.3f}{p(guarded, 0.9) * 1e3:>10.3f}")
    print(f"tokens checked (API key, engine secret) vs. open controller, p50: {g50 / r50:.3f}x (target <= 1.05x)")
    u50 = statistics.median(unmetered)
    print(f"{'metrics off':<22}{u50 * 1e3:>10.3f}{p(unmetered, 0.9) * 1e3:>10.3f}")
    print(
        f"metrics on vs. off, p50: {r50 / u50:.3f}x, p90: {p(routed, 0.9) / p(unmetered, 0.9):.3f}x (target <= 1.05x)"
    )
    print()
    e50, c50 = statistics.median(engine_only), statistics.median(protocol)
    print(f"Update of a tiny model, 1 server, {args.updates} updates each")
    print(f"{'what':<34}{'p50 ms':>10}")
    print(f"{'engine /update_weights_from_disk':<34}{e50 * 1e3:>10.2f}")
    print(f"{'controller update_rollout_weights':<34}{c50 * 1e3:>10.2f}")
    for phase, values in phases.items():
        print(f"{'  ' + phase:<34}{statistics.median(values) * 1e3:>10.2f}")
    print(
        f"protocol overhead (everything but the load): {(c50 - e50) * 1e3:.2f} ms per update "
        f"({c50 / e50:.2f}x the load)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=30)
    import uvloop

    uvloop.run(main(parser.parse_args()))

"""What the controller costs: latency added per routed request, and its own overhead per update.

Side by side in one run, on one tiny-model engine per controller:
- a request sent straight to the engine vs. the same request through the controller's router
  (``POST /generate``, one new token, sequential from a separate client process; median and p90);
- the same through a second controller with the admin token and the API key set (every request
  presents its key, and the engines behind it require their secret), against the first;
- metrics on (the default) vs. off (``metrics_enabled=False``: routed requests record nothing):
  fresh pairs of controllers, one of each, one request to each in turn from one client;
- ``update_rollout_weights`` through the controller vs. the engine's own
  ``/update_weights_from_disk`` of the same checkpoint (the data movement): the difference is the
  protocol's overhead (lock, validation, pause, checksum confirmation, admission, events).

    .venv/bin/python benchmarks/controller.py [--requests 600] [--rounds 3] [--updates 30] [--pairs 4]
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
from miles.utils.progress_bars import disable_library_progress_bars

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


# Two controllers, one request to each in turn from one client: drift on a shared machine (other
# processes, frequency changes) hits both sides alike, which separate runs cannot promise.
PAIRED_CLIENT = r"""
import json, sys, time, httpx
a, b, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
with httpx.Client(trust_env=False) as http:
    for _ in range(50):
        http.post(a + "/generate", json=body)
        http.post(b + "/generate", json=body)
    times = {a: [], b: []}
    for i in range(2 * n):
        url = (a, b)[i % 2] if (i // 2) % 2 == 0 else (b, a)[i % 2]  # ABBA: neither always goes first
        t = time.perf_counter()
        http.post(url + "/generate", json=body).raise_for_status()
        times[url].append(time.perf_counter() - t)
print(json.dumps([times[a], times[b]]))
"""


def paired_latencies(url_a: str, url_b: str, n: int) -> tuple[list[float], list[float]]:
    done = subprocess.run(
        [sys.executable, "-c", PAIRED_CLIENT, url_a, url_b, str(n)], capture_output=True, text=True, check=True
    )
    first, second = json.loads(done.stdout)
    return first, second


def latencies(url: str, n: int, token: str = "") -> list[float]:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, url, str(n), token], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def recording_cost(calls: int = 200_000) -> tuple[float, float]:
    """Seconds per routed request spent recording it, metrics on and off (no network: the CPU cost
    alone, which a loaded machine cannot hide the way it hides a few microseconds in a round trip)."""
    from miles.http.metrics import NO_REQUEST_METRICS, ControllerMetrics

    metrics = ControllerMetrics(lambda: None)  # type: ignore[arg-type,return-value]  # never scraped here
    answer = json.dumps(
        {
            "text": "x",
            "output_ids": [5],
            "meta_info": {"id": "r", "prompt_tokens": 3, "completion_tokens": 1, "e2e_latency": 0.001,
                          "weight_version": "7", "weight_version_start": "7", "weight_version_end": "7"},
        }
    ).encode()  # fmt: skip
    costs = []
    for recorder in (metrics, NO_REQUEST_METRICS):
        started = time.perf_counter()
        for _ in range(calls):
            recorder.request_done("tiny", server="tiny-0", outcome="ok", started=started, content=answer)
        costs.append((time.perf_counter() - started) / calls)
    return costs[0], costs[1]


async def metrics_on_off(root: Path, *, requests: int, pairs: int) -> tuple[list[float], list[float], list[float]]:
    """Routed latencies through a controller with metrics on and one with them off, request by
    request from one client; ``pairs`` fresh pairs of controllers (each with its own engine), the
    order of starting them alternated, so neither side keeps a faster engine or an earlier start.
    Returns both sides' latencies and each pair's p50 ratio."""
    metered: list[float] = []
    unmetered: list[float] = []
    ratios: list[float] = []
    for pair in range(pairs):
        sides = [True, False] if pair % 2 == 0 else [False, True]
        async with (
            running_controller(
                model_checkpoint=root / "a", num_servers=1, health_interval_s=2.0, metrics_enabled=sides[0]
            ) as (_, first),
            running_controller(
                model_checkpoint=root / "a", num_servers=1, health_interval_s=2.0, metrics_enabled=sides[1]
            ) as (_, second),
        ):
            assert first is not None and second is not None
            on_url, off_url = (first, second) if sides[0] else (second, first)
            on, off = await asyncio.to_thread(paired_latencies, on_url, off_url, requests // pairs)
        metered += on
        unmetered += off
        ratios.append(statistics.median(on) / statistics.median(off))
    return metered, unmetered, ratios


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
        ):
            assert url is not None and guarded_url is not None
            engine = controller.health().servers[0].url
            assert engine is not None
            # Interleave rounds so drift on a shared machine hits every path alike.
            direct: list[float] = []
            routed: list[float] = []
            guarded: list[float] = []
            for _ in range(args.rounds):
                per_round = args.requests // args.rounds
                direct += await asyncio.to_thread(latencies, engine, per_round)
                routed += await asyncio.to_thread(latencies, url, per_round)
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

        # Metrics on and off: fresh pairs of controllers, after the others have stopped.
        metered, unmetered, ratios = await metrics_on_off(root, requests=args.requests, pairs=args.pairs)

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
    print()
    m50, u50 = statistics.median(metered), statistics.median(unmetered)
    print(
        f"Metrics on vs. off ({len(metered)} requests each, alternating from one client, "
        f"{len(ratios)} fresh pairs of controllers)"
    )
    print(f"{'path':<22}{'p50 ms':>10}{'p90 ms':>10}{'mean ms':>10}")
    for name, values in (("metrics on", metered), ("metrics off", unmetered)):
        print(f"{name:<22}{statistics.median(values) * 1e3:>10.3f}{p(values, 0.9) * 1e3:>10.3f}"
              f"{statistics.fmean(values) * 1e3:>10.3f}")  # fmt: skip
    print(
        f"metrics on / off: p50 {m50 / u50:.3f}x, p90 {p(metered, 0.9) / p(unmetered, 0.9):.3f}x, "
        f"mean {statistics.fmean(metered) / statistics.fmean(unmetered):.3f}x (target <= 1.05x)"
    )
    print(
        "p50 on / off per pair: " + ", ".join(f"{r:.3f}x" for r in ratios)
        + f"; geometric mean {statistics.geometric_mean(ratios):.3f}x"
    )  # fmt: skip
    on, off = recording_cost()
    print(
        f"recording one routed request: {on * 1e6:.2f} us with metrics on, {off * 1e6:.2f} us off; "
        f"{(on - off) / r50 * 100:.3f}% of the routed p50 above"
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
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=4, help="fresh controller pairs for metrics on vs. off")
    import uvloop

    uvloop.run(main(parser.parse_args()))

"""Staged activation against the in-place copy: how long generation waits for an update.

    python benchmarks/staging.py [--presets small 500m] [--threads 2] [--repeats 5]

For each preset, builds two checkpoints (seeds 0 and 1) in a temp dir and runs one engine with
``--weight-staging on`` and then one with ``--weight-staging off`` (one engine at a time). Each
does a first update (it also faults in fresh pages, and allocates the staging copy) and then
``--repeats`` updates alternating between the two checkpoints; every update must answer
``success`` with the manifest's checksum. Prints the medians of the phases the engine reports in
the response's ``timings``:

- blocked: the time the write side of the weights lock was held, during which no decode step can
  run: ``activate`` (the swap) when staged, ``copy_and_checksum`` in place;
- staged work done while serving: ``stage_write`` (copy into the staging buffers, each slice
  hashed as written) and ``stage_checksum``;
- the whole update as the client saw it.

The 500m preset needs ~1 GB per checkpoint on disk, and the staged engine ~2 GB of memory (the
weights and their staging copy) besides the page cache.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from _common import BenchmarkError, check_response, engine_process, load_line, machine_line

from miles.models.presets import get_preset, init_checkpoint
from miles.utils.progress_bars import disable_library_progress_bars
from miles.weights.checkpoint import read_manifest


def updates(url: str, checkpoints: list[Path], repeats: int) -> tuple[list[float], list[dict[str, float]]]:
    """Client seconds and engine timings of ``repeats`` alternating updates after a first one."""
    seconds, phases = [], []
    with httpx.Client(timeout=600, trust_env=False) as http:
        for i in range(repeats + 1):
            checkpoint = checkpoints[(i + 1) % 2]
            started = time.perf_counter()
            response = http.post(f"{url}/update_weights_from_disk", json={"model_path": str(checkpoint)})
            elapsed = time.perf_counter() - started
            body = check_response(response, what="/update_weights_from_disk")
            if not body["success"] or body["checksum"] != read_manifest(checkpoint).checksum:
                raise BenchmarkError("update did not load the checkpoint's weights", body=body)
            if i:
                seconds.append(elapsed)
                phases.append(body["timings"])
        info = check_response(http.get(f"{url}/get_server_info"), what="/get_server_info")["weight_staging"]
    if info["mode"] == "on" and not info["last_update_staged"]:
        raise BenchmarkError("the engine was asked to stage but did not", weight_staging=info)
    return seconds, phases


def median(phases: list[dict[str, float]], key: str) -> float:
    return statistics.median(p.get(key, 0.0) for p in phases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["small", "500m"], help="model presets (default small 500m)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per engine (default 5)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    print(machine_line())
    print(load_line(), "(before)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-staging-") as tmp:
        root = Path(tmp)
        for preset in args.presets:
            checkpoints = [root / f"{preset}-a", root / f"{preset}-b"]
            for seed, path in enumerate(checkpoints):
                init_checkpoint(path, model_name=preset, preset=preset, seed=seed, step=seed + 1)
            num_bytes = read_manifest(checkpoints[0]).num_bytes
            params = get_preset(preset).num_parameters()
            for mode in ("on", "off"):
                with engine_process(
                    checkpoints[0], log_dir=root, threads=args.threads, extra_args=("--weight-staging", mode)
                ) as engine:
                    seconds, phases = updates(engine.url, checkpoints, args.repeats)
                blocked = median(phases, "activate" if mode == "on" else "copy_and_checksum")
                staged = median(phases, "stage_write") + median(phases, "stage_checksum")
                rows.append((preset, params, num_bytes, mode, blocked, staged, statistics.median(seconds)))
    print(load_line(), "(after)")

    print(
        f"\n{'preset':<8} {'params':>8} {'GB':>6} {'staging':>8} {'blocked ms':>11} {'staged while serving ms':>24} "
        f"{'update ms':>10}"
    )
    for preset, params, num_bytes, mode, blocked, staged, update in rows:
        print(
            f"{preset:<8} {params / 1e6:>7.1f}M {num_bytes / 1e9:>6.3f} {mode:>8} {blocked * 1e3:>11.3f} "
            f"{staged * 1e3 if mode == 'on' else 0.0:>24.3f} {update * 1e3:>10.1f}"
        )
    print("\n(medians of the engine's timings; blocked: the write lock held, no decode step runs meanwhile)")


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    main()

"""Weight reload next to a restart: ``/update_weights_from_disk`` against a fresh engine process.

    python benchmarks/reload.py [--preset 500m] [--threads 2] [--repeats 5] [--restarts 3]

Builds two checkpoints of ``--preset`` (default ``500m``: ~498M parameters, bfloat16, ~1 GB of
weights) with different seeds in a temp dir, then measures, in this order:

- restart, warm: spawning ``python -m miles.engine`` on checkpoint A until ``/health`` answers 200,
  and until a first generated token comes back (``/generate``, ``max_new_tokens=1``), best and
  median of ``--restarts``;
- update: one engine on A. The first update after its start (to B), then ``--repeats`` updates
  alternating A, B, ... (best and median). Every update must answer ``success`` with the
  checkpoint's manifest checksum;
- where the update goes: the phases the engine reports in the response's ``timings`` (a miles
  extension), and, measured in this process on the same files, the three passes an update makes
  over the weights: ``open_checkpoint`` + ``verify()`` (every tensor hashed against the manifest),
  a plain ``Tensor.copy_`` of the mapped tensors into preallocated ones (the memory-copy floor),
  and ``checksum_state_dict`` over the copies (the confirmation);
- cold files, last: one update to a checkpoint whose files were dropped from the page cache
  (``posix_fadvise(DONTNEED)``: no privilege needed, touches only these files), and one restart
  likewise. They run last because pages read back from disk are mapped in smaller pieces than
  the freshly written ones a trainer leaves behind, which slows every later pass over them.

Prints seconds and the ratios restart / update (target >= 10x) and update / memcpy floor (target
<= 2x). Only one engine process runs at a time (peak RSS ~3.3 GB for the 500m preset, plus the
page cache of the two checkpoints).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from _common import BenchmarkError, Samples, check_response, engine_process, load_line, machine_line

from miles.models.presets import get_preset, init_checkpoint
from miles.utils.progress_bars import disable_library_progress_bars
from miles.weights.checkpoint import open_checkpoint, read_manifest
from miles.weights.checksum import checksum_state_dict


@dataclass(frozen=True)
class Restart:
    health_s: float
    first_token_s: float


def drop_page_cache(checkpoint: Path) -> None:
    """Ask the kernel to drop ``checkpoint``'s cached pages (clean pages only; fsynced at save)."""
    for path in checkpoint.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def first_token(url: str) -> None:
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    check_response(httpx.post(f"{url}/generate", json=body, timeout=600, trust_env=False), what="/generate")


def measure_restart(checkpoint: Path, *, log_dir: Path, threads: int) -> Restart:
    started = time.perf_counter()
    with engine_process(checkpoint, log_dir=log_dir, threads=threads) as engine:
        first_token(engine.url)
        return Restart(health_s=engine.start_s, first_token_s=time.perf_counter() - started)


@dataclass(frozen=True)
class Update:
    """One ``/update_weights_from_disk`` as seen from the client, with the phases the engine reports."""

    seconds: float
    phases: dict[str, float]


def update(http: httpx.Client, url: str, checkpoint: Path) -> Update:
    """One ``/update_weights_from_disk``, after checking that it loaded ``checkpoint``'s weights.

    Raises:
        BenchmarkError: the engine refused the update or reported another checksum.
    """
    expected = read_manifest(checkpoint).checksum
    started = time.perf_counter()
    response = http.post(f"{url}/update_weights_from_disk", json={"model_path": str(checkpoint)})
    elapsed = time.perf_counter() - started
    result = check_response(response, what="/update_weights_from_disk")
    if not result["success"] or result["checksum"] != expected:
        raise BenchmarkError("update did not load the checkpoint's weights", result=result, expected=expected)
    # ``timings`` is a miles extension (seconds per phase); older engines do not send it.
    return Update(seconds=elapsed, phases=dict(result.get("timings") or {}))


def repeat(times: int, fn: Callable[[], object]) -> Samples:
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return Samples(tuple(seconds))


@dataclass(frozen=True)
class Breakdown:
    num_bytes: int
    verify: Samples
    copy: Samples
    checksum: Samples


def measure_breakdown(checkpoint: Path, *, repeats: int) -> Breakdown:
    """The update's three passes over the weights, timed one by one in this process."""

    def verify() -> None:
        with open_checkpoint(checkpoint) as reader:
            report = reader.verify()
        if not report.ok:
            raise BenchmarkError("checkpoint failed verification", problems=[p.message for p in report.problems[:3]])

    verify()  # warms the page cache, like the engine's own verification does
    with open_checkpoint(checkpoint) as reader:
        sources = {name: reader.tensor(name) for name in reader.tensor_names}
        # Written once first so the copies below do not pay for page faults on fresh memory.
        targets = {name: torch.zeros_like(t) for name, t in sources.items()}
        num_bytes = sum(t.numel() * t.element_size() for t in sources.values())

        def copy() -> None:
            for name, source in sources.items():
                targets[name].copy_(source)

        copy_samples = repeat(repeats, copy)
    checksum_samples = repeat(repeats, lambda: checksum_state_dict(targets))
    if checksum_state_dict(targets).checksum != read_manifest(checkpoint).checksum:
        raise BenchmarkError("copied tensors do not hash to the manifest: the benchmark measures a bug")
    return Breakdown(num_bytes=num_bytes, verify=repeat(repeats, verify), copy=copy_samples, checksum=checksum_samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="500m", help="model preset (default 500m)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine and here (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="warm updates and breakdown runs (default 5)")
    parser.add_argument("--restarts", type=int, default=3, help="fresh engine starts (default 3)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    print(machine_line())
    print(load_line(), "(before)")
    with tempfile.TemporaryDirectory(prefix="miles-bench-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        a, b = root / "a", root / "b"
        init_checkpoint(a, model_name=args.preset, preset=args.preset, seed=0, step=1)
        init_checkpoint(b, model_name=args.preset, preset=args.preset, seed=1, step=2)
        size = sum(p.stat().st_size for p in a.glob("*.safetensors"))
        print(
            f"preset {args.preset}: {get_preset(args.preset).num_parameters() / 1e6:.0f}M params, "
            f"{size / 1e9:.2f} GB of safetensors per checkpoint; built two in {time.perf_counter() - started:.1f}s; "
            f"engine --num-threads {args.threads}"
        )

        restarts = [measure_restart(a, log_dir=root, threads=args.threads) for _ in range(args.restarts)]
        with engine_process(a, log_dir=root, threads=args.threads) as engine:
            first_token(engine.url)
            with httpx.Client(timeout=600, trust_env=False) as http:
                first = update(http, engine.url, b)
                updates = [update(http, engine.url, a if i % 2 == 0 else b) for i in range(args.repeats)]
                # The engine idles meanwhile: it uses no CPU while no request is in flight.
                breakdown = measure_breakdown(b, repeats=args.repeats)
                loaded, other = (a, b) if args.repeats % 2 else (b, a)
                drop_page_cache(other)
                cold = update(http, engine.url, other)
            first_token(engine.url)  # still serving after all updates
        drop_page_cache(loaded)
        cold_restart = measure_restart(loaded, log_dir=root, threads=args.threads)
    print(load_line(), "(after)")

    warm = Samples(tuple(u.seconds for u in updates))
    health = Samples(tuple(r.health_s for r in restarts))
    token = Samples(tuple(r.first_token_s for r in restarts))
    gb = breakdown.num_bytes / 1e9
    print(f"\n{'what':<40} {'first s':>8} {'best s':>8} {'median s':>9} {'cold s':>8} {'x update':>9}")
    print(
        f"{'/update_weights_from_disk (A<->B)':<40} {first.seconds:8.2f} {warm.best:8.2f} {warm.median:9.2f} "
        f"{cold.seconds:8.2f} {1.0:9.1f}"
    )
    for name, samples, cold_s in (
        ("fresh engine process -> /health 200", health, cold_restart.health_s),
        ("fresh engine process -> first token", token, cold_restart.first_token_s),
    ):
        print(
            f"{name:<40} {'':>8} {samples.best:8.2f} {samples.median:9.2f} {cold_s:8.2f} "
            f"{samples.best / warm.best:9.1f}"
        )
    print("(first: the first update after the engine started; cold: the checkpoint's pages dropped before it)")

    if updates[0].phases:
        header = f"{'first s':>8} {'median s':>8} {'cold s':>8} {'x update':>9}"
        print(f"\n{'phases the engine reports (timings)':<40} {header}")
        for phase in updates[0].phases:
            median = statistics.median(u.phases.get(phase, 0.0) for u in updates)
            print(
                f"{phase:<40} {first.phases.get(phase, 0.0):8.3f} {median:8.3f} {cold.phases.get(phase, 0.0):8.3f} "
                f"{median / warm.median:9.2f}"
            )
        rest = warm.median - statistics.median(sum(u.phases.values()) for u in updates)
        print(f"{'outside the phases (HTTP, thread hops)':<40} {'':>8} {rest:8.3f} {'':>8} {rest / warm.median:9.2f}")

    parts = (
        ("open_checkpoint + verify (hash vs manifest)", breakdown.verify),
        ("copy into preallocated tensors (memcpy)", breakdown.copy),
        ("checksum of the copies", breakdown.checksum),
    )
    total = sum(s.best for _, s in parts)
    print(f"\n{'the same passes in this process (best of N)':<46} {'best s':>8} {'GB/s':>8} {'x update':>9}")
    for name, samples in parts:
        print(f"{name:<46} {samples.best:8.3f} {gb / samples.best:8.2f} {samples.best / warm.best:9.2f}")
    print(f"{'sum of the three passes':<46} {total:8.3f} {gb / total:8.2f} {total / warm.best:9.2f}")
    print(
        f"\nupdate / memcpy floor: {warm.best / breakdown.copy.best:.1f}x (target <= 2x); "
        f"restart / update: {health.best / warm.best:.1f}x to /health, "
        f"{token.best / warm.best:.1f}x to a first token (target >= 10x)"
    )


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    main()

"""Synchronous vs asynchronous GRPO on the same task, seed and budget, side by side in one run.

Each run is ``miles demo``'s job (a controller, a rollout server, the reference trainer pushing
every step's weights through the fastest verified path) in a process of its own, with no user
traffic, the trainer on one core and the rollout server on the other (CPU affinity), as users with
separate trainer and rollout GPUs have them (``--servers 2`` puts two engines on the fleet's
core). Both loops run the same SFT warm-up and then the same number of GRPO steps; the figures
compare the GRPO phase:

- the sync loop's final reward (mean of the last ``--window`` GRPO steps) sets the threshold, less
  ``--margin`` for noise; each loop's time to threshold is the GRPO wall time until its moving
  mean first reaches it;
- the ratio of those times (sync / async), both loops' final rewards and reward curves;
- the share of GRPO time the trainer waited for samples and the fleet generated none of the
  trainer's; sample staleness; failed requests, checksum mismatches and the event audit;
- each update's duration and how long it held requests at the gate (medians, from the event log).

    .venv/bin/python benchmarks/async_rl.py [--sft-steps 150] [--grpo-steps 150] [--repeats 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from miles.utils.progress_bars import disable_library_progress_bars

TRAINER_CPU, FLEET_CPU = 0, 1


def _pin(pid: int, cpu: int) -> None:
    """Put every thread of ``pid`` on ``cpu`` (threads started later inherit it from theirs)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except (ProcessLookupError, PermissionError, OSError):
            continue


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(entry))
    return found


def _keep_pinned(stop: threading.Event) -> None:
    """This process on the trainer's core, every process it starts (the engines, and the forkserver
    they are forked from) on the fleet's."""
    me = os.getpid()
    while not stop.is_set():
        _pin(me, TRAINER_CPU)
        below = _children(me)
        while below:
            child = below.pop()
            _pin(child, FLEET_CPU)
            below += _children(child)
        stop.wait(0.5)


def child(args: argparse.Namespace) -> None:
    """One run (``--child sync|async``); writes the run's figures to ``--out``."""
    os.sched_setaffinity(0, {TRAINER_CPU})
    stop = threading.Event()
    pinning = threading.Thread(target=_keep_pinned, args=(stop,), daemon=True)
    pinning.start()
    import uvloop
    from rich.console import Console

    from miles.config import UpdatePauseMode, UpdateStrategy
    from miles.demo.run import DemoConfig, quiet_logs, run_demo
    from miles.train.config import LoopMode
    from miles.utils.audit_utils.event_logger.logger import read_events
    from miles.utils.audit_utils.event_logger.models import WeightUpdateCommittedEvent

    quiet_logs()
    loop = LoopMode(args.child)
    config = DemoConfig(
        sft_steps=args.sft_steps,
        grpo_steps=args.grpo_steps,
        servers=args.servers,
        users=0,
        seed=args.seed,
        runs_dir=Path(args.runs_dir),
        live=False,
        loop=loop,
        max_staleness=args.max_staleness,
        pause_mode=UpdatePauseMode(args.pause_mode)
        if args.pause_mode
        else (UpdatePauseMode.RETRACT if loop is LoopMode.ASYNC else UpdatePauseMode.DRAIN),
        strategy=UpdateStrategy(args.strategy),
    )
    try:
        summary = uvloop.run(run_demo(config, console=Console(quiet=True)))
    finally:
        stop.set()
    training = json.loads((Path(summary.run_dir) / "training.json").read_text())
    grpo = [s for s in training["steps"] if s["phase"] == "grpo"]
    # The GRPO phase's updates (each step publishes; the SFT phase's come first).
    committed = [e for e in read_events(Path(summary.run_dir) / "events") if isinstance(e, WeightUpdateCommittedEvent)]
    updates = committed[-len(grpo) :]
    Path(args.out).write_text(
        json.dumps(
            {
                "loop": loop.value,
                "rewards": [s["mean_reward"] for s in grpo],
                "step_s": [s["step_s"] for s in grpo],
                "trainer_idle_s": [s["trainer_idle_s"] for s in grpo],
                "fleet_idle_s": [s["fleet_idle_s"] for s in grpo],
                "update_s": [e.duration_s for e in updates],
                "serving_blocked_s": [e.serving_blocked_s or 0.0 for e in updates],
                "staleness_counts": summary.staleness_counts,
                "max_staleness": summary.max_staleness,
                "samples_dropped": summary.samples_dropped,
                "requests_failed": summary.requests_failed,
                "checksum_mismatches": summary.checksum_mismatches,
                "events_check_passed": summary.events_check_passed,
                "updates_committed": summary.updates_committed,
                "updates_failed": summary.updates_failed,
                "transfer_path": summary.transfer_path,
                "wall_s": summary.wall_s,
            }
        )
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _moving(values: list[float], window: int) -> list[float]:
    return [_mean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


_CHECKS = (
    "max_staleness",
    "staleness_counts",
    "samples_dropped",
    "requests_failed",
    "checksum_mismatches",
    "events_check_passed",
    "updates_committed",
    "updates_failed",
    "transfer_path",
)


def _time_to(run: dict[str, Any], threshold: float, window: int) -> float | None:
    """GRPO wall time until the run's moving mean reward first reaches ``threshold``."""
    elapsed = 0.0
    for index, (step_s, mean) in enumerate(zip(run["step_s"], _moving(run["rewards"], window), strict=True)):
        elapsed += step_s
        # Only full windows: one lucky step early on is not the run reaching the threshold.
        if index + 1 >= window and mean >= threshold:
            return elapsed
    return None


def run_one(loop: str, args: argparse.Namespace, work: Path, index: int) -> dict[str, Any]:
    out = work / f"{loop}-{index}.json"
    command = [
        sys.executable,
        __file__,
        "--child",
        loop,
        "--out",
        str(out),
        "--runs-dir",
        str(work / "runs"),
        "--sft-steps",
        str(args.sft_steps),
        "--grpo-steps",
        str(args.grpo_steps),
        "--servers",
        str(args.servers),
        "--seed",
        str(args.seed),
        "--max-staleness",
        str(args.max_staleness),
        "--strategy",
        args.strategy,
        *(["--pause-mode", args.pause_mode] if args.pause_mode else []),
    ]
    started = time.monotonic()
    subprocess.run(command, check=True, timeout=3600)
    result: dict[str, Any] = json.loads(out.read_text())
    result["process_s"] = time.monotonic() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument(
        "--servers",
        type=int,
        default=1,
        help="rollout servers on the fleet's core (one, as users run one engine per rollout device)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--strategy", default="barrier", help="how updates move through the fleet")
    parser.add_argument("--pause-mode", help="default: retract for async (generations continue), drain for sync")
    parser.add_argument("--loops", nargs="+", default=["sync", "async"], help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=20, help="steps averaged for the final reward and the curve")
    parser.add_argument("--margin", type=float, default=0.02, help="threshold = sync's final reward - margin")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=["sync", "async"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--runs-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if os.cpu_count() is None or len(os.sched_getaffinity(0)) < 2:
        sys.exit("this benchmark gives the trainer and the fleet a core each: it needs 2 CPUs")
    rows = []
    with tempfile.TemporaryDirectory(prefix="miles-async-rl-") as tmp:
        work = Path(tmp)
        for index in range(args.repeats):
            # Alternated, so that a slower stretch of the machine falls on both loops.
            pair = {loop: run_one(loop, args, work, index) for loop in ("sync", "async")}
            sync, asyn = pair["sync"], pair["async"]
            final = {loop: _mean(r["rewards"][-args.window :]) for loop, r in pair.items()}
            threshold = final["sync"] - args.margin
            reach = {loop: _time_to(r, threshold, args.window) for loop, r in pair.items()}
            idle = {
                loop: (sum(r["trainer_idle_s"]) / sum(r["step_s"]), sum(r["fleet_idle_s"]) / sum(r["step_s"]))
                for loop, r in pair.items()
            }
            speedup = reach["sync"] / reach["async"] if reach["sync"] and reach["async"] else None
            rows.append(
                {
                    "repeat": index,
                    "threshold": threshold,
                    "final_reward": final,
                    "time_to_threshold_s": reach,
                    "speedup": speedup,
                    "grpo_wall_s": {loop: sum(r["step_s"]) for loop, r in pair.items()},
                    "idle_trainer_fleet": idle,
                    "update_p50_s": {loop: _median(r["update_s"]) for loop, r in pair.items()},
                    "serving_blocked_p50_s": {loop: _median(r["serving_blocked_s"]) for loop, r in pair.items()},
                    "curves": {loop: _moving(r["rewards"], args.window) for loop, r in pair.items()},
                    "checks": {loop: {k: r[k] for k in _CHECKS} for loop, r in pair.items()},
                }
            )
            print(
                f"\nrepeat {index}: {args.sft_steps} SFT + {args.grpo_steps} GRPO steps, {args.servers} servers, "
                f"max staleness {args.max_staleness}; threshold {threshold:.3f} "
                f"(sync's final reward {final['sync']:.3f} - {args.margin})"
            )
            for loop, r in pair.items():
                reached = reach[loop]
                print(
                    f"  {loop:5}  GRPO wall {sum(r['step_s']):7.1f} s  final reward {final[loop]:.3f}  to threshold "
                    f"{'never' if reached is None else f'{reached:.1f} s':>8}  trainer idle {idle[loop][0]:4.0%}  "
                    f"fleet idle {idle[loop][1]:4.0%}  staleness {r['staleness_counts']}  "
                    f"dropped {r['samples_dropped']}  failed {r['requests_failed']}  "
                    f"mismatches {r['checksum_mismatches']}  audit {'ok' if r['events_check_passed'] else 'FAILED'}"
                )
                print(
                    f"         update p50 {_median(r['update_s']) * 1e3:5.1f} ms  "
                    f"serving blocked p50 {_median(r['serving_blocked_s']) * 1e3:5.1f} ms"
                )
            print(
                f"  time to threshold, sync / async: {'n/a' if speedup is None else f'{speedup:.2f}x'}; "
                f"GRPO wall, sync / async: {sum(sync['step_s']) / sum(asyn['step_s']):.2f}x"
            )
    if len(rows) > 1:
        _summary(rows)
    if args.json:
        print(json.dumps(rows, indent=2))


def _summary(rows: list[dict[str, Any]]) -> None:
    """The ratios over every repeat: the median, and the spread (the sync loop alone moves by a few
    percent from run to run)."""
    walls = [r["grpo_wall_s"]["sync"] / r["grpo_wall_s"]["async"] for r in rows]
    reaches = [r["speedup"] for r in rows if r["speedup"] is not None]
    print(f"\nover {len(rows)} repeats, sync / async:")
    print(f"  GRPO wall          median {statistics.median(walls):.2f}x  (from {min(walls):.2f}x to {max(walls):.2f}x)")
    if reaches:
        print(
            f"  time to threshold  median {statistics.median(reaches):.2f}x  "
            f"(from {min(reaches):.2f}x to {max(reaches):.2f}x; {len(reaches)} of {len(rows)} repeats reached it)"
        )


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    main()

"""Engine start-up with and without the forkserver, side by side in one run on the tiny model:

- launch: from ``EngineProcess.start`` to ``/health`` answering, for an engine forked from the
  warm forkserver (``miles.engine.forkserver``) vs one started as a fresh interpreter
  (``MILES_ENGINE_FORKSERVER=0``), alternating so that drift on a shared machine hits both alike;
- recovery: a controller with one server whose engine is killed outright (SIGKILL), until that
  server serves its verified weights again, each way;
- the forkserver's own start (its imports), paid once per launching process.

    .venv/bin/python benchmarks/engine_start.py [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import load_line, machine_line, wait_until_healthy

from miles.models.presets import init_checkpoint
from miles.rollout.engine_process import FORKSERVER_ENV, EngineProcess, engine_command, free_port
from miles.rollout.state import ServerState
from miles.testing import running_controller, wait_until
from miles.utils.progress_bars import disable_library_progress_bars

WAYS = {"forked": "1", "fresh interpreter": "0"}


def launch_time(checkpoint: Path, log: Path) -> float:
    port = free_port()
    process = EngineProcess(command=engine_command(checkpoint, port=port, num_threads=1), log_path=log)
    started = time.perf_counter()
    process.start()
    try:
        wait_until_healthy(process, f"http://127.0.0.1:{port}", timeout_s=300)
        return time.perf_counter() - started
    finally:
        process.kill()


async def recovery_times(checkpoint: Path, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    async with running_controller(model_checkpoint=checkpoint, num_servers=1, http=False) as (controller, _):
        for _ in range(repeats):
            for way, setting in WAYS.items():
                os.environ[FORKSERVER_ENV] = setting  # read at every launch, restarts included
                (server,) = controller.health().servers
                assert server.pid is not None
                started = time.perf_counter()
                os.kill(server.pid, signal.SIGKILL)

                def back(before: int = server.restarts) -> bool:
                    (now,) = controller.health().servers
                    return now.state is ServerState.SERVING and now.restarts > before

                await wait_until(back, what="the killed server to serve again", timeout=300, interval=0.01)
                times[way].append(time.perf_counter() - started)
    return times


def main(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    checkpoint = root / "tiny"
    init_checkpoint(checkpoint, model_name="tiny", seed=0, step=1)
    os.environ[FORKSERVER_ENV] = "1"
    first = launch_time(checkpoint, root / "first.log")  # starts the forkserver, then forks
    launches: dict[str, list[float]] = {way: [] for way in WAYS}
    for i in range(args.repeats):
        for way, setting in WAYS.items():
            os.environ[FORKSERVER_ENV] = setting
            launches[way].append(launch_time(checkpoint, root / f"launch-{i}.log"))
    recoveries = asyncio.run(recovery_times(checkpoint, args.repeats))
    return {
        "first_forked_launch_s": first,
        "launch_s": {way: statistics.median(v) for way, v in launches.items()},
        "recovery_s": {way: statistics.median(v) for way, v in recoveries.items()},
        "repeats": args.repeats,
    }


def report(results: dict[str, Any]) -> None:
    print(machine_line())
    print(load_line())
    print(f"medians of {results['repeats']}; tiny model, one engine thread")
    print(f"{'':34}{'forked':>10}{'fresh':>10}{'forked/fresh':>14}")
    for label, key in (("launch -> /health answers", "launch_s"), ("killed -> serving again", "recovery_s")):
        forked, fresh = results[key]["forked"], results[key]["fresh interpreter"]
        print(f"{label:34}{forked:9.2f}s{fresh:9.2f}s{forked / fresh:13.2f}x")
    print(f"{'first launch (forkserver starts)':34}{results['first_forked_launch_s']:9.2f}s")


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="miles-bench-start-") as tmp:
        figures = main(arguments, Path(tmp))
    report(figures)
    if arguments.json:
        print(json.dumps(figures, indent=2))

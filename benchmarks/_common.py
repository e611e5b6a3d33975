"""Helpers shared by the engine benchmarks: timing statistics, the machine line, engine processes.

Not a benchmark itself. Engine processes started here are always killed (context manager), and
the ``EngineProcess`` registry kills any left over if the benchmark dies.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from miles.errors import MilesError
from miles.rollout.engine_process import EngineProcess, engine_command, free_port

# A benchmark must never reach a model hub; everything it uses is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class BenchmarkError(MilesError):
    """The benchmark saw something that makes its numbers meaningless (a failed call, wrong output)."""


@dataclass(frozen=True)
class Samples:
    """Repeated measurements of one thing, in seconds."""

    seconds: tuple[float, ...]

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def machine_line() -> str:
    """One line naming what the numbers were measured on (CPUs, memory, versions)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f"{pages / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        memory = "RAM unknown"
    import transformers

    return (
        f"{os.cpu_count()} CPU cores ({model}), {memory}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}"
    )


def load_line() -> str:
    """The 1/5/15-minute load averages: other work on the machine skews every number here."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def wait_until_healthy(process: EngineProcess, url: str, *, timeout_s: float, poll_s: float = 0.02) -> None:
    """Poll ``url/health`` every ``poll_s`` until it answers 200.

    A fixed short poll (not a backoff) so the measured start time is off by at most ``poll_s``.

    Raises:
        BenchmarkError: the process exited or did not answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as http:
        while True:
            if not process.alive():
                raise BenchmarkError("engine exited while starting", log=str(process.log_path), tail=process.log_tail())
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise BenchmarkError(f"engine not healthy within {timeout_s}s", log=str(process.log_path))
            time.sleep(poll_s)


@dataclass(frozen=True)
class StartedEngine:
    """A running engine process and how long it took to answer ``/health``."""

    url: str
    process: EngineProcess
    start_s: float


@contextmanager
def engine_process(
    checkpoint: Path,
    *,
    log_dir: Path,
    threads: int,
    extra_args: Sequence[str] = (),
    timeout_s: float = 300.0,
) -> Iterator[StartedEngine]:
    """Start ``python -m miles.engine`` on ``checkpoint``, yield it once healthy, always kill it.

    ``start_s`` runs from just before the process is spawned to the first 200 from ``/health``.

    Raises:
        BenchmarkError: the engine did not start.
    """
    port = free_port()
    process = EngineProcess(
        command=engine_command(checkpoint, port=port, num_threads=threads, extra_args=extra_args),
        log_path=log_dir / f"engine-{port}.log",
    )
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    process.start()
    try:
        wait_until_healthy(process, url, timeout_s=timeout_s)
        yield StartedEngine(url=url, process=process, start_s=time.perf_counter() - started)
    finally:
        process.kill()


def check_response(response: httpx.Response, *, what: str) -> dict:
    """The JSON body of a 200 answer.

    Raises:
        BenchmarkError: any other status (the body is in the message).
    """
    if response.status_code != 200:
        raise BenchmarkError(f"{what} answered {response.status_code}", body=response.text[:500])
    return response.json()

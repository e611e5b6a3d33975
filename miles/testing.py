"""Helpers for tests and benchmarks: tiny checkpoints and engine processes that clean up after
themselves. Nothing in the product imports this module."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from miles.controller.core import AsyncInferenceController
from miles.http.runner import HttpServer
from miles.rollout.engine_process import EngineProcess, engine_command, free_port
from miles.weights.buckets import BucketTable, layout, pack
from miles.weights.transport.segments import Segment


@contextmanager
def running_engine(
    checkpoint: Path,
    *,
    log_dir: Path,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    num_threads: int = 1,
    startup_timeout_s: float = 120.0,
) -> Iterator[str]:
    """Start ``python -m miles.engine`` on a free port; yield its base URL; always stop it."""
    port = free_port()
    process = EngineProcess(
        command=engine_command(checkpoint, port=port, num_threads=num_threads, extra_args=extra_args),
        log_path=log_dir / f"engine-{port}.log",
        env=env,
    )
    process.start()
    url = f"http://127.0.0.1:{port}"
    try:

        async def wait() -> None:
            async with httpx.AsyncClient(trust_env=False) as http:
                await process.wait_healthy(url, timeout_s=startup_timeout_s, http=http)

        asyncio.run(wait())
        yield url
    finally:
        process.kill()


async def wait_until(
    predicate: Callable[[], bool], *, what: str, timeout: float = 60.0, interval: float = 0.02
) -> None:
    """Return once ``predicate()`` holds, checking every ``interval`` seconds (0: every loop turn);
    AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    # Polling, not an Event: tests watch state (lock waiters, router queues, a fleet's health)
    # that the product exposes for reading but signals to no one.
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def wait_serving(
    url: str, process: subprocess.Popen[Any], *, timeout: float = 120.0, output: Callable[[], str] | None = None
) -> None:
    """Return once ``url/health`` answers 200 (a `miles serve` starting in ``process``);
    AssertionError when ``process`` exits first (with ``output()``, by default its stderr) or
    after ``timeout`` seconds. Polls: a separate process starting signals nothing but its answer."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            said = output() if output else (process.stderr.read() if process.stderr else "")
            raise AssertionError(f"{url} exited with {process.returncode} before it answered /health: {said}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer /health within {timeout}s")
        time.sleep(0.1)


def weights_held(http: httpx.Client) -> dict[str, Any]:
    """An engine's ``/get_weight_version`` without ``instance_id`` (which names the process, not
    its weights): the version and checksum it says it holds."""
    body = dict(http.get("/get_weight_version").json())
    body.pop("instance_id", None)
    return body


def copy_checkpoint(source: Path, target: Path) -> Path:
    """A writable copy of a checkpoint directory (to corrupt in tests)."""
    shutil.copytree(source, target)
    return target


@asynccontextmanager
async def running_controller(
    rollout_server_cls: Any = "miles.rollout.sft_rollout.SFTRollout",
    model_checkpoint: Path | None = None,
    *,
    num_servers: int = 2,
    http: bool = True,
    **overrides: Any,
) -> AsyncIterator[tuple[AsyncInferenceController, str | None]]:
    """Start an AsyncInferenceController (and its HTTP API on a free port); always close both."""
    overrides.setdefault("port", 0)
    overrides.setdefault("health_interval_s", 0.2)
    overrides.setdefault("health_failure_threshold", 2)
    controller = AsyncInferenceController(rollout_server_cls, model_checkpoint, num_servers=num_servers, **overrides)
    server = None
    try:
        await controller.start()
        if http:
            server = HttpServer(controller)
            await server.start()
        yield controller, server.url if server else None
    finally:
        if server is not None:
            await server.stop()
        await controller.close()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two looks (or the open and the read)
        return False


def bucket_segment(named: dict[str, torch.Tensor], names: list[str] | None = None) -> tuple[Segment, BucketTable]:
    """``names`` (default: all) of ``named`` packed back to back into a new shared-memory segment
    (its bytes are ``segment.flat``: a byte changed there is changed for every reader), with the
    packed table and its digests."""
    table = layout(named, names if names is not None else list(named))
    segment = Segment(table.total_bytes)
    return segment, pack(named, table, segment.flat)

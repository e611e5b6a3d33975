"""Helpers for tests and benchmarks: tiny checkpoints and engine processes that clean up after
themselves. Nothing in the product imports this module."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn

from miles.controller.core import AsyncInferenceController
from miles.http.runner import HttpServer
from miles.rollout.engine_process import EngineProcess, engine_command, free_port
from miles.rollout.state import ServerSnapshot, ServerState
from miles.weights.buckets import BucketTable, layout, pack
from miles.weights.transport.segments import Segment


@contextmanager
def running_engine(
    checkpoint: Path, *, log_dir: Path, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Iterator[str]:
    """Start ``python -m miles.engine`` on a free port; yield its base URL; always stop it."""
    port = free_port()
    process = EngineProcess(
        command=engine_command(checkpoint, port=port, num_threads=1, extra_args=extra_args),
        log_path=log_dir / f"engine-{port}.log",
        env=env,
    )
    process.start()
    url = f"http://127.0.0.1:{port}"
    try:

        async def wait() -> None:
            async with httpx.AsyncClient(trust_env=False) as http:
                await process.wait_healthy(url, timeout_s=120.0, http=http)

        asyncio.run(wait())
        yield url
    finally:
        process.kill()


async def wait_until(
    predicate: Callable[[], bool], *, what: str, timeout: float = 60.0, interval: float = 0.02
) -> None:
    """Return once ``predicate()`` holds, checked every ``interval`` s; AssertionError naming
    ``what`` after ``timeout`` s."""
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
    AssertionError when ``process`` exits first (with ``output()``, default its stderr) or after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            said = output() if output else (process.stderr.read() if process.stderr else "")
            raise AssertionError(f"{url} exited with {process.returncode} before it answered /health: {said}")
        with suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer /health within {timeout}s")
        time.sleep(0.1)


def weights_held(http: httpx.Client) -> dict[str, Any]:
    """An engine's ``/get_weight_version`` without ``instance_id`` (the process, not its weights)."""
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
    overrides = {"port": 0, "health_interval_s": 0.2, "health_failure_threshold": 2} | overrides
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


@contextmanager
def app_on_loopback(app: Any, *, timeout_s: float = 30.0) -> Iterator[int]:
    """Serve the ASGI ``app`` on a free loopback port, on a thread of its own, until the block
    ends; yields the port. Call it off any event loop."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, name=f"app-on-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)  # another thread's server: nothing to wait on
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)


def server_snapshot(server_id: str, *, url: str | None = None, **fields: Any) -> ServerSnapshot:
    """A snapshot of a server of model ``m`` serving version 1, for routing and health tests without
    processes (``fields`` replace any of its values)."""
    values: dict[str, Any] = {
        "server_id": server_id,
        "model_name": "m",
        "url": url or f"http://127.0.0.1/{server_id}",
        "device": "cpu",
        "state": ServerState.SERVING,
        "state_since": time.time(),
        "weight_version": "1",
        "checksum": "c",
        "verified": None,
        "last_probe": None,
        "consecutive_failures": 0,
        "restarts": 0,
        "pid": None,
    }
    return ServerSnapshot(**{**values, **fields})


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (its children, theirs ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def listening(pids: Iterable[int]) -> list[tuple[str, int]]:
    """The TCP addresses (host, port) the processes ``pids`` listen on, from /proc."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
        except OSError:
            continue  # the process ended, or is not ours to look into
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            raw_host, raw_port = local.split(":")
            # The kernel writes each 32-bit word of the address in host (little-endian) order.
            packed = b"".join(bytes.fromhex(raw_host[i : i + 8])[::-1] for i in range(0, len(raw_host), 8))
            addresses.append((str(ipaddress.ip_address(packed)), int(raw_port, 16)))
    return addresses


def on_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, v4 or v6, v4-mapped included) is a loopback address."""
    address = ipaddress.ip_address(host)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def bucket_segment(named: dict[str, torch.Tensor], names: list[str] | None = None) -> tuple[Segment, BucketTable]:
    """``names`` (default: all) of ``named`` packed into a new shared-memory segment (a byte
    changed in ``segment.flat`` is changed for every reader), with the packed table."""
    table = layout(named, names if names is not None else list(named))
    segment = Segment(table.total_bytes)
    return segment, pack(named, table, segment.flat)

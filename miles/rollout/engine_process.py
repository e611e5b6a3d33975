"""Local engine processes: launch, wait until healthy, stop (adapter: all subprocess calls live here).

Every process started here is registered until it is reaped, and an ``atexit`` hook kills what is
left, so a crashing parent leaves no engine behind; engines are also started with
``--exit-with-parent`` so they end themselves if the parent is killed outright.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from miles.errors import MilesError


class EngineStartError(MilesError):
    """An engine process exited or did not become healthy in time; the message has its log tail."""


class _Registry:
    """Processes this interpreter started and has not reaped yet (killed at exit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        atexit.register(self.kill_all)

    def add(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._procs[proc.pid] = proc

    def discard(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._procs.pop(proc.pid, None)

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs.values())
            self._procs.clear()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


_REGISTRY = _Registry()


def engine_command(
    checkpoint: Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    num_threads: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line of one embedded engine on ``host:port`` that ends with its parent."""
    command = [sys.executable, "-m", "miles.engine", "--model-path", str(checkpoint), "--host", host]
    command += ["--port", str(port), "--exit-with-parent"]
    if num_threads is not None:
        command += ["--num-threads", str(num_threads)]
    return [*command, *extra_args]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EngineProcess:
    """One engine server process on this machine."""

    def __init__(self, *, command: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.command = list(command)
        self.log_path = log_path
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self._env or {})},
            )
        _REGISTRY.add(self._proc)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    async def wait_healthy(self, url: str, *, timeout_s: float, http: httpx.AsyncClient) -> None:
        """Poll ``url/health`` until it answers 200; raise EngineStartError on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            if not self.alive():
                raise EngineStartError(
                    f"engine exited with code {self.returncode} while starting",
                    log=str(self.log_path),
                    tail=await asyncio.to_thread(self.log_tail),
                )
            try:
                response = await http.get(f"{url}/health", timeout=2.0)
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"engine did not become healthy within {timeout_s}s",
                    log=str(self.log_path),
                    tail=await asyncio.to_thread(self.log_tail),
                )
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    async def stop(self, *, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; always reaps the process."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            # A Popen's exit is nothing the loop can await, so poll it (poll() never blocks).
            # Waiting in a thread instead would outlive a cancelled stop() by up to grace_s.
            while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
        await asyncio.to_thread(proc.wait)
        _REGISTRY.discard(proc)

    def kill(self) -> None:
        """SIGKILL now (used by tests and on a failed start); reaps the process."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        _REGISTRY.discard(proc)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

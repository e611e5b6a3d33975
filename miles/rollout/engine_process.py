"""Local engine processes: launch, wait until healthy, stop (adapter: all subprocess calls live here).

Every process started here is registered until reaped and killed at exit (engines also get
``--exit-with-parent``). Embedded engines are forked from a warm interpreter that has imported
torch already (``miles.engine.forkserver``, one per launching process), which saves most of a
launch; ``MILES_ENGINE_FORKSERVER=0``, or a forkserver that fails to start, starts fresh ones.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import itertools
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import httpx

from miles.errors import MilesError

logger = logging.getLogger("miles.rollout")

FORKSERVER_ENV = "MILES_ENGINE_FORKSERVER"
_ENGINE_MODULE = "miles.engine"
# The forkserver imports torch and transformers before it answers: seconds, more on a busy machine.
_FORKSERVER_READY_S = 300.0


class EngineStartError(MilesError):
    """An engine process exited or did not become healthy in time; the message has its log tail."""


class _Registry:
    """Processes this interpreter started and has not reaped yet (killed at exit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: dict[int, _Child] = {}
        atexit.register(self.kill_all)

    def add(self, proc: _Child) -> None:
        with self._lock:
            self._procs[proc.pid] = proc

    def discard(self, proc: _Child) -> None:
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


class _ForkServer:
    """The warm interpreter engines are forked from (protocol: ``miles.engine.forkserver``), read by a thread."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "miles.engine.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._requests: IO[bytes] = self._proc.stdin
        self._replies: IO[bytes] = self._proc.stdout
        self._changed = threading.Condition()
        self._ready: bool | None = None
        self._failure = ""
        self._spawned: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._ids = itertools.count()  # next() on it is atomic: spawns from several threads get distinct ids
        threading.Thread(target=self._read, args=(self._replies,), name="miles-forkserver-reader", daemon=True).start()
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready is not None, timeout=_FORKSERVER_READY_S):
                self._failure = f"not ready after {_FORKSERVER_READY_S:g}s"
        if not self._ready:
            self.close()
            raise EngineStartError(f"the engine forkserver did not start: {self._failure}")
        atexit.register(self.close)
        # A process forked from this one (a data-loader worker, say) must not keep the forkserver's
        # input open: the forkserver ends its engines when this process ends, and only sees that
        # when every copy of its input is closed.
        forget = weakref.WeakMethod(self._forget_in_child)

        def in_child() -> None:
            if (method := forget()) is not None:
                method()

        os.register_at_fork(after_in_child=in_child)

    def _forget_in_child(self) -> None:
        # The descriptors are pointed at /dev/null rather than closed: their numbers stay this
        # object's, so closing it later cannot close a file the child has opened since.
        null = os.open(os.devnull, os.O_RDWR)
        for stream in (self._requests, self._replies):
            with contextlib.suppress(OSError, ValueError):
                os.dup2(null, stream.fileno())
        os.close(null)

    def _read(self, replies: IO[bytes]) -> None:
        for line in replies:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self._changed:
                if "ready" in message:
                    self._ready = bool(message["ready"])
                    self._failure = str(message.get("error", ""))
                elif "spawned" in message:
                    self._spawned[int(message["spawned"])] = message
                elif "exited" in message:
                    self._exits[int(message["exited"])] = int(message["code"])
                self._changed.notify_all()
        with self._changed:
            # The forkserver is gone. Its engines go on serving (they watch this process, not
            # it); how they end is now seen through their pidfds.
            if self._ready is None:
                self._failure = self._failure or "it exited while starting"
            self._ready = False
            self._changed.notify_all()

    def _send(self, message: dict[str, Any]) -> None:
        with self._changed:
            if not self._ready:
                raise EngineStartError("the engine forkserver has exited")
            try:
                self._requests.write(json.dumps(message).encode() + b"\n")
                self._requests.flush()
            except (OSError, ValueError) as exc:
                raise EngineStartError(f"the engine forkserver has exited ({exc})") from exc

    def spawn(self, args: Sequence[str], *, env: dict[str, str], log_path: Path) -> _ForkedEngine:
        ident = next(self._ids)
        self._send(
            dict(spawn=ident, args=list(args), env=env, cwd=os.getcwd(), log=str(log_path), launcher=os.getpid())
        )
        with self._changed:
            self._changed.wait_for(lambda: ident in self._spawned or not self._ready, timeout=60.0)
            reply = self._spawned.pop(ident, None)
        if reply is None or "pid" not in reply:
            raise EngineStartError(f"the engine forkserver could not fork: {(reply or {}).get('error', 'no answer')}")
        return _ForkedEngine(self, int(reply["pid"]))

    def exit_code(self, pid: int) -> int | None:
        # Without the lock: health checks call this on an event loop, which must never wait for
        # the reader thread (one dict lookup is atomic).
        return self._exits.get(pid)

    def wait_for_exit(self, pid: int, timeout: float) -> None:
        """Return when ``pid``'s exit is reported, the forkserver is gone, or ``timeout`` passed."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self._ready, timeout=timeout)

    @property
    def usable(self) -> bool:
        # Without the lock, like exit_code: health checks ask on an event loop.
        return bool(self._ready) and self._proc.poll() is None

    def close(self) -> None:
        """End the forkserver and every engine it started (it kills them when its input closes)."""
        with contextlib.suppress(OSError):
            self._requests.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# The exit status of an engine that ended after its forkserver: whoever reaped it got the status.
EXIT_UNKNOWN = 255


class _ForkedEngine:
    """An engine forked by the forkserver, with ``Popen``'s calls: its exit as the forkserver reports it, else as
    its pidfd shows (``EXIT_UNKNOWN``); signals go through the pidfd, which outlives a reused pid."""

    def __init__(self, server: _ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self._code: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None  # already ended and reaped; the forkserver reports how

    def poll(self) -> int | None:
        if self._code is None:
            code = self._server.exit_code(self.pid)
            # A pidfd becomes readable when its process has exited.
            if code is None and not self._server.usable and (self._pidfd is None or self._readable(0)):
                code = EXIT_UNKNOWN
            if code is not None and self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            self._code = code
        return self._code

    def send_signal(self, sig: int) -> None:
        if self._pidfd is None or self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # ended; poll() says so
            signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = 0.5 if deadline is None else min(deadline - time.monotonic(), 0.5)
            if left <= 0:
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout or 0.0)
            if self._server.usable:
                self._server.wait_for_exit(self.pid, left)
            elif self._pidfd is not None:
                self._readable(left)
        return code

    def _readable(self, timeout: float) -> bool:
        assert self._pidfd is not None
        return bool(select.select([self._pidfd], [], [], timeout)[0])


# A process EngineProcess runs: started by subprocess, or forked by the forkserver (the same calls).
_Child = subprocess.Popen[bytes] | _ForkedEngine

_FORKSERVER_LOCK = threading.Lock()
_FORKSERVERS: dict[int, _ForkServer | None] = {}  # by the pid of the process using it


def _forkserver() -> _ForkServer | None:
    """This process's forkserver (started on first use); None when it cannot be used."""
    if os.environ.get(FORKSERVER_ENV, "1") == "0":
        return None
    with _FORKSERVER_LOCK:
        pid = os.getpid()
        server = _FORKSERVERS.get(pid)
        if pid in _FORKSERVERS and (server is None or server.usable):
            return server  # None: it could not start in this process, engines start the slow way
        try:
            server = _ForkServer()
        except (EngineStartError, OSError) as exc:
            logger.warning("engines start without a forkserver (slower): %s", exc)
            server = None
        _FORKSERVERS[pid] = server
        return server


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


class _Ports:
    """Ports this interpreter handed out lately, never handed out twice while they are kept.

    A port is only free until something binds it, and an engine binds its port well after the port
    was chosen (vLLM tens of seconds later). Two launches side by side could otherwise be given the
    same port, and the slower one's health check would be answered by the other's server."""

    def __init__(self, keep: int = 4096) -> None:
        self._lock = threading.Lock()
        self._given: collections.deque[tuple[str, int]] = collections.deque(maxlen=keep)

    def take(self, host: str) -> int:
        with self._lock:
            # Bounded: on a machine whose ephemeral range is hardly larger than what is kept, a port
            # handed out before is better than a launch that never gets one.
            for _ in range(64):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind((host, 0))
                    port = int(sock.getsockname()[1])
                if (host, port) not in self._given:
                    break
            self._given.append((host, port))
            return port


_PORTS = _Ports()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now and that this interpreter has not handed out
    lately (the last 4096 ports)."""
    # A function, not the bound method: Ray pickles an actor's globals by value, and the method
    # would carry the lock of the ports kept here.
    return _PORTS.take(host)


class EngineProcess:
    """One engine server process on this machine."""

    def __init__(self, *, command: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.command = list(command)
        self.log_path = log_path
        self._env = env
        self._proc: _Child | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self._env or {})}
        server = _forkserver() if self.command[:3] == [sys.executable, "-m", _ENGINE_MODULE] else None
        if server is not None:
            try:
                self._proc = server.spawn(self.command[3:], env=env, log_path=self.log_path)
            except EngineStartError as exc:
                logger.warning("starting an engine without the forkserver (slower): %s", exc)
            else:
                _REGISTRY.add(self._proc)
                return
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        _REGISTRY.add(self._proc)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    async def wait_healthy(self, url: str, *, timeout_s: float, http: httpx.AsyncClient) -> None:
        """Poll ``url/health`` until it answers 200; raise EngineStartError on exit or timeout."""
        await wait_until_answering(url, timeout_s=timeout_s, http=http, process=self)

    async def start_error(self, message: str) -> EngineStartError:
        return EngineStartError(message, log=str(self.log_path), tail=await asyncio.to_thread(self.log_tail))

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
        await asyncio.to_thread(self.kill)

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


async def wait_until_answering(
    url: str, *, timeout_s: float, http: httpx.AsyncClient, process: EngineProcess | None = None
) -> None:
    """Poll ``url/health`` until it answers 200; EngineStartError after ``timeout_s``, or at once when
    ``process`` (the engine at ``url``, where it is ours) exits, with its log tail."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    last = "no answer"
    while True:
        if process is not None and not process.alive():
            raise await process.start_error(f"engine exited with code {process.returncode} while starting")
        try:
            response = await http.get(f"{url}/health", timeout=2.0)
            if response.status_code == 200:
                return
            last = f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            if process is not None:
                raise await process.start_error(f"engine did not become healthy within {timeout_s}s")
            raise EngineStartError(f"the server at {url} did not answer /health within {timeout_s}s ({last})", url=url)
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.5)

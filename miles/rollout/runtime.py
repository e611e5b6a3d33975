"""Where a rollout's engines run: the runtime that places, launches, watches and stops them.

A server type says *what* to run (its ``EngineCommand``); the runtime says *where* (node, devices,
port) and reports the ``Placement``: ``LocalRuntime`` runs child processes on loopback,
``miles.ray.engines.RayRuntime`` Ray actors on placement-group bundles (loaded by name: Ray is optional).
"""

from __future__ import annotations

import asyncio
import importlib
import shutil
import socket
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import httpx

from miles.config import RuntimeKind
from miles.errors import MilesError
from miles.rollout.engine_process import EngineProcess, EngineStartError, free_port, wait_until_answering

if TYPE_CHECKING:
    from miles.rollout.spec import RolloutSpec

_LAUNCH_ATTEMPTS = 3  # a freshly picked free port can be taken before the engine binds it


@dataclass(frozen=True)
class Placement:
    """Where one engine runs and what it was given."""

    node_id: str
    node_address: str
    gpu_ids: tuple[int, ...] = ()
    # What the engine runs its model on: "cpu", or "cuda:N" for the first of ``gpu_ids`` on a
    # machine with CUDA ("auto" until the engine has resolved it).
    device: str = "cpu"
    # Someone else runs the engine (attach mode): the controller never starts or stops it.
    attached: bool = False


@dataclass(frozen=True)
class LaunchSlot:
    """What the runtime gives one engine: its address, devices and a directory of its node."""

    host: str
    port: int
    placement: Placement
    # A directory on the engine's node for the weights it writes out and checkpoints shipped to it.
    work_dir: Path
    # The directories the engine may load checkpoints from (empty: anywhere).
    checkpoint_roots: tuple[Path, ...] = ()


@dataclass(frozen=True)
class EngineReport:
    """What a started engine says it runs on, for the runtime to check against what it gave it."""

    device: str | None
    # None: the engine does not say.
    gpu_ids: tuple[int, ...] | None


def sglang_gpu_ids(info: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The GPUs an engine says it uses in SGLang's ``/get_server_info`` (``gpu_ids``, or SGLang's
    ``tp_size * dp_size`` from ``base_gpu_id``, ``gpu_id_step`` apart)."""
    if "gpu_ids" in info:
        return tuple(info["gpu_ids"])
    if info.get("base_gpu_id") is None or info.get("device") not in (None, "cuda"):
        return None
    count = int(info.get("tp_size") or 1) * int(info.get("dp_size") or 1)
    step = int(info.get("gpu_id_step") or 1)
    return tuple(int(info["base_gpu_id"]) + i * step for i in range(count))


class EngineCommand(ABC):
    """How to run one engine of a server type (must pickle: the Ray runtime builds it on the engine's node)."""

    # The route (GET) where a started engine says what it runs on: SGLang's.
    info_route: ClassVar[str] = "/get_server_info"

    def reported(self, info: Mapping[str, Any], slot: LaunchSlot) -> EngineReport:
        """What the engine's answer at ``info_route`` says it runs on (``slot``: what it was given)."""
        return EngineReport(device=info.get("device"), gpu_ids=sglang_gpu_ids(info))

    @abstractmethod
    def argv(self, slot: LaunchSlot, checkpoint: Path) -> list[str]:
        """The command line of an engine serving ``checkpoint`` in ``slot``."""

    @abstractmethod
    def environment(self, slot: LaunchSlot) -> dict[str, str]:
        """What the engine reads from its environment (credentials, checkpoint roots)."""


@dataclass(frozen=True)
class LaunchedEngine:
    url: str
    placement: Placement
    pid: int | None


class EngineRuntime(ABC):
    """Places and runs the engines of one rollout (one per server id)."""

    def __init__(self, spec: RolloutSpec, *, on_exit: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        # Called with a server id when the runtime learns its engine ended (the supervisor is
        # woken, rather than finding out at its next probe).
        self.on_exit = on_exit

    async def start(self, server_ids: Sequence[str]) -> None:  # noqa: B027  # optional hook
        """Reserve what the servers need (a placement group) before any engine launches."""

    @abstractmethod
    async def launch(
        self, server_id: str, command: EngineCommand, checkpoint: Path, *, device: str, http: httpx.AsyncClient
    ) -> LaunchedEngine:
        """Start an engine for ``server_id`` serving ``checkpoint``; return once it answers /health.
        ``device``: the spec's (the Ray runtime uses its bundle's). Raises EngineStartError with the log tail."""

    @abstractmethod
    async def terminate(self, server_id: str) -> None:
        """Stop the server's engine (and what runs it); must not raise if it is already gone."""

    @abstractmethod
    def alive(self, server_id: str) -> bool:
        """Whether the server's engine is still running, as far as the runtime knows now."""

    async def ended(self, server_id: str, *, within_s: float) -> bool:
        """Whether the server's engine process has ended (learnt within ``within_s``: the exit may
        be known a moment after the socket closed)."""
        deadline = time.monotonic() + within_s
        while self.alive(server_id):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def readable(self, server_id: str, checkpoint: Path, *, expected_checksum: str | None = None) -> Path:
        """A path at which the server's engine can read ``checkpoint`` (shipped there if needed)."""
        return checkpoint

    @property
    def copies_dir(self) -> Path | None:
        """Where on this machine the engines write weight copies (stale ones are removed); None: elsewhere."""
        return None

    @abstractmethod
    async def close(self) -> None:
        """Stop every engine and release what ``start`` reserved; safe to call twice."""


def gpu_ids_of(device: str) -> tuple[int, ...]:
    """The GPU index a device string names ("cuda:1" -> (1,), "cuda" -> (0,), "cpu" -> ())."""
    if not device.startswith("cuda"):
        return ()
    _, _, index = device.partition(":")
    return (int(index),) if index.isdigit() else (0,)


class LocalRuntime(EngineRuntime):
    """Each engine a child process of this one, on a free loopback port (the default runtime);
    without the spec's directories, a temporary one of its own, removed by ``close()``."""

    def __init__(self, spec: RolloutSpec, *, on_exit: Callable[[str], None] | None = None) -> None:
        super().__init__(spec, on_exit=on_exit)
        self._processes: dict[str, EngineProcess] = {}
        self._own_dir: Path | None = None
        if spec.log_dir is not None and spec.snapshot_dir is not None:
            self._log_root, self._snapshot_dir = spec.log_dir, spec.snapshot_dir
        else:
            own = self._own_dir = Path(tempfile.mkdtemp(prefix=f"miles-{spec.name}-"))
            self._log_root = spec.log_dir or own / "logs"
            self._snapshot_dir = spec.snapshot_dir or own / "snapshots"

    @property
    def copies_dir(self) -> Path:
        return self._snapshot_dir

    async def launch(
        self, server_id: str, command: EngineCommand, checkpoint: Path, *, device: str, http: httpx.AsyncClient
    ) -> LaunchedEngine:
        placement = Placement(
            node_id=f"local:{socket.gethostname()}", node_address="127.0.0.1", gpu_ids=gpu_ids_of(device), device=device
        )
        last_error: EngineStartError | None = None
        for _ in range(_LAUNCH_ATTEMPTS):
            slot = LaunchSlot(
                host="127.0.0.1",
                port=free_port(),
                placement=placement,
                work_dir=self._snapshot_dir,
                checkpoint_roots=readable_roots(self.spec.allowed_checkpoint_roots, self._snapshot_dir),
            )
            # A command may prepare files for its engine (vLLM's directories): off the loop.
            process = EngineProcess(
                command=await asyncio.to_thread(command.argv, slot, checkpoint),
                log_path=self._log_root / f"{server_id}.log",
                env=await asyncio.to_thread(command.environment, slot),
            )
            # Known before it starts, so that ``close`` stops it whatever happens next.
            self._processes[server_id] = process
            await _started(process)
            url = f"http://{slot.host}:{slot.port}"
            try:
                await process.wait_healthy(url, timeout_s=self.spec.startup_timeout_s, http=http)
            except EngineStartError as exc:
                last_error = exc
                await process.stop()
                if "address already in use" not in str(exc.context.get("tail", "")).lower():
                    break
            else:
                return LaunchedEngine(url=url, placement=placement, pid=process.pid)
        assert last_error is not None
        raise last_error

    async def terminate(self, server_id: str) -> None:
        process = self._processes.pop(server_id, None)
        if process is not None:
            await process.stop()

    def alive(self, server_id: str) -> bool:
        process = self._processes.get(server_id)
        return process is not None and process.alive()

    async def close(self) -> None:
        await asyncio.gather(*(self.terminate(s) for s in list(self._processes)), return_exceptions=True)
        if self._own_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._own_dir, ignore_errors=True)
            self._own_dir = None


async def _started(process: EngineProcess) -> None:
    """``process.start()`` off the loop. A cancellation cannot stop the thread: it is waited for and
    what it started stopped before the cancellation goes on (else the engine would run on untracked,
    and recreate its log directory after the controller removed its state directory)."""
    starting = asyncio.ensure_future(asyncio.to_thread(process.start))
    try:
        await asyncio.shield(starting)
    except asyncio.CancelledError:
        await asyncio.gather(starting, return_exceptions=True)
        await process.stop()
        raise


class AttachedRuntime(EngineRuntime):
    """Servers someone else runs, at the spec's URLs: never started or stopped here; "launching"
    one waits until it answers ``/health`` (a restart: wait for it to come back, verify it again)."""

    def __init__(self, spec: RolloutSpec, *, on_exit: Callable[[str], None] | None = None) -> None:
        super().__init__(spec, on_exit=on_exit)
        self._urls: dict[str, str] = {}
        self._answered: set[str] = set()

    async def start(self, server_ids: Sequence[str]) -> None:
        self._urls = dict(zip(server_ids, self.spec.urls, strict=True))

    async def launch(
        self, server_id: str, command: EngineCommand, checkpoint: Path, *, device: str, http: httpx.AsyncClient
    ) -> LaunchedEngine:
        url = self._urls[server_id]
        # At start the server may still be coming up. Later (a restart) it is down for as long
        # as its owner keeps it down, and the wait holds the controller's lock: wait one probe's
        # time, and let the supervisor try again at its next round.
        timeout_s = self.spec.health.timeout_s if server_id in self._answered else self.spec.startup_timeout_s
        await wait_until_answering(url, timeout_s=timeout_s, http=http)
        self._answered.add(server_id)
        host = httpx.URL(url).host
        placement = Placement(node_id=f"attached:{host}", node_address=host, device=device, attached=True)
        return LaunchedEngine(url=url, placement=placement, pid=None)

    async def terminate(self, server_id: str) -> None:
        """Nothing to stop: the server belongs to whoever started it."""

    def alive(self, server_id: str) -> bool:
        # No process to look at; the probes (and their failure threshold) say when it is gone.
        return True

    async def ended(self, server_id: str, *, within_s: float) -> bool:
        return False  # its process is someone else's: never seen to end

    async def close(self) -> None:
        self._urls = {}


def runtime_for(spec: RolloutSpec, *, on_exit: Callable[[str], None] | None = None) -> EngineRuntime:
    """The runtime the spec asks for (servers at given URLs are attached, whatever the kind)."""
    if spec.urls:
        return AttachedRuntime(spec, on_exit=on_exit)
    if spec.runtime is RuntimeKind.LOCAL:
        return LocalRuntime(spec, on_exit=on_exit)
    try:
        # Imported on first use, by name: Ray is optional (and miles.ray is a layer above this one).
        module = importlib.import_module("miles.ray.engines")
    except ImportError as exc:
        raise MilesError(
            f"the {spec.runtime.value} runtime cannot be loaded ({exc}); install miles with the 'ray' extra "
            "(pip install 'miles[ray]')"
        ) from exc
    return module.RayRuntime(spec, on_exit=on_exit)


def readable_roots(allowed: Sequence[Path], work_dir: Path) -> tuple[Path, ...]:
    """What an engine may load from: the allowed roots and its work directory (peers' copies); () allows all."""
    return (*allowed, work_dir) if allowed else ()

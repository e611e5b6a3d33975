"""The Ray runtime: every engine in a Ray actor pinned to a bundle of the rollout's placement group.

One placement group per rollout, one bundle per engine (as in Miles and slime); an ``EngineHost``
actor in its bundle starts the engine on its node with the GPU ids Ray assigned (physical ids,
given explicitly). Requests go over HTTP straight to the engine; start, stop, liveness
(``wait_exit``, which wakes the supervisor when an actor dies) and checkpoint shipping are actor
calls. A node that does not see a checkpoint's files gets them through the object store, verified
there before the engine loads them (``CheckpointTransfer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.config import CheckpointTransfer
from miles.errors import MilesError
from miles.ray.cluster import connect
from miles.ray.placement import Fit, cluster_view, judge
from miles.rollout.engine_process import EngineProcess, EngineStartError, free_port
from miles.rollout.runtime import EngineCommand, EngineRuntime, LaunchedEngine, LaunchSlot, Placement, readable_roots
from miles.rollout.spec import RolloutSpec
from miles.weights.checksum import model_checksum
from miles.weights.manifest import manifest_or_none
from miles.weights.verification import verify_checkpoint

logger = logging.getLogger("miles.ray")

# Files are shipped in pieces of at most this many bytes (one object each).
_CHUNK_BYTES = 64 * 1024 * 1024
# How long a call to a host may take when it only reports or stops (not starting an engine).
_CONTROL_TIMEOUT_S = 30.0


class PlacementError(MilesError):
    """The cluster cannot give the rollout's engines the resources they ask for."""


class CheckpointShipError(MilesError):
    """A checkpoint could not be made readable on an engine's node."""


Fingerprint = list[tuple[str, int]]


def fingerprint(directory: Path) -> Fingerprint:
    """Every regular file under ``directory`` with its size, sorted (equal where two nodes see one checkpoint)."""
    return [(name, path.stat().st_size) for name, path in _files(directory)]


def _files(directory: Path) -> list[tuple[str, Path]]:
    paths = sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink())
    return [(path.relative_to(directory).as_posix(), path) for path in paths]


@ray.remote
class EngineHost:
    """Runs one engine process on the node Ray placed it on, for as long as the actor lives."""

    def __init__(self, server_id: str) -> None:
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.node_address = ray.util.get_node_ip_address()
        self.gpu_ids = tuple(int(i) for i in context.get_accelerator_ids().get("GPU", []))
        # The node's scratch space: Ray's temporary directory when the node has one of its own
        # (removed with the cluster), else the system's.
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"miles-{server_id}-", dir=os.environ.get("RAY_TMPDIR")))
        self.process: EngineProcess | None = None

    def placement(self) -> Placement:
        return Placement(node_id=self.node_id, node_address=self.node_address, gpu_ids=self.gpu_ids, device="auto")

    async def start(
        self,
        command: EngineCommand,
        checkpoint: str,
        *,
        checkpoint_roots: tuple[Path, ...] | None,
        startup_timeout_s: float,
    ) -> dict[str, Any]:
        """Start the engine and wait until it answers; its report of device and GPUs, or ``{"error", "tail"}``
        (exceptions with context do not cross processes). ``checkpoint_roots``: None, its work dir only."""
        roots = (self.work_dir,) if checkpoint_roots is None else readable_roots(checkpoint_roots, self.work_dir)
        slot = LaunchSlot(
            host=self.node_address,
            port=free_port(self.node_address),
            placement=self.placement(),
            work_dir=self.work_dir,
            checkpoint_roots=roots,
        )
        # A command may prepare its node's files (vLLM's directories): off the actor's loop.
        environment = await asyncio.to_thread(command.environment, slot)
        argv = await asyncio.to_thread(command.argv, slot, Path(checkpoint))
        self.process = EngineProcess(command=argv, log_path=self.work_dir / "engine.log", env=environment)
        await asyncio.to_thread(self.process.start)
        url = f"http://{slot.host}:{slot.port}"
        secret = environment.get("MILES_ENGINE_SECRET")
        headers = {"authorization": f"Bearer {secret}"} if secret else {}
        async with httpx.AsyncClient(trust_env=False, timeout=10.0, headers=headers) as http:
            try:
                await self.process.wait_healthy(url, timeout_s=startup_timeout_s, http=http)
                report = command.reported((await http.get(f"{url}{command.info_route}")).json(), slot)
            except (EngineStartError, httpx.HTTPError, ValueError) as exc:
                await self.process.stop()
                return {"error": str(exc), "tail": await asyncio.to_thread(self.process.log_tail)}
        return {"url": url, "pid": self.process.pid, "device": report.device, "gpu_ids": report.gpu_ids}

    async def wait_exit(self) -> int | None:
        """Return when the engine process ends (its exit code); raises if the actor dies first."""
        # A Popen's exit is nothing the loop can await; polling keeps the actor's loop free.
        while self.process is None or self.process.alive():  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        return self.process.returncode

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop()
        await asyncio.to_thread(shutil.rmtree, self.work_dir, ignore_errors=True)

    def sees(self, path: str, files: Fingerprint | None) -> bool:
        """Whether this node sees ``path`` with exactly these files (any files when None)."""
        directory = Path(path)
        return directory.is_dir() and (files is None or fingerprint(directory) == files)

    def pack(self, path: str) -> list[tuple[str, list[ray.ObjectRef]]]:
        """Put every file of the checkpoint at ``path`` into the object store, in chunks."""
        return _pack(Path(path))

    async def receive(
        self, name: str, files: list[tuple[str, list[ray.ObjectRef]]], *, expected_checksum: str | None
    ) -> str:
        """Write a shipped checkpoint into this node's work directory, verify it, return its path (kept once)."""
        target = self.work_dir / "shipped" / name
        if target.is_dir():
            return str(target)
        partial = target.with_name(f".{name}.{uuid.uuid4().hex[:8]}")
        try:
            for relative, chunks in files:
                for chunk in chunks:
                    await asyncio.to_thread(_append, partial / relative, await chunk)
            await asyncio.to_thread(_verify_arrival, partial, expected_checksum)
            partial.rename(target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return str(target)


async def _discard(host: Any) -> None:
    """Stop the host's engine and remove its files, then end the actor (dead or hung: ended anyway)."""
    try:
        with contextlib.suppress(RayActorError, TimeoutError):
            await asyncio.wait_for(host.stop.remote(), timeout=_CONTROL_TIMEOUT_S)
    finally:
        ray.kill(host)


def _append(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as out:
        out.write(data)


def _pack(directory: Path) -> list[tuple[str, list[ray.ObjectRef]]]:
    files = []
    for name, path in _files(directory):
        with open(path, "rb") as source:
            chunks = [ray.put(data) for data in iter(lambda: source.read(_CHUNK_BYTES), b"")]
        files.append((name, chunks or [ray.put(b"")]))
    return files


def _verify_arrival(directory: Path, expected_checksum: str | None) -> None:
    """Raise CheckpointShipError unless the shipped files are the checkpoint that was sent."""
    manifest = manifest_or_none(directory)
    if manifest is not None:
        report = verify_checkpoint(directory)
        if not report.ok:
            problems = "; ".join(p.message for p in report.problems[:3])
            raise CheckpointShipError(f"the shipped checkpoint does not match its manifest: {problems}")
        if expected_checksum is not None and manifest.checksum != expected_checksum:
            raise CheckpointShipError(
                f"the shipped checkpoint holds {manifest.checksum}, not the expected {expected_checksum}"
            )
    elif expected_checksum is not None and model_checksum(directory) != expected_checksum:
        raise CheckpointShipError(f"the shipped checkpoint's weights do not hash to {expected_checksum}")


class RayRuntime(EngineRuntime):
    """Engines as ``EngineHost`` actors on one placement group per rollout (see the module docstring)."""

    def __init__(self, spec: RolloutSpec, *, on_exit: Callable[[str], None] | None = None) -> None:
        super().__init__(spec, on_exit=on_exit)
        self._group: PlacementGroup | None = None
        self._bundle_index: dict[str, int] = {}
        self._hosts: dict[str, Any] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._ended: set[str] = set()
        # What each engine asks of the cluster: one bundle of the placement group per engine.
        self._bundle = {"CPU": spec.num_cpus_per_engine}
        if spec.num_gpus_per_engine:
            self._bundle["GPU"] = spec.num_gpus_per_engine

    # --- placement -------------------------------------------------------------------------

    async def start(self, server_ids: Sequence[str]) -> None:
        spec = self.spec
        await asyncio.to_thread(connect, spec.ray_address, namespace=spec.ray_namespace)
        self._bundle_index = {server_id: i for i, server_id in enumerate(server_ids)}
        bundle = self._bundle
        # A placement group no node could hold stays pending for ever: refuse it now, with the
        # numbers. One that fits in all but not in what is free now (held by someone who may
        # release it) gets the bounded wait.
        verdict = judge(bundle, count=len(server_ids), view=await asyncio.to_thread(cluster_view, tuple(bundle)))
        if verdict.fit is Fit.IMPOSSIBLE:
            raise PlacementError(f"the cluster cannot place rollout {spec.name}: {verdict.message}")
        if verdict.fit is Fit.SHORT_NOW:
            logger.warning(
                "waiting up to %gs for the cluster to free what rollout %s needs: %s",
                spec.startup_timeout_s,
                spec.name,
                verdict.message,
            )
        group = placement_group(
            [dict(bundle) for _ in server_ids],
            strategy=spec.placement_strategy.value,
            name=f"miles-{spec.name}-{uuid.uuid4().hex[:8]}",
        )
        try:
            await asyncio.wait_for(group.ready(), timeout=spec.startup_timeout_s)
        except TimeoutError:
            remove_placement_group(group)
            shortfall = await asyncio.to_thread(_shortfall, bundle, len(server_ids))
            raise PlacementError(
                f"the cluster did not place rollout {spec.name} ({len(server_ids)} engines of {bundle}, "
                f"{spec.placement_strategy.value}) within {spec.startup_timeout_s:g}s: {shortfall}"
            ) from None
        self._group = group

    async def launch(
        self, server_id: str, command: EngineCommand, checkpoint: Path, *, device: str, http: httpx.AsyncClient
    ) -> LaunchedEngine:
        spec = self.spec
        assert self._group is not None, "RayRuntime.start() has not reserved the placement group"
        host = EngineHost.options(  # type: ignore[attr-defined]
            num_cpus=spec.num_cpus_per_engine,
            num_gpus=spec.num_gpus_per_engine,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._group,
                placement_group_bundle_index=self._bundle_index[server_id],
                placement_group_capture_child_tasks=True,
            ),
            # The engine is given its GPU ids explicitly; Ray must not renumber them for it.
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
        ).remote(server_id)
        deadline = time.monotonic() + spec.startup_timeout_s
        placed = False
        try:
            # Scheduling waits for the bundle, which Ray re-creates elsewhere when its node died.
            try:
                placement: Placement = await asyncio.wait_for(host.placement.remote(), timeout=spec.startup_timeout_s)
            except TimeoutError:
                raise PlacementError(
                    f"no node could take {server_id}'s engine ({self._bundle}) within "
                    f"{spec.startup_timeout_s:g}s: {await asyncio.to_thread(_shortfall, self._bundle, 1)}",
                    server_id=server_id,
                ) from None
            placed = True
            readable = await self._readable_on(host, checkpoint, expected_checksum=None)
            # Without a shared filesystem the engine reads only what was shipped to its node.
            ship = spec.checkpoint_transfer is CheckpointTransfer.SHIP
            started = await asyncio.wait_for(
                host.start.remote(
                    command,
                    str(readable),
                    checkpoint_roots=None if ship else spec.allowed_checkpoint_roots,
                    startup_timeout_s=max(1.0, deadline - time.monotonic()),
                ),
                timeout=spec.startup_timeout_s + _CONTROL_TIMEOUT_S,
            )
        except BaseException as exc:
            if placed:
                await _discard(host)
            else:
                ray.kill(host)  # never scheduled: nothing on any node to stop
            if isinstance(exc, RayActorError):
                raise EngineStartError(f"the engine's actor died while starting: {exc}", server_id=server_id) from None
            raise
        if "error" in started:
            await _discard(host)
            raise EngineStartError(started["error"], server_id=server_id, tail=started["tail"])
        if tuple(started["gpu_ids"] or ()) != placement.gpu_ids:
            await _discard(host)
            raise EngineStartError(
                f"the engine reports GPUs {started['gpu_ids']}, not the {list(placement.gpu_ids)} Ray assigned",
                server_id=server_id,
            )
        self._hosts[server_id] = host
        self._ended.discard(server_id)
        self._watchers[server_id] = asyncio.create_task(self._watch(server_id, host), name=f"watch-{server_id}")
        placement = dataclasses.replace(placement, device=started["device"])
        return LaunchedEngine(url=started["url"], placement=placement, pid=started["pid"])

    async def _watch(self, server_id: str, host: Any) -> None:
        try:
            code = await host.wait_exit.remote()
            why = f"exited with code {code}"
        except RayActorError as exc:
            why = f"its actor died ({type(exc).__name__})"
        if self._hosts.get(server_id) is host:
            logger.warning("engine of %s %s", server_id, why)
            self._ended.add(server_id)
            if self.on_exit is not None:
                self.on_exit(server_id)

    async def terminate(self, server_id: str) -> None:
        host = self._hosts.pop(server_id, None)
        watcher = self._watchers.pop(server_id, None)
        if watcher is not None:
            watcher.cancel()
        if host is not None:
            await _discard(host)

    def alive(self, server_id: str) -> bool:
        return server_id in self._hosts and server_id not in self._ended

    async def close(self) -> None:
        await asyncio.gather(*(self.terminate(s) for s in list(self._hosts)), return_exceptions=True)
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None

    # --- checkpoints -----------------------------------------------------------------------

    async def readable(self, server_id: str, checkpoint: Path, *, expected_checksum: str | None = None) -> Path:
        host = self._hosts.get(server_id)
        if host is None:
            return checkpoint  # no engine to load it: the load call fails and says so
        try:
            return await self._readable_on(host, checkpoint, expected_checksum=expected_checksum)
        except RayActorError as exc:
            raise CheckpointShipError(
                f"the engine of {server_id} is gone ({type(exc).__name__}); its supervisor restarts it",
                server_id=server_id,
            ) from None

    async def _readable_on(self, host: Any, checkpoint: Path, *, expected_checksum: str | None) -> Path:
        mode = self.spec.checkpoint_transfer
        if mode is CheckpointTransfer.SHARED:
            return checkpoint
        local, name = await asyncio.to_thread(_local_view, checkpoint)
        if mode is CheckpointTransfer.AUTO and local is not None and await host.sees.remote(str(checkpoint), local):
            return checkpoint
        if local is not None:
            files = await asyncio.to_thread(_pack, checkpoint)
        else:
            files = await self._pack_elsewhere(host, checkpoint)
        name = (expected_checksum or name).replace(":", "-")
        try:
            shipped = await host.receive.remote(name, files, expected_checksum=expected_checksum)
        except RayTaskError as exc:
            raise CheckpointShipError(
                f"checkpoint {checkpoint} could not be shipped to the engine's node: {exc.cause}"
            ) from None
        logger.info("shipped %s to %s", checkpoint, shipped)
        return Path(shipped)

    async def _pack_elsewhere(self, target: Any, checkpoint: Path) -> list[tuple[str, list[ray.ObjectRef]]]:
        """The checkpoint's files from a node that has them (weights a peer wrote out on its node)."""
        for host in (host for host in self._hosts.values() if host is not target):
            try:
                if await host.sees.remote(str(checkpoint), None):
                    return await host.pack.remote(str(checkpoint))
            except RayActorError:
                continue
        raise CheckpointShipError(
            f"checkpoint {checkpoint} is on no node this controller can reach (not here, not on any engine's node)"
        )


def _local_view(checkpoint: Path) -> tuple[Fingerprint | None, str]:
    """The checkpoint's files as seen here (None: not here), and a shipped copy's name (its checksum if sealed)."""
    manifest = manifest_or_none(checkpoint)
    name = manifest.checksum if manifest is not None else f"{checkpoint.name}-{uuid.uuid4().hex[:8]}"
    return (fingerprint(checkpoint) if checkpoint.is_dir() else None), name


def _shortfall(bundle: dict[str, float], count: int) -> str:
    """What the cluster lacks now for ``count`` bundles of ``bundle``, in words (blocking)."""
    verdict = judge(bundle, count=count, view=cluster_view(tuple(bundle)))
    if verdict.fit is Fit.SHORT_NOW:
        return f"{verdict.message}: stop what holds them, lower what each engine asks for, or add nodes"
    # IMPOSSIBLE names the setting to lower itself; FITS: what was missing is free again now.
    return verdict.message or "what it needs is free now (something else held it while it waited)"

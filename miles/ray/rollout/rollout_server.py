"""RolloutServer: a fleet of engines serving one model, each tracked by an explicit state machine.

A RolloutServer launches its engines, confirms the weights each one holds by checksum before it
serves, probes their health on an interval, replaces a process that dies (on the last weights that
were verified on it), and stops everything it started. It knows nothing of the update protocol:
the InferenceController drives updates through ``load``, ``confirm``, ``admit``, ``quarantine``
and ``rollback``; the state machine refuses any step out of order.

Subclasses say how an engine process is launched and stopped (``_launch``, ``_terminate``,
``_alive``); everything else speaks SGLang's HTTP API through ``EngineClient``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Protocol

import httpx

from miles.errors import CheckpointError, MilesError
from miles.protocol.sglang import PauseMode, UpdateWeightsFromDiskRequest, UpdateWeightsResponse
from miles.ray.rollout.server_spec import HealthSettings, RolloutServerSpec
from miles.ray.rollout.server_state import (
    ProbeResult,
    ServerCell,
    ServerSnapshot,
    ServerState,
    StateChange,
    VerifiedWeights,
)
from miles.rollout.engine_client import EngineCallError, EngineClient, WeightsChecksum
from miles.weights.checkpoint import read_manifest

logger = logging.getLogger("miles.rollout")

ExclusiveSection = Callable[[str], AbstractAsyncContextManager[object]]


class RolloutObserver(Protocol):
    """What a rollout server reports as it goes (the controller turns these into events)."""

    def state_changed(self, change: StateChange) -> None: ...

    def weights_restored(self, server_id: str, model_name: str, verified: VerifiedWeights) -> None:
        """A server was confirmed (by checksum) to hold ``verified`` again after a start,
        restart or rollback."""


class RolloutServerError(MilesError):
    """A rollout server could not do what was asked (start, load, confirm, restart)."""


@asynccontextmanager
async def _no_guard(_: str) -> AsyncIterator[None]:
    yield


class RolloutServer(ABC):
    """Base of every rollout server type; see the module docstring."""

    def __init__(
        self,
        spec: RolloutServerSpec,
        *,
        exclusive: ExclusiveSection | None = None,
        observer: RolloutObserver | None = None,
    ) -> None:
        self.spec = spec
        # Restarts triggered by the health loop run inside this section (the controller passes
        # its lock) so a restart never interleaves with an update or a training window.
        self._exclusive = exclusive or _no_guard
        self._observer = observer
        manifest = _manifest_or_none(spec.checkpoint)
        self.model_name = spec.model_name or (manifest.model_name if manifest else spec.checkpoint.name)
        self._initial_step = manifest.step if manifest else None
        self._cells = [
            ServerCell(server_id=f"{spec.name}-{i}", model_name=self.model_name, device=device)
            for i, device in enumerate(spec.resolved_devices())
        ]
        self._clients: dict[str, EngineClient] = {}
        self._http: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None

    # --- subclass hooks --------------------------------------------------------------------

    @abstractmethod
    async def _launch(self, cell: ServerCell, checkpoint: Path) -> str:
        """Start an engine for ``cell`` serving ``checkpoint``; return its base URL once healthy."""

    @abstractmethod
    async def _terminate(self, cell: ServerCell) -> None:
        """Stop ``cell``'s engine process (and reap it); must not raise if it already died."""

    @abstractmethod
    def _alive(self, cell: ServerCell) -> bool:
        """Whether ``cell``'s engine process is still running."""

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            # Loopback calls to our own engines: no proxies from the environment.
            self._http = httpx.AsyncClient(timeout=self.spec.request_timeout_s, trust_env=False)
        return self._http

    async def start(self) -> None:
        """Launch every engine, confirm its weights, and start the health loop.

        Raises RolloutServerError (with the engine log tail) if an engine fails to start or holds
        weights other than its checkpoint's manifest says; everything started is stopped again.
        """
        try:
            await asyncio.gather(*(self._bring_up(cell, self.spec.checkpoint, restart=False) for cell in self._cells))
        except BaseException:
            await self.stop()
            raise
        self._health_task = asyncio.create_task(self._health_loop(), name=f"health-{self.spec.name}")

    async def stop(self) -> None:
        """Stop the health loop and every engine; safe to call twice."""
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        await asyncio.gather(*(self._stop_cell(cell) for cell in self._cells), return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _stop_cell(self, cell: ServerCell) -> None:
        await self._terminate(cell)
        if cell.state is not ServerState.STOPPED:
            self._apply(cell, ServerState.STOPPED, "rollout server stopped")
        self._clients.pop(cell.server_id, None)

    # --- views -----------------------------------------------------------------------------

    def snapshot(self) -> list[ServerSnapshot]:
        return [cell.snapshot() for cell in self._cells]

    @property
    def server_ids(self) -> list[str]:
        return [cell.server_id for cell in self._cells]

    def client(self, server_id: str) -> EngineClient:
        try:
            return self._clients[server_id]
        except KeyError:
            raise RolloutServerError("server has no running engine", server_id=server_id) from None

    def cell(self, server_id: str) -> ServerCell:
        for cell in self._cells:
            if cell.server_id == server_id:
                return cell
        raise RolloutServerError("no such server in this rollout server", server_id=server_id)

    # --- the update steps the controller drives --------------------------------------------

    def begin_update(self, server_id: str, *, reason: str) -> None:
        """Take a serving (or quarantined) server out of routing to load new weights."""
        self._apply(self.cell(server_id), ServerState.UPDATING, reason)

    async def pause(self, server_id: str, mode: PauseMode) -> int:
        return await self.client(server_id).pause_generation(mode, timeout=self.spec.update_timeout_s)

    async def resume(self, server_id: str) -> None:
        await self.client(server_id).continue_generation()

    async def load(
        self, server_id: str, checkpoint: Path, *, weight_version: str, abort_all_requests: bool = False
    ) -> UpdateWeightsResponse:
        """Ask the engine to load ``checkpoint``; a refusal is returned with ``success=False``."""
        request = UpdateWeightsFromDiskRequest(
            model_path=str(checkpoint), weight_version=weight_version, abort_all_requests=abort_all_requests
        )
        return await self.client(server_id).update_weights_from_disk(request, timeout=self.spec.update_timeout_s)

    async def confirm(self, server_id: str) -> WeightsChecksum:
        """The checksum the engine computes now over the weights it holds."""
        result = await self.client(server_id).weights_checksum(timeout=self.spec.update_timeout_s)
        return self.record_checksum(server_id, result)

    def record_checksum(self, server_id: str, reported: WeightsChecksum) -> WeightsChecksum:
        """Note what a server reported it holds (from ``confirm`` or from its load's answer)."""
        cell = self.cell(server_id)
        cell.checksum = reported.checksum
        cell.weight_version = reported.weight_version
        return reported

    def admit(self, server_id: str, verified: VerifiedWeights, *, reason: str) -> None:
        """Mark the server as serving ``verified`` (its checksum was confirmed by the caller)."""
        cell = self.cell(server_id)
        cell.verified = verified
        cell.weight_version = verified.weight_version
        cell.checksum = verified.checksum
        self._apply(cell, ServerState.SERVING, reason)

    def quarantine(self, server_id: str, *, reason: str) -> None:
        self._apply(self.cell(server_id), ServerState.QUARANTINED, reason)

    async def rollback(self, server_id: str, *, reason: str) -> WeightsChecksum:
        """Reload the server's last verified weights and confirm them; it serves them again.

        If the reload or its confirmation fails, the process is replaced (restart on the last
        verified weights). Raises RolloutServerError if the server never had verified weights.
        """
        cell = self.cell(server_id)
        verified = cell.verified
        if verified is None:
            raise RolloutServerError("server has no verified weights to roll back to", server_id=server_id)
        if cell.state is not ServerState.UPDATING:
            self._apply(cell, ServerState.UPDATING, reason)
        try:
            confirmed: WeightsChecksum | None = await self.confirm(server_id)
            if confirmed is not None and confirmed.checksum != verified.checksum:
                response = await self.load(server_id, verified.checkpoint, weight_version=verified.weight_version)
                confirmed = await self.confirm(server_id) if response.success else None
            elif confirmed is not None and confirmed.weight_version != verified.weight_version:
                # Never loaded the new weights (or loaded and restored them): only the label moved.
                await self.client(server_id).update_weight_version(verified.weight_version)
        except EngineCallError:
            confirmed = None
        if confirmed is not None and confirmed.checksum == verified.checksum:
            await self._resume_quietly(cell)
            self.admit(server_id, verified, reason=f"rolled back to {verified.weight_version}: {reason}")
            self._restored(cell, verified)
            return confirmed
        logger.warning("rollback of %s did not confirm; replacing the process", server_id)
        await self.restart(server_id, reason=f"rollback failed: {reason}")
        return WeightsChecksum(
            checksum=self.cell(server_id).checksum or "", algorithm="xxh3_128", weight_version=verified.weight_version
        )

    async def restart(self, server_id: str, *, reason: str) -> None:
        """Replace the server's process and bring it back on its last verified weights.

        The caller must hold the controller's exclusive section (the health loop takes it).
        """
        cell = self.cell(server_id)
        checkpoint = cell.verified.checkpoint if cell.verified else self.spec.checkpoint
        self._apply(cell, ServerState.RESTARTING, reason)
        await self._terminate(cell)
        self._clients.pop(server_id, None)
        cell.restarts += 1
        await self._bring_up(cell, checkpoint, restart=True)

    # --- internals -------------------------------------------------------------------------

    def _apply(self, cell: ServerCell, to: ServerState, reason: str) -> None:
        change = cell.transition(to, reason=reason)
        logger.info("%s: %s -> %s (%s)", cell.server_id, change.from_state, change.to_state, reason)
        if self._observer is not None:
            self._observer.state_changed(change)

    async def _bring_up(self, cell: ServerCell, checkpoint: Path, *, restart: bool) -> None:
        """Launch, wait healthy, confirm the checksum against what should be there, admit."""
        self._apply(cell, ServerState.STARTING, "restart" if restart else "start")
        try:
            url = await self._launch(cell, checkpoint)
        except MilesError as exc:
            self._apply(cell, ServerState.RESTARTING, f"launch failed: {exc.message}")
            raise RolloutServerError(f"engine failed to start: {exc}", server_id=cell.server_id) from exc
        cell.url = url
        cell.consecutive_failures = 0
        self._clients[cell.server_id] = EngineClient(url, http=self.http, server_id=cell.server_id)
        self._apply(cell, ServerState.PENDING_WEIGHTS, "engine healthy")
        expected = cell.verified or self._initial_weights(checkpoint)
        client = self._clients[cell.server_id]
        try:
            if expected.weight_version != await client.weight_version():
                # A checkpoint's manifest carries its own version; restore the one it was admitted as.
                await client.update_weight_version(expected.weight_version)
            confirmed = await self.confirm(cell.server_id)
        except EngineCallError as exc:
            # Leave the cell restarting so the health loop tries again, rather than stuck pending.
            self._apply(cell, ServerState.RESTARTING, f"engine stopped answering after start: {exc.message}")
            raise RolloutServerError(f"engine failed after start: {exc}", server_id=cell.server_id) from exc
        if confirmed.checksum != expected.checksum:
            self._apply(cell, ServerState.QUARANTINED, "weights after start do not match the verified checksum")
            raise RolloutServerError(
                "engine started on weights whose checksum differs from the verified one",
                server_id=cell.server_id,
                expected=expected.checksum,
                actual=confirmed.checksum,
            )
        self.admit(cell.server_id, expected, reason="weights confirmed after start")
        self._restored(cell, expected)

    def _restored(self, cell: ServerCell, verified: VerifiedWeights) -> None:
        if self._observer is not None:
            self._observer.weights_restored(cell.server_id, cell.model_name, verified)

    def _initial_weights(self, checkpoint: Path) -> VerifiedWeights:
        manifest = _manifest_or_none(checkpoint)
        if manifest is None:
            raise RolloutServerError(
                "checkpoint has no miles manifest, so its weights cannot be verified; "
                "seal it first with `miles checkpoint seal DIR --model-name NAME --step N`",
                checkpoint=str(checkpoint),
            )
        return VerifiedWeights(
            checkpoint=checkpoint, weight_version=manifest.weight_version, checksum=manifest.checksum, step=manifest.step
        )

    async def _resume_quietly(self, cell: ServerCell) -> None:
        try:
            await self.client(cell.server_id).continue_generation()
        except EngineCallError as exc:
            logger.warning("could not resume %s after rollback: %s", cell.server_id, exc)

    def set_health(self, health: HealthSettings) -> None:
        """Apply new probe settings from the next tick on (runtime reconfiguration)."""
        self.spec = self.spec.model_copy(update={"health": health})

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.spec.health.interval_s)
            for cell in self._cells:
                try:
                    await self._probe(cell)
                except Exception:
                    # The loop must outlive any one failed probe or restart; the next tick retries.
                    logger.exception("health check of %s failed", cell.server_id)

    async def _probe(self, cell: ServerCell) -> None:
        if cell.state not in (ServerState.SERVING, ServerState.PENDING_WEIGHTS, ServerState.RESTARTING):
            return  # probes pause while a server starts, updates, is quarantined or stopped
        if cell.state is ServerState.RESTARTING or not self._alive(cell):
            await self._restart_guarded(cell, "engine process exited" if cell.state is ServerState.SERVING else "retry")
            return
        started = time.monotonic()
        ok = await self.client(cell.server_id).health(timeout=self.spec.health.timeout_s)
        cell.last_probe = ProbeResult(
            at=time.time(), ok=ok, latency_s=time.monotonic() - started, error=None if ok else "health check failed"
        )
        cell.consecutive_failures = 0 if ok else cell.consecutive_failures + 1
        if cell.consecutive_failures >= self.spec.health.failure_threshold:
            await self._restart_guarded(cell, f"{cell.consecutive_failures} failed health checks in a row")

    async def _restart_guarded(self, cell: ServerCell, reason: str) -> None:
        async with self._exclusive(f"restart {cell.server_id}"):
            # Re-check under the section: an update may have replaced or stopped it meanwhile.
            healthy = self._alive(cell) and cell.consecutive_failures < self.spec.health.failure_threshold
            if cell.state is ServerState.STOPPED or (cell.state is ServerState.SERVING and healthy):
                return
            if cell.state not in (ServerState.SERVING, ServerState.PENDING_WEIGHTS, ServerState.RESTARTING):
                return  # an update took it over while we waited; it owns the cell now
            try:
                await self.restart(cell.server_id, reason=reason)
            except RolloutServerError as exc:
                logger.error("restart of %s failed (will retry): %s", cell.server_id, exc)


def _manifest_or_none(checkpoint: Path):  # noqa: ANN202 - Manifest | None
    try:
        return read_manifest(checkpoint)
    except CheckpointError:
        return None

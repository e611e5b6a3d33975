"""The supervisor of a rollout's servers: health probes, restarts, drift and recovery.

Every interval (sooner when woken) it probes each server: a dead, failing or replaced one is
restarted on its verified weights, a drifted one quarantined and rolled back, a quarantined one
recovered once its weights can be found. Repairs run inside the rollout's exclusive section (the
controller's lock), so they never interleave with an update, and re-check the server there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from miles.errors import MilesError
from miles.rollout.engine_client import EngineCallError, WeightsIdentity
from miles.rollout.spec import HealthSettings
from miles.rollout.state import ProbeResult, ServerCell, ServerSnapshot, ServerState, VerifiedWeights

logger = logging.getLogger("miles.rollout")


class Supervised(Protocol):
    """What the supervisor needs of its rollout (which changes the cells; the supervisor only reads them)."""

    @property
    def cells(self) -> list[ServerCell]: ...

    @property
    def health(self) -> HealthSettings: ...

    def alive(self, cell: ServerCell) -> bool: ...

    async def identity(self, server_id: str) -> WeightsIdentity: ...

    def exclusive(self, holder: str) -> AbstractAsyncContextManager[int | None]: ...

    async def restart(self, server_id: str, *, reason: str, fence: int | None = None) -> None: ...

    async def rollback(self, server_id: str, *, reason: str, fence: int | None = None) -> None: ...

    def peer_holding(self, cell: ServerCell) -> ServerSnapshot | None: ...

    def probed(self, cell: ServerCell, result: ProbeResult) -> None: ...

    def drifted(self, cell: ServerCell, *, verified: VerifiedWeights, reported: WeightsIdentity) -> None: ...


class Supervisor:
    """Probes, restarts and recovers the servers of one rollout; see the module docstring."""

    def __init__(self, rollout: Supervised) -> None:
        self._rollout = rollout
        # Set to run the next round now: a changed interval, a suspected server.
        self._wake = asyncio.Event()
        # Rounds of probes completed: lets an observer wait for "the supervisor looked again"
        # rather than for a span of time.
        self.rounds = 0

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Probe every server, round after round, until cancelled."""
        while True:
            # A changed interval or a suspected server ends the wait early (``wake``).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._rollout.health.interval_s)
            self._wake.clear()
            for cell in self._rollout.cells:
                try:
                    await self._probe(cell)
                except Exception:
                    # The loop must outlive any one failed probe or restart; the next round retries.
                    logger.exception("health check of %s failed", cell.server_id)
            self.rounds += 1

    async def _probe(self, cell: ServerCell) -> None:
        if cell.state is ServerState.QUARANTINED:
            await self._recover_guarded(cell)
            return
        if cell.state not in (ServerState.SERVING, ServerState.PENDING_WEIGHTS, ServerState.RESTARTING):
            return  # probes pause while a server starts, updates or is stopped
        if cell.state is ServerState.RESTARTING or not self._rollout.alive(cell):
            await self._restart_guarded(cell, "engine process exited" if cell.state is ServerState.SERVING else "retry")
            return
        incarnation, verified = cell.incarnation, cell.verified
        started = time.monotonic()
        reported: WeightsIdentity | None = None
        error = None
        try:
            reported = await self._rollout.identity(cell.server_id)
        except EngineCallError as exc:
            error = exc.message
        if cell.incarnation != incarnation:
            return  # replaced while the probe was out; its answer describes an older process
        probe = ProbeResult(at=time.time(), ok=reported is not None, latency_s=time.monotonic() - started, error=error)
        self._rollout.probed(cell, probe)
        if cell.consecutive_failures >= self._rollout.health.failure_threshold:
            await self._restart_guarded(cell, f"{cell.consecutive_failures} failed health checks in a row")
        elif reported is not None and cell.state is ServerState.SERVING and replaced(cell, reported):
            await self._replaced_guarded(cell, incarnation)
        elif reported is not None and cell.state is ServerState.SERVING and drifted(verified, reported):
            await self._drift_guarded(cell, incarnation)

    async def _replaced_guarded(self, cell: ServerCell, incarnation: int) -> None:
        """Restart a server whose process was replaced from outside (on anything, unfenced): verify it again."""
        async with self._rollout.exclusive(f"restart {cell.server_id}") as fence:
            reported = await self._still_serving(cell, incarnation)
            if reported is None or not replaced(cell, reported):
                return
            logger.warning(
                "%s was restarted outside the controller (instance %s, was %s); verifying it again",
                cell.server_id,
                reported.instance_id,
                cell.engine_instance,
            )
            reason = "engine process restarted outside the controller"
            await self._repair(cell, "restart", self._rollout.restart(cell.server_id, reason=reason, fence=fence))

    async def _drift_guarded(self, cell: ServerCell, incarnation: int) -> None:
        """Quarantine, report and roll back a server whose engine holds other weights than verified."""
        async with self._rollout.exclusive(f"drift {cell.server_id}") as fence:
            # Re-check under the section: an update may have changed the weights on purpose
            # while we waited, or replaced the process; only a drift that is still there counts.
            verified = cell.verified
            reported = await self._still_serving(cell, incarnation)
            if reported is None or verified is None or not drifted(verified, reported):
                return
            self._rollout.drifted(cell, verified=verified, reported=reported)
            reason = "weights changed outside the controller"
            await self._repair(cell, "rollback", self._rollout.rollback(cell.server_id, reason=reason, fence=fence))

    async def _still_serving(self, cell: ServerCell, incarnation: int) -> WeightsIdentity | None:
        """What the engine reports now, asked again inside the exclusive section; None when it no
        longer serves as the same process, or does not answer (the next probe deals with that)."""
        if cell.state is not ServerState.SERVING or cell.incarnation != incarnation:
            return None
        try:
            return await self._rollout.identity(cell.server_id)
        except EngineCallError:
            return None

    async def _recover_guarded(self, cell: ServerCell) -> None:
        """Bring a quarantined server back once its verified weights can be found (on disk, or on a peer)."""
        if cell.verified is None:
            return
        alive = self._rollout.alive(cell)
        if alive and cell.verified.checkpoint is None and self._rollout.peer_holding(cell) is None:
            return  # nothing to recover from yet; checked again at the next tick
        async with self._rollout.exclusive(f"recover {cell.server_id}") as fence:
            if cell.state is not ServerState.QUARANTINED:
                return  # an update took it over while we waited
            if self._rollout.alive(cell):
                reason = "its verified weights are available again"
                repair = self._rollout.rollback(cell.server_id, reason=reason, fence=fence)
            else:
                reason = "engine process exited while quarantined"
                repair = self._rollout.restart(cell.server_id, reason=reason, fence=fence)
            await self._repair(cell, "recovery", repair)

    async def _restart_guarded(self, cell: ServerCell, reason: str) -> None:
        async with self._rollout.exclusive(f"restart {cell.server_id}") as fence:
            # Re-check under the section: an update may have replaced or stopped it meanwhile.
            healthy = self._rollout.alive(cell) and cell.consecutive_failures < self._rollout.health.failure_threshold
            if cell.state not in (ServerState.SERVING, ServerState.PENDING_WEIGHTS, ServerState.RESTARTING):
                return  # an update took it over (or it was stopped) while we waited; it owns the cell now
            if cell.state is ServerState.SERVING and healthy:
                return
            await self._repair(cell, "restart", self._rollout.restart(cell.server_id, reason=reason, fence=fence))

    async def _repair(self, cell: ServerCell, what: str, repair: Awaitable[None]) -> None:
        """Await ``repair`` of ``cell``; a MilesError is logged, and the next round tries again."""
        try:
            await repair
        except MilesError as exc:
            # A MilesError's message carries its context; a traceback per retry would be noise.
            logger.error("%s of %s failed (will retry): %s", what, cell.server_id, exc)  # noqa: TRY400


def drifted(verified: VerifiedWeights | None, reported: WeightsIdentity) -> bool:
    """Whether an engine's report differs from the weights verified on it (version or checksum)."""
    if verified is None:
        return False
    return reported.weight_version != verified.weight_version or reported.checksum not in (None, verified.checksum)


def replaced(cell: ServerCell, reported: WeightsIdentity) -> bool:
    """Whether another engine process than the one brought up answers (known where the engine says: not SGLang)."""
    return None not in (cell.engine_instance, reported.instance_id) and reported.instance_id != cell.engine_instance

"""Rollout: a fleet of engines serving one model, each tracked by an explicit state machine.

A Rollout launches its engines, confirms the weights each one holds by checksum before it
serves, probes their health on an interval, replaces a process that dies (on the last weights that
were verified on it), and stops everything it started. It knows nothing of the update protocol:
the InferenceController drives updates through ``load``, ``confirm``, ``admit``, ``quarantine``
and ``rollback``; the state machine refuses any step out of order.

Each probe of a serving engine also compares the weight version and checksum the engine reports
with the ones verified on it: weights changed behind the controller's back (a direct load) are
quarantined, reported and rolled back. Verified weights that exist on no disk (a training window
pushed them) are recovered from a serving peer holding the same checksum, which writes them out
for the restarted engine; the controller also has one engine write them once after such a commit,
so a fleet of one server recovers too.

Subclasses say how an engine process is launched and stopped (``_launch``, ``_terminate``,
``_alive``); everything else speaks SGLang's HTTP API through ``EngineClient``.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from miles.rollout.engine_client import (
    EngineCallError,
    EngineClient,
    WeightsChecksum,
    WeightsExport,
    WeightsIdentity,
)
from miles.rollout.spec import HealthSettings, RolloutSpec
from miles.rollout.state import (
    ProbeResult,
    ServerCell,
    ServerSnapshot,
    ServerState,
    StateChange,
    VerifiedWeights,
)
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import model_checksum

logger = logging.getLogger("miles.rollout")

# The section restarts and recoveries run in (the controller passes its lock), named by its
# holder; it yields the fencing token the engine calls made inside it carry (None: unfenced).
ExclusiveSection = Callable[[str], AbstractAsyncContextManager[int | None]]

# The version a start checkpoint without a manifest serves as: older than any published step.
PLAIN_START_VERSION = "0"


class RolloutObserver(Protocol):
    """What a rollout reports as it goes (the controller turns these into events)."""

    def state_changed(self, change: StateChange) -> None: ...

    def weights_restored(self, server_id: str, model_name: str, verified: VerifiedWeights) -> None:
        """A server was confirmed (by checksum) to hold ``verified`` again after a start,
        restart or rollback."""

    def probed(self, server_id: str) -> None:
        """A health probe of the server finished (requests waiting for it may now route)."""

    def drifted(self, server_id: str, model_name: str, *, expected: VerifiedWeights, actual: WeightsIdentity) -> None:
        """A serving engine reported weights other than the ones verified on it."""


class RolloutError(MilesError):
    """A rollout could not do what was asked of one of its servers (start, load, confirm, restart)."""


@asynccontextmanager
async def _no_guard(_: str) -> AsyncIterator[int | None]:
    yield None


class Rollout(ABC):
    """Base of every server type (``SFTRollout`` ...): one model's servers; see the module docstring."""

    def __init__(
        self,
        spec: RolloutSpec,
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
        self._cells = [
            ServerCell(server_id=f"{spec.name}-{i}", model_name=self.model_name, device=device)
            for i, device in enumerate(spec.resolved_devices())
        ]
        self._clients: dict[str, EngineClient] = {}
        self._http: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None
        # Set to run the health loop's next tick now: a changed interval, a suspected server.
        self._wake = asyncio.Event()

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

        Raises RolloutError (with the engine log tail) if an engine fails to start or holds
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
            raise RolloutError("server has no running engine", server_id=server_id) from None

    def cell(self, server_id: str) -> ServerCell:
        for cell in self._cells:
            if cell.server_id == server_id:
                return cell
        raise RolloutError("no such server in this rollout server", server_id=server_id)

    # --- the update steps the controller drives --------------------------------------------

    def begin_update(self, server_id: str, *, reason: str) -> None:
        """Take a serving (or quarantined) server out of routing to load new weights."""
        self._apply(self.cell(server_id), ServerState.UPDATING, reason)

    async def pause(self, server_id: str, mode: PauseMode, *, fence: int | None = None) -> int:
        """Stop the server's generation (running requests per ``mode``); returns how many there were."""
        return await self.client(server_id).pause_generation(mode, timeout=self.spec.update_timeout_s, fence=fence)

    async def resume(self, server_id: str, *, fence: int | None = None) -> None:
        await self.client(server_id).continue_generation(fence=fence)

    async def load(
        self,
        server_id: str,
        checkpoint: Path,
        *,
        weight_version: str,
        expected_checksum: str,
        abort_all_requests: bool = False,
        fence: int | None = None,
    ) -> UpdateWeightsResponse:
        """Ask the engine to load ``checkpoint``, whose weights must hash to ``expected_checksum``
        (the engine checks before it touches its weights; a plain Hugging Face directory has no
        manifest to check against otherwise); a refusal is returned with ``success=False``."""
        request = UpdateWeightsFromDiskRequest(
            model_path=str(checkpoint),
            weight_version=weight_version,
            expected_checksum=expected_checksum,
            abort_all_requests=abort_all_requests,
        )
        return await self.client(server_id).update_weights_from_disk(
            request, timeout=self.spec.update_timeout_s, fence=fence
        )

    async def confirm(self, server_id: str, *, fence: int | None = None) -> WeightsChecksum:
        """The checksum the engine computes now over the weights it holds."""
        result = await self.client(server_id).weights_checksum(timeout=self.spec.update_timeout_s, fence=fence)
        return self.record_checksum(server_id, result)

    def record_checksum(self, server_id: str, reported: WeightsChecksum) -> WeightsChecksum:
        """Note what a server reported it holds (from ``confirm`` or from its load's answer)."""
        cell = self.cell(server_id)
        cell.checksum = reported.checksum
        cell.weight_version = reported.weight_version
        return reported

    async def fence(self, server_id: str, token: int, *, window_open: bool) -> None:
        """Tell the engine the newest fencing token, and whether a window holding it may push."""
        await self.client(server_id).fence(token, window_open=window_open)

    async def relabel(self, server_id: str, weight_version: str, *, fence: int | None = None) -> None:
        """Have the engine serve the weights it holds under ``weight_version`` (no reload)."""
        await self.client(server_id).update_weight_version(weight_version, fence=fence)
        self.cell(server_id).weight_version = weight_version

    async def identity(self, server_id: str) -> WeightsIdentity:
        """The version and checksum the engine says it holds (cheap: no hashing; for probes)."""
        return await self.client(server_id).weight_identity(timeout=self.spec.health.timeout_s)

    async def export(self, server_id: str, *, step: int, fence: int | None = None) -> WeightsExport:
        """Have the engine write the weights it holds as a checkpoint (for restarting a peer)."""
        return await self.client(server_id).export_weights(step=step, timeout=self.spec.update_timeout_s, fence=fence)

    def remember_checkpoint(self, checksum: str, checkpoint: Path) -> list[str]:
        """Record ``checkpoint`` (which holds weights with ``checksum``) as the place to reload
        them from, for every server verified on those weights that had no checkpoint; returns
        those servers' ids."""
        changed = []
        for cell in self._cells:
            verified = cell.verified
            if verified is not None and verified.checkpoint is None and verified.checksum == checksum:
                cell.verified = dataclasses.replace(verified, checkpoint=checkpoint)
                changed.append(cell.server_id)
        return changed

    def suspect(self, server_id: str) -> None:
        """A request could not reach the server: probe every server now, not at the next tick."""
        self.cell(server_id)  # raises for an id that is not ours
        self._wake.set()

    def admit(self, server_id: str, verified: VerifiedWeights, *, reason: str) -> None:
        """Mark the server as serving ``verified`` (its checksum was confirmed by the caller)."""
        cell = self.cell(server_id)
        cell.verified = verified
        cell.weight_version = verified.weight_version
        cell.checksum = verified.checksum
        self._apply(cell, ServerState.SERVING, reason)

    def quarantine(self, server_id: str, *, reason: str) -> None:
        self._apply(self.cell(server_id), ServerState.QUARANTINED, reason)

    async def rollback(self, server_id: str, *, reason: str, fence: int | None = None) -> WeightsChecksum:
        """Reload the server's last verified weights and confirm them; it serves them again.

        If the reload or its confirmation fails, the process is replaced (restart on the last
        verified weights). Raises RolloutError if the server never had verified weights.
        """
        cell = self.cell(server_id)
        verified = cell.verified
        if verified is None:
            raise RolloutError("server has no verified weights to roll back to", server_id=server_id)
        if cell.state is not ServerState.UPDATING:
            self._apply(cell, ServerState.UPDATING, reason)
        try:
            confirmed: WeightsChecksum | None = await self.confirm(server_id, fence=fence)
            if confirmed is not None and confirmed.checksum != verified.checksum:
                source = await self._source_of(cell, fence=fence)
                if source is None:
                    self._apply(cell, ServerState.QUARANTINED, "its verified weights are on no disk and no peer holds them")
                    raise RolloutError(
                        "the verified weights are on no disk and no serving peer holds them; the server "
                        "stays quarantined until the next update",
                        server_id=server_id,
                        weight_version=verified.weight_version,
                        expected=verified.checksum,
                        actual=confirmed.checksum,
                    )
                response = await self.load(
                    server_id,
                    source,
                    weight_version=verified.weight_version,
                    expected_checksum=verified.checksum,
                    fence=fence,
                )
                confirmed = await self.confirm(server_id, fence=fence) if response.success else None
            elif confirmed is not None and confirmed.weight_version != verified.weight_version:
                # Never loaded the new weights (or loaded and restored them): only the label moved.
                await self.client(server_id).update_weight_version(verified.weight_version, fence=fence)
                confirmed = self.record_checksum(
                    server_id, dataclasses.replace(confirmed, weight_version=verified.weight_version)
                )
        except EngineCallError:
            confirmed = None
        if confirmed is not None and confirmed.checksum == verified.checksum:
            await self._resume_quietly(cell, fence=fence)
            self.admit(server_id, verified, reason=f"rolled back to {verified.weight_version}: {reason}")
            self._restored(cell, verified)
            return confirmed
        logger.warning("rollback of %s did not confirm; replacing the process", server_id)
        await self.restart(server_id, reason=f"rollback failed: {reason}", fence=fence)
        return WeightsChecksum(
            checksum=self.cell(server_id).checksum or "", algorithm="xxh3_128", weight_version=verified.weight_version
        )

    async def restart(self, server_id: str, *, reason: str, fence: int | None = None) -> None:
        """Replace the server's process and bring it back on its last verified weights.

        The caller must hold the controller's exclusive section (the health loop takes it).
        """
        cell = self.cell(server_id)
        if cell.state is not ServerState.RESTARTING:
            self._apply(cell, ServerState.RESTARTING, reason)
        await self._terminate(cell)
        self._clients.pop(server_id, None)
        cell.restarts += 1
        # Where the verified weights can be read from; without any, the engine starts on the
        # spec's checkpoint and is quarantined by _bring_up (it holds other weights), never
        # admitted.
        source = await self._source_of(cell, fence=fence) if cell.verified else None
        await self._bring_up(cell, source or self.spec.checkpoint, restart=True, fence=fence)

    # --- internals -------------------------------------------------------------------------

    def _apply(self, cell: ServerCell, to: ServerState, reason: str) -> None:
        change = cell.transition(to, reason=reason)
        logger.info("%s: %s -> %s (%s)", cell.server_id, change.from_state, change.to_state, reason)
        if self._observer is not None:
            self._observer.state_changed(change)

    async def _bring_up(self, cell: ServerCell, checkpoint: Path, *, restart: bool, fence: int | None = None) -> None:
        """Launch, wait healthy, confirm the checksum against what should be there, admit."""
        self._apply(cell, ServerState.STARTING, "restart" if restart else "start")
        try:
            url = await self._launch(cell, checkpoint)
        except MilesError as exc:
            self._apply(cell, ServerState.RESTARTING, f"launch failed: {exc.message}")
            raise RolloutError(f"engine failed to start: {exc}", server_id=cell.server_id) from exc
        cell.url = url
        cell.incarnation += 1
        cell.consecutive_failures = 0
        cell.last_probe = None
        secret = self.spec.engine_secret.get_secret_value() if self.spec.engine_secret else None
        self._clients[cell.server_id] = EngineClient(url, http=self.http, server_id=cell.server_id, secret=secret)
        self._apply(cell, ServerState.PENDING_WEIGHTS, "engine healthy")
        expected = cell.verified or await self._initial_weights(checkpoint)
        client = self._clients[cell.server_id]
        try:
            # Confirm first, rename after: a label is only moved onto weights proven to be the
            # verified ones, so an engine that came up on other weights reports its own version.
            confirmed = await self.confirm(cell.server_id, fence=fence)
            if confirmed.checksum == expected.checksum and confirmed.weight_version != expected.weight_version:
                # A checkpoint's manifest carries its own version; restore the one it was admitted as.
                await client.update_weight_version(expected.weight_version, fence=fence)
        except EngineCallError as exc:
            # Leave the cell restarting so the health loop tries again, rather than stuck pending.
            self._apply(cell, ServerState.RESTARTING, f"engine stopped answering after start: {exc.message}")
            raise RolloutError(f"engine failed after start: {exc}", server_id=cell.server_id) from exc
        if confirmed.checksum != expected.checksum:
            self._apply(
                cell,
                ServerState.QUARANTINED,
                f"started on {confirmed.weight_version} ({confirmed.checksum}), not the verified "
                f"{expected.weight_version} ({expected.checksum}): those weights could not be found",
            )
            raise RolloutError(
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

    async def _initial_weights(self, checkpoint: Path) -> VerifiedWeights:
        """What the start checkpoint holds: its manifest's version and checksum when sealed.

        A plain Hugging Face directory (a base model as downloaded, ``save_pretrained`` output) is
        what the operator chose to start from: its checksum is computed from its files, once, and
        it serves as version "0", so that every published step is newer.
        """
        manifest = _manifest_or_none(checkpoint)
        if manifest is not None:
            return VerifiedWeights(
                checkpoint=checkpoint, weight_version=manifest.weight_version, checksum=manifest.checksum, step=manifest.step
            )
        try:
            checksum = await asyncio.to_thread(model_checksum, checkpoint)
        except CheckpointError as exc:
            raise RolloutError(
                f"the start checkpoint has no miles manifest and its weights cannot be hashed: {exc.message}",
                checkpoint=str(checkpoint),
            ) from exc
        return VerifiedWeights(checkpoint=checkpoint, weight_version=PLAIN_START_VERSION, checksum=checksum, step=0)

    async def _resume_quietly(self, cell: ServerCell, *, fence: int | None) -> None:
        try:
            await self.client(cell.server_id).continue_generation(fence=fence)
        except EngineCallError as exc:
            logger.warning("could not resume %s after rollback: %s", cell.server_id, exc)

    def set_health(self, health: HealthSettings) -> None:
        """Apply new probe settings now: the loop's current wait ends and the next uses them."""
        self.spec = self.spec.model_copy(update={"health": health})
        self._wake.set()

    async def _health_loop(self) -> None:
        while True:
            try:
                # A changed interval or a suspected server ends the wait early (``_wake``).
                await asyncio.wait_for(self._wake.wait(), timeout=self.spec.health.interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            for cell in self._cells:
                try:
                    await self._probe(cell)
                except Exception:
                    # The loop must outlive any one failed probe or restart; the next tick retries.
                    logger.exception("health check of %s failed", cell.server_id)

    async def _probe(self, cell: ServerCell) -> None:
        if cell.state is ServerState.QUARANTINED:
            await self._recover_guarded(cell)
            return
        if cell.state not in (ServerState.SERVING, ServerState.PENDING_WEIGHTS, ServerState.RESTARTING):
            return  # probes pause while a server starts, updates or is stopped
        if cell.state is ServerState.RESTARTING or not self._alive(cell):
            await self._restart_guarded(cell, "engine process exited" if cell.state is ServerState.SERVING else "retry")
            return
        incarnation, verified = cell.incarnation, cell.verified
        started = time.monotonic()
        reported: WeightsIdentity | None = None
        error = None
        try:
            reported = await self.identity(cell.server_id)
        except EngineCallError as exc:
            error = exc.message
        if cell.incarnation != incarnation:
            return  # replaced while the probe was out; its answer describes an older process
        ok = reported is not None
        cell.last_probe = ProbeResult(at=time.time(), ok=ok, latency_s=time.monotonic() - started, error=error)
        cell.consecutive_failures = 0 if ok else cell.consecutive_failures + 1
        if self._observer is not None:
            self._observer.probed(cell.server_id)
        if cell.consecutive_failures >= self.spec.health.failure_threshold:
            await self._restart_guarded(cell, f"{cell.consecutive_failures} failed health checks in a row")
        elif reported is not None and cell.state is ServerState.SERVING and _drifted(verified, reported):
            await self._drift_guarded(cell, incarnation)

    async def _drift_guarded(self, cell: ServerCell, incarnation: int) -> None:
        """Quarantine, report and roll back a server whose engine holds other weights than verified."""
        async with self._exclusive(f"drift {cell.server_id}") as fence:
            # Re-check under the section: an update may have changed the weights on purpose
            # while we waited, or replaced the process; only a drift that is still there counts.
            verified = cell.verified
            if cell.state is not ServerState.SERVING or cell.incarnation != incarnation or verified is None:
                return
            try:
                reported = await self.identity(cell.server_id)
            except EngineCallError:
                return  # the failure counter and the next probe deal with an engine that stopped answering
            if not _drifted(verified, reported):
                return
            logger.error(
                "%s holds %s (%s) but was verified on %s (%s): its weights changed outside the controller",
                cell.server_id,
                reported.weight_version,
                reported.checksum,
                verified.weight_version,
                verified.checksum,
            )
            cell.weight_version, cell.checksum = reported.weight_version, reported.checksum or cell.checksum
            if self._observer is not None:
                self._observer.drifted(cell.server_id, cell.model_name, expected=verified, actual=reported)
            self._apply(
                cell,
                ServerState.QUARANTINED,
                f"weights changed outside the controller: the engine reports {reported.weight_version} "
                f"({reported.checksum}), verified was {verified.weight_version} ({verified.checksum})",
            )
            try:
                await self.rollback(cell.server_id, reason="weights changed outside the controller", fence=fence)
            except RolloutError as exc:
                logger.error("could not restore %s after its weights drifted: %s", cell.server_id, exc)

    async def _recover_guarded(self, cell: ServerCell) -> None:
        """Bring a quarantined server back once its verified weights can be found again.

        A server quarantined outside an update (restarted while its verified weights were on no
        disk and no peer held them) recovers as soon as a peer serves them again.
        """
        if cell.verified is None:
            return
        alive = self._alive(cell)
        if alive and cell.verified.checkpoint is None and self._peer_holding(cell) is None:
            return  # nothing to recover from yet; checked again at the next tick
        async with self._exclusive(f"recover {cell.server_id}") as fence:
            if cell.state is not ServerState.QUARANTINED:
                return  # an update took it over while we waited
            try:
                if self._alive(cell):
                    await self.rollback(cell.server_id, reason="its verified weights are available again", fence=fence)
                else:
                    await self.restart(cell.server_id, reason="engine process exited while quarantined", fence=fence)
            except RolloutError as exc:
                logger.warning("recovery of %s failed (will retry): %s", cell.server_id, exc)

    def _peer_holding(self, cell: ServerCell) -> ServerCell | None:
        """A serving peer verified on the same weights as ``cell`` (same checksum)."""
        verified = cell.verified
        if verified is None:
            return None
        for peer in self._cells:
            if (
                peer is not cell
                and peer.state is ServerState.SERVING
                and peer.verified is not None
                and peer.verified.checksum == verified.checksum
            ):
                return peer
        return None

    async def _source_of(self, cell: ServerCell, *, fence: int | None) -> Path | None:
        """A checkpoint directory holding ``cell``'s verified weights, or None if there is none.

        Its own verified checkpoint when it has one; otherwise a serving peer holding the same
        checksum writes them out (and every server verified on them remembers that checkpoint).
        """
        verified = cell.verified
        if verified is None:
            return None
        if verified.checkpoint is not None:
            return verified.checkpoint
        peer = self._peer_holding(cell)
        if peer is None:
            return None
        try:
            exported = await self.export(peer.server_id, step=verified.step or 0, fence=fence)
        except EngineCallError as exc:
            logger.warning("%s could not write out its weights for %s: %s", peer.server_id, cell.server_id, exc)
            return None
        if exported.checksum != verified.checksum:
            logger.warning("%s wrote weights %s, not the verified %s", peer.server_id, exported.checksum, verified.checksum)
            return None
        self.remember_checkpoint(verified.checksum, exported.path)
        return exported.path

    async def _restart_guarded(self, cell: ServerCell, reason: str) -> None:
        async with self._exclusive(f"restart {cell.server_id}") as fence:
            # Re-check under the section: an update may have replaced or stopped it meanwhile.
            healthy = self._alive(cell) and cell.consecutive_failures < self.spec.health.failure_threshold
            if cell.state is ServerState.STOPPED or (cell.state is ServerState.SERVING and healthy):
                return
            if cell.state not in (ServerState.SERVING, ServerState.PENDING_WEIGHTS, ServerState.RESTARTING):
                return  # an update took it over while we waited; it owns the cell now
            try:
                await self.restart(cell.server_id, reason=reason, fence=fence)
            except RolloutError as exc:
                logger.error("restart of %s failed (will retry): %s", cell.server_id, exc)


def _drifted(verified: VerifiedWeights | None, reported: WeightsIdentity) -> bool:
    """Whether an engine's report differs from the weights verified on it (version or checksum)."""
    if verified is None:
        return False
    if reported.weight_version != verified.weight_version:
        return True
    return reported.checksum is not None and reported.checksum != verified.checksum


def _manifest_or_none(checkpoint: Path):  # noqa: ANN202 - Manifest | None
    try:
        return read_manifest(checkpoint)
    except CheckpointError:
        return None

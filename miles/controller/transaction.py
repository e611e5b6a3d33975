"""WeightUpdate: one update of one model's servers, the protocol's steps 4-7 written once.

It exists only while the controller's lock is held, and records each server's failure in its
``ServerStep`` rather than raising it (docs/ARCHITECTURE.md, "The life of an update").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from miles.config import UpdatePauseMode
from miles.controller.plans import Plan, Target
from miles.controller.results import ServerOutcome, ServerStep, UpdateMode, UpdateResult, UpdateStatus
from miles.controller.router import Router
from miles.errors import MilesError
from miles.protocol.sglang import PauseMode
from miles.protocol.sglang_weights import UpdateWeightsResponse
from miles.rollout.engine_client import EngineCallError, WeightsChecksum
from miles.rollout.mixed import ModelRollout
from miles.rollout.state import ServerSnapshot, ServerState
from miles.utils.weight_version import newest, version_number
from miles.weights.checksum import ALGORITHM

logger = logging.getLogger("miles.controller")


@dataclass
class ServerProgress:
    step: ServerStep = ServerStep.PENDING
    error: str | None = None
    # Seconds per phase of the server's load, as it reported them.
    load_timings: dict[str, float] = field(default_factory=dict)
    # The checksum the server computed over its live weights right after loading, if it said.
    reported: WeightsChecksum | None = None
    confirmed: str | None = None
    # What the checkpoint's own bytes hash to, when a refusing server computed it (plain directory).
    checkpoint_checksum: str | None = None
    # The controller paused the engine's generation (take_out), so admitting it resumes it; an
    # engine taken out without a pause pauses and resumes itself around a staged swap.
    paused: bool = False

    def fail(self, step: ServerStep, error: str) -> None:
        """End the server's part in the update (failed or crashed); its first error stands."""
        self.step = step
        self.error = self.error or error


class UpdateEvents(Protocol):
    """Where an update reports what it saw (the controller logs them as typed events)."""

    def confirmed(self, update: WeightUpdate, server_id: str, checksum: str) -> None: ...

    def mismatch(self, update: WeightUpdate, server_id: str, actual: str) -> None: ...


class WeightUpdate:
    def __init__(
        self,
        *,
        token: int,
        rollout: ModelRollout,
        router: Router,
        events: UpdateEvents,
        mode: UpdateMode,
        pause_mode: UpdatePauseMode,
        started: float | None = None,
    ) -> None:
        self.update_id = uuid.uuid4().hex[:12]
        self.token = token
        self.rollout = rollout
        self.router = router
        self.events = events
        self.mode = mode
        self.pause_mode = pause_mode
        self.started = started if started is not None else time.monotonic()
        self.model_name = rollout.model_name
        # Read now, under the lock: what an update queued ahead of this one committed is already
        # here, so "newer than what serves" can never be decided on a stale value.
        self.previous_version = _verified_version(rollout)
        # What a new version must be newer than: the version served, or the highest integer one
        # committed before it when that is higher (or when what serves is no integer).
        self.version_to_beat = _to_beat(self.previous_version, rollout.committed_high)
        self.target: Target | None = None
        self.progress: dict[str, ServerProgress] = {sid: ServerProgress() for sid in rollout.server_ids}
        # Seconds spent in each phase (lock_wait, validate, pause, load, confirm, commit, rollback ...),
        # summed over batches: the result's timings.
        self.phases: dict[str, float] = {}
        # The router's running total of gate-closed time at the start: the result reports the
        # difference, how long this update held the model's requests.
        self._blocked_before = router.blocked_seconds(self.model_name)

    # --- what the update installs ----------------------------------------------------------------

    def set_target(self, target: Target) -> None:
        """Fix the weights this update installs (once: the gate's or training's decision)."""
        if self.target is not None:
            raise MilesError("an update's target weights are decided once", update_id=self.update_id)
        self.target = target

    @property
    def weight_version(self) -> str:
        return self.target.weight_version if self.target else "pending"

    @property
    def step(self) -> int | None:
        return self.target.step if self.target else None

    @property
    def expected_checksum(self) -> str | None:
        return self.target.checksum if self.target else None

    @property
    def checkpoint(self) -> Path | None:
        return self.target.checkpoint if self.target else None

    @property
    def server_ids(self) -> list[str]:
        return self.rollout.server_ids

    # --- the protocol's steps ------------------------------------------------------------------

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the time spent inside to ``phases[phase]`` (reported in the result's timings)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.monotonic() - started

    async def take_out(self, server_ids: list[str], *, pause: bool = True) -> None:
        """Stop routing to the servers, then pause them unless ``pause`` is False (their engines
        pause themselves for a staged swap). Servers already out or whose engines died are left."""
        server_ids = [sid for sid in server_ids if self.progress[sid].step is ServerStep.PENDING]
        for server_id in server_ids:
            self.rollout.begin_update(server_id, reason=f"update {self.update_id} to {self.weight_version}")
            self.progress[server_id].step = ServerStep.TAKEN_OUT
            self.progress[server_id].paused = pause
        self.router.fleet_changed()
        if not pause:
            return
        mode = PauseMode(self.pause_mode.value)
        with self.timed("pause"):
            await self._each(server_ids, "pause", lambda sid: self.rollout.pause(sid, mode, fence=self.token))

    async def load(self, server_ids: list[str]) -> None:
        """Have each server load the target's checkpoint; it verifies the bytes before touching its weights."""
        target = self._target()
        if (checkpoint := target.checkpoint) is None:
            raise MilesError("weights a window pushed have no checkpoint to load", update_id=self.update_id)

        async def one(server_id: str) -> None:
            answer = await self.rollout.load(
                server_id,
                checkpoint,
                weight_version=target.weight_version,
                expected_checksum=target.checksum,
                fence=self.token,
            )
            self._loaded(server_id, answer, refused="load refused")

        with self.timed("load"):
            await self._each(self._healthy(server_ids), "load", one)

    async def activate(self, server_ids: list[str]) -> None:
        """Have each server serve the weights a window pushed into its stage. A server not paused
        pauses, swaps and resumes in one call: generation stops for the swap, not three round trips."""
        target = self._target()

        async def one(server_id: str) -> None:
            answer = await self.rollout.activate(
                server_id,
                weight_version=target.weight_version,
                expected_checksum=target.checksum,
                pause_mode=None if self.progress[server_id].paused else PauseMode(self.pause_mode.value),
                fence=self.token,
            )
            self._loaded(server_id, answer, refused="activation refused")

        with self.timed("load"):
            await self._each(self._healthy(server_ids), "activate", one)

    def _loaded(self, server_id: str, answer: UpdateWeightsResponse, *, refused: str) -> None:
        note = self.progress[server_id]
        note.load_timings = dict(answer.timings)
        if not answer.success:
            note.step, note.error = ServerStep.REFUSED, f"{refused}: {answer.message}"
            note.checkpoint_checksum = answer.checkpoint_checksum
            return
        note.step = ServerStep.LOADED
        if answer.checksum is not None and answer.weight_version is not None:
            note.reported = WeightsChecksum(
                checksum=answer.checksum, algorithm=ALGORITHM, weight_version=answer.weight_version
            )

    async def confirm(self, server_ids: list[str]) -> None:
        """Get each server's checksum of what it holds; only an exact match is confirmed.

        A server whose load answer carried the checksum of its live weights is not asked again:
        hashing the model again moments later would repeat the same measurement."""
        target = self._target()

        async def one(server_id: str) -> None:
            note = self.progress[server_id]
            if note.reported is not None:
                confirmed = self.rollout.record_checksum(server_id, note.reported)
            else:
                confirmed = await self.rollout.confirm(server_id, fence=self.token)
            note.confirmed = confirmed.checksum
            self.events.confirmed(self, server_id, confirmed.checksum)
            if confirmed.checksum != target.checksum:
                note.step = ServerStep.MISMATCHED
                note.error = f"checksum mismatch: expected {target.checksum}, server holds {confirmed.checksum}"
                self.rollout.quarantine(server_id, reason=note.error)
                self.events.mismatch(self, server_id, confirmed.checksum)
                return
            if confirmed.weight_version != target.weight_version:
                # Pushed weights carry whatever label the pusher gave them; the engine must serve
                # them under the committed version, so its answers and the health report agree.
                await self.rollout.relabel(server_id, target.weight_version, fence=self.token)
            note.step = ServerStep.CONFIRMED

        with self.timed("confirm"):
            await self._each(self._healthy(server_ids), "confirm", one)

    async def admit(self, server_ids: list[str]) -> None:
        """Readmit confirmed servers at the new version and let them generate again."""
        target = self._target()
        verified = target.verified()
        with self.timed("commit"):
            for server_id in server_ids:
                self.rollout.admit(server_id, verified, reason=f"checksum confirmed for {target.weight_version}")
                self.progress[server_id].step = ServerStep.ADMITTED
            paused = [sid for sid in server_ids if self.progress[sid].paused]
            await self._each(paused, "resume", lambda sid: self.rollout.resume(sid, fence=self.token))
        self.router.fleet_changed()

    async def restart_crashed(self, server_ids: list[str]) -> None:
        """Bring servers whose engines died back on the weights the update committed; a restart
        that fails is recorded, and the supervisor brings the server up on those weights later."""
        target = self._target()
        verified = target.verified()

        async def one(server_id: str) -> None:
            note = self.progress[server_id]
            try:
                await self.rollout.restart_on(
                    server_id, verified, reason=f"its engine died during update {self.update_id}", fence=self.token
                )
            except MilesError as exc:
                note.error = f"{note.error}; restarting it on {target.weight_version} failed: {exc.message}"
                return
            note.step = ServerStep.ADMITTED
            note.error = f"{note.error}; restarted on {target.weight_version}, checksum confirmed"

        with self.timed("restart"):
            await asyncio.gather(*(one(sid) for sid in server_ids))
        self.router.fleet_changed()

    async def roll_back(self, server_ids: list[str], *, reason: str) -> None:
        """Put servers back on their last verified weights (they serve those again)."""

        async def one(server_id: str) -> None:
            if self.rollout.cell(server_id).state in _MID_UPDATE:
                await self.rollout.rollback(server_id, reason=reason, fence=self.token)
            if self.progress[server_id].step is not ServerStep.PENDING:
                self.progress[server_id].step = ServerStep.RESTORED

        with self.timed("rollback"):
            results = await asyncio.gather(*(one(sid) for sid in server_ids), return_exceptions=True)
        for server_id, outcome in zip(server_ids, results, strict=True):
            if isinstance(outcome, BaseException):
                logger.error("could not restore %s: %s", server_id, outcome)
                note = self.progress[server_id]
                note.error = f"{note.error or ''}; restore failed: {outcome}".strip("; ")
        self.router.fleet_changed()

    async def heal(self) -> None:
        """Put servers a failed operation left updating or quarantined back on verified weights; open the gate."""
        if stuck := [s.server_id for s in self.rollout.snapshot() if s.state in _MID_UPDATE]:
            logger.warning("restoring %s left mid-update", ", ".join(stuck))
            await asyncio.gather(
                *(self.rollout.rollback(sid, reason="recovered mid-update", fence=self.token) for sid in stuck),
                return_exceptions=True,
            )
        if not self.router.gate_open(self.model_name):
            self.router.open_gate(self.model_name)

    # --- what happened -------------------------------------------------------------------------

    def refused_by_all(self, server_ids: list[str]) -> bool:
        """Whether every server that did not crash refused the weights (nothing changed)."""
        live = self.live(server_ids)
        return bool(live) and all(self.progress[sid].step is ServerStep.REFUSED for sid in live)

    def loaded(self, server_id: str) -> bool:
        return self.progress[server_id].step is ServerStep.LOADED

    def confirmed(self, server_ids: list[str]) -> list[str]:
        return [sid for sid in server_ids if self.progress[sid].step is ServerStep.CONFIRMED]

    def crashed(self, server_ids: list[str]) -> list[str]:
        return [sid for sid in server_ids if self.progress[sid].step is ServerStep.CRASHED]

    def live(self, server_ids: list[str]) -> list[str]:
        return [sid for sid in server_ids if self.progress[sid].step is not ServerStep.CRASHED]

    def failed(self, server_ids: list[str]) -> list[str]:
        """The servers that did not confirm the new weights, not counting those that crashed: a
        crash fails no update, the server restarts on its outcome."""
        return [
            sid
            for sid in self.live(server_ids)
            if self.progress[sid].step not in (ServerStep.CONFIRMED, ServerStep.ADMITTED)
        ]

    def checkpoint_checksums(self) -> set[str]:
        """What refusing servers computed the checkpoint's weights to hash to."""
        return {n.checkpoint_checksum for n in self.progress.values() if n.checkpoint_checksum}

    def result(self, status: UpdateStatus, *, message: str = "") -> UpdateResult:
        outcomes = tuple(self._outcome(snap) for snap in self.rollout.snapshot())
        if not message:
            message = _DEFAULT_MESSAGES[status].format(version=self.weight_version)
            if failures := [f"{o.server_id}: {o.error}" for o in outcomes if o.error]:
                message = f"{message}: " + "; ".join(failures)
        target = self.target
        loaded = sum(1 for o in outcomes if o.loaded)
        return UpdateResult(
            **{name: getattr(self, name) for name in _IN_RESULT},
            status=status,
            checkpoint=str(target.checkpoint) if target and target.checkpoint else None,
            checksum_source=target.source if target else None,
            strategy=self.mode,
            servers=outcomes,
            message=message,
            duration_s=time.monotonic() - self.started,
            timings=dict(self.phases),
            serving_blocked_s=max(self.router.blocked_seconds(self.model_name) - self._blocked_before, 0.0),
            bytes_moved=target.num_bytes * loaded if target and target.num_bytes is not None else None,
            fencing_token=self.token,
        )

    # --- the one pipeline ---------------------------------------------------------------------

    async def run(self, plan: Plan) -> UpdateStatus:
        """Per batch of the plan's schedule: take the servers out, load, confirm, admit or roll back.

        Every server refusing changed nothing: REJECTED. An all-or-nothing schedule rolls every
        server back on any failure (ROLLED_BACK); otherwise the first failure halts and servers
        already moved keep the new version (PARTIAL). Servers whose engines died come back on the
        committed weights once their peers serve them."""
        schedule, source = plan.schedule, plan.source
        if schedule.holds_requests:
            self.router.close_gate(self.model_name)
        committed: list[str] = []
        try:
            for batch in schedule.batches(self.server_ids):
                await self.take_out(batch, pause=source.pauses)
                await source.load(self, batch)
                if not committed and source.refusable and self.refused_by_all(batch):
                    await self.roll_back(batch, reason=f"update {self.update_id} refused by every server")
                    return UpdateStatus.REJECTED
                await self.confirm(batch)
                good, bad = self.confirmed(batch), self.failed(batch)
                why = ", ".join(bad) or "every server's engine died"
                if schedule.all_or_nothing and (bad or not good):
                    # A barrier never leaves the fleet on two versions.
                    await self.roll_back(batch, reason=f"update {self.update_id} failed on {why}")
                    return UpdateStatus.ROLLED_BACK
                if good:
                    await self.admit(good)
                    committed.extend(good)
                if schedule.holds_requests:
                    # Requests flow again as soon as the new version serves, before any restart.
                    self.router.open_gate(self.model_name)
                if bad or not committed:
                    # Servers whose engines died go back with the failed ones, on their verified weights.
                    await self.roll_back(bad + self.crashed(batch), reason=f"update {self.update_id} failed on {why}")
                    return UpdateStatus.PARTIAL if committed else UpdateStatus.ROLLED_BACK
                await self.restart_crashed(self.crashed(batch))
            return UpdateStatus.COMMITTED
        finally:
            if schedule.holds_requests and not self.router.gate_open(self.model_name):
                self.router.open_gate(self.model_name)

    # --- internals -----------------------------------------------------------------------------

    def _target(self) -> Target:
        if self.target is None:
            raise MilesError("an update cannot load or confirm before its target weights are decided")
        return self.target

    def _healthy(self, server_ids: list[str]) -> list[str]:
        # Every server that failed, refused, mismatched or crashed has an error.
        return [sid for sid in server_ids if self.progress[sid].error is None]

    async def _each(self, server_ids: list[str], action: str, call: Callable[[str], Awaitable[object]]) -> None:
        """Run ``call`` on every server at once; a failure is recorded on its server, not raised."""

        async def guarded(server_id: str) -> None:
            try:
                await call(server_id)
            except MilesError as exc:
                await self.record_failure(server_id, action, exc)

        await asyncio.gather(*(guarded(sid) for sid in server_ids))

    async def record_failure(self, server_id: str, action: str, exc: MilesError) -> bool:
        """Record that ``action`` failed on the server: a crash when nobody answered and its
        engine's process has ended (True), else a failure (False)."""
        note = self.progress[server_id]
        if isinstance(exc, EngineCallError) and exc.status_code is None and await self.rollout.died(server_id):
            logger.warning("update %s: the engine of %s died (%s failed: %s)", self.update_id, server_id, action, exc)
            note.fail(ServerStep.CRASHED, f"its engine died ({action} failed: {exc.message})")
            # Out of routing at once (a staged window's servers serve meanwhile); restarted by
            # ``restart_crashed`` on a commit, else by the supervisor once the lock is free.
            self.rollout.lost(server_id, reason=f"its engine died during update {self.update_id}")
            self.router.fleet_changed()
            return True
        logger.warning("update %s: %s failed on %s: %s", self.update_id, action, server_id, exc)
        note.fail(ServerStep.FAILED, f"{action} failed: {exc.message}")
        return False

    def _outcome(self, snap: ServerSnapshot) -> ServerOutcome:
        note = self.progress.get(snap.server_id, ServerProgress())
        return ServerOutcome(
            **{name: getattr(snap, name) for name in ("server_id", "state", "weight_version", "checksum")},
            loaded=note.step in _LOADED or note.reported is not None,
            confirmed_checksum=note.confirmed,
            matched=None if note.confirmed is None else note.confirmed == self.expected_checksum,
            error=note.error,
            load_timings=note.load_timings,
            progress=note.step,
        )


# What an update's result takes from it as it is.
_IN_RESULT = "update_id model_name weight_version previous_version step expected_checksum pause_mode".split()
# The states an update leaves a server in until it admits or restores it.
_MID_UPDATE = (ServerState.UPDATING, ServerState.QUARANTINED)
_LOADED = frozenset({ServerStep.LOADED, ServerStep.CONFIRMED, ServerStep.MISMATCHED, ServerStep.ADMITTED})

_DEFAULT_MESSAGES = {
    UpdateStatus.COMMITTED: "every server verified and serving {version}",
    UpdateStatus.REJECTED: "every server refused the checkpoint before touching its weights",
    UpdateStatus.ROLLED_BACK: "rolled back to verified weights",
    UpdateStatus.PARTIAL: "halted part-way; some servers serve the new version",
    UpdateStatus.ABORTED: "aborted; every server is back on its verified weights",
}


def _to_beat(serving: str | None, committed_high: int | None) -> str | None:
    numbers = [n for n in (version_number(serving), committed_high) if n is not None]
    return str(max(numbers)) if numbers else serving


def _verified_version(rollout: ModelRollout) -> str | None:
    """The newest version any server of the rollout was verified on."""
    versions = [s.verified.weight_version for s in rollout.snapshot() if s.verified is not None]
    return newest(versions) or (versions[0] if len(set(versions)) == 1 else None)

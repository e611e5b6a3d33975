"""Steps 4-6 of the weight-update protocol, carried out on one Rollout's servers.

``UpdateRun`` takes servers out of routing and pauses them, has them load, collects the checksum
each reports for what it now holds, admits only the ones that match, and restores the others to
their last verified weights. ``run_barrier`` and ``run_rolling`` order those steps for the two
strategies. The caller (the controller) holds the lock; this module never touches it.

Every per-server failure (an engine that refuses, dies or times out) is recorded on that server's
outcome rather than raised, so one bad server cannot leave the others paused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from miles.config import UpdatePauseMode, UpdateStrategy
from miles.controller.results import ChecksumSource, ServerOutcome, UpdateResult, UpdateStatus
from miles.controller.router import Router
from miles.errors import MilesError
from miles.protocol.sglang import PauseMode
from miles.rollout.engine_client import WeightsChecksum
from miles.rollout.rollout import Rollout
from miles.rollout.state import ServerState, VerifiedWeights

logger = logging.getLogger("miles.controller")


@dataclass(frozen=True)
class UpdatePlan:
    """What one update is meant to achieve (decided and validated before any server is touched)."""

    update_id: str
    model_name: str
    weight_version: str
    step: int
    checkpoint: Path | None
    expected_checksum: str | None
    checksum_source: ChecksumSource | None
    strategy: UpdateStrategy
    pause_mode: UpdatePauseMode
    previous_version: str | None


class ProtocolEvents(Protocol):
    """Where the run reports what it saw (the controller logs them as typed events)."""

    def confirmed(self, plan: UpdatePlan, server_id: str, checksum: str) -> None: ...

    def mismatch(self, plan: UpdatePlan, server_id: str, actual: str) -> None: ...


@dataclass
class _Progress:
    loaded: bool = False
    confirmed: str | None = None
    matched: bool | None = None
    error: str | None = None
    load_timings: dict[str, float] = field(default_factory=dict)
    # The checksum the server computed over its live weights right after loading, if it said.
    reported: WeightsChecksum | None = None
    # What the checkpoint's own bytes hash to, when the server computed it (a plain directory).
    checkpoint_checksum: str | None = None


@dataclass
class UpdateRun:
    plan: UpdatePlan
    server: Rollout
    router: Router
    events: ProtocolEvents
    progress: dict[str, _Progress] = field(default_factory=dict)

    def _note(self, server_id: str) -> _Progress:
        return self.progress.setdefault(server_id, _Progress())

    async def take_out(self, server_ids: list[str]) -> None:
        """Stop routing to the servers, then pause them (in-flight work per the pause mode)."""
        for server_id in server_ids:
            self.server.begin_update(server_id, reason=f"update {self.plan.update_id} to {self.plan.weight_version}")
            self._note(server_id)
        self.router.fleet_changed()
        mode = PauseMode(self.plan.pause_mode.value)
        await asyncio.gather(*(self._guard(sid, "pause", self.server.pause(sid, mode)) for sid in server_ids))

    async def load(self, server_ids: list[str], checkpoint: Path) -> None:
        async def one(server_id: str) -> None:
            assert self.plan.expected_checksum is not None
            response = await self.server.load(
                server_id, checkpoint, weight_version=self.plan.weight_version, expected_checksum=self.plan.expected_checksum
            )
            note = self._note(server_id)
            note.load_timings = dict(response.timings)
            note.checkpoint_checksum = response.checkpoint_checksum
            if response.success:
                note.loaded = True
                if response.checksum is not None and response.weight_version is not None:
                    note.reported = WeightsChecksum(
                        checksum=response.checksum, algorithm="xxh3_128", weight_version=response.weight_version
                    )
            else:
                self._note(server_id).error = f"load refused: {response.message}"

        await asyncio.gather(*(self._guard(sid, "load", one(sid)) for sid in self._healthy(server_ids)))

    async def confirm(self, server_ids: list[str], expected: str) -> None:
        """Get each server's checksum of what it holds; record whether it matches.

        A server whose load answer carried the checksum it computed over its live weights after
        the copy (the embedded engine does) is not asked again: hashing the whole model a second
        time moments later would only repeat the same measurement. Others (a window's pushes, a
        server whose load answer had none) are asked through ``/weights_checker``.
        """

        async def one(server_id: str) -> None:
            note = self._note(server_id)
            if note.reported is not None:
                confirmed = self.server.record_checksum(server_id, note.reported)
            else:
                confirmed = await self.server.confirm(server_id)
            note.confirmed = confirmed.checksum
            note.matched = confirmed.checksum == expected
            self.events.confirmed(self.plan, server_id, confirmed.checksum)
            if not note.matched:
                note.error = f"checksum mismatch: expected {expected}, server holds {confirmed.checksum}"
                self.server.quarantine(server_id, reason=note.error)
                self.events.mismatch(self.plan, server_id, confirmed.checksum)
            elif confirmed.weight_version != self.plan.weight_version:
                # Pushed weights carry whatever label the pusher gave them; the engine must serve
                # them under the committed version, so its answers and the health report agree.
                note.matched = False
                await self.server.relabel(server_id, self.plan.weight_version)
                note.matched = True

        await asyncio.gather(*(self._guard(sid, "confirm", one(sid)) for sid in self._healthy(server_ids)))

    def checkpoint_checksums(self) -> set[str]:
        """What servers that refused the checkpoint computed its weights to hash to."""
        return {n.checkpoint_checksum for n in self.progress.values() if n.checkpoint_checksum and not n.loaded}

    def refused_by_all(self, server_ids: list[str]) -> bool:
        """Whether every server answered the load with a refusal (none of them loaded anything)."""
        notes = [self._note(sid) for sid in server_ids]
        return all(not n.loaded and n.error is not None and n.error.startswith("load refused") for n in notes)

    def matched(self, server_ids: list[str]) -> list[str]:
        return [sid for sid in server_ids if self._note(sid).matched]

    def failed(self, server_ids: list[str]) -> list[str]:
        return [sid for sid in server_ids if not self._note(sid).matched]

    async def admit(self, server_ids: list[str], checksum: str) -> None:
        """Readmit verified servers at the new version and let them generate again."""
        verified = VerifiedWeights(
            # None for a window's pushed weights: they are on no disk until a copy is written.
            checkpoint=self.plan.checkpoint,
            weight_version=self.plan.weight_version,
            checksum=checksum,
            step=self.plan.step,
        )
        for server_id in server_ids:
            self.server.admit(server_id, verified, reason=f"checksum confirmed for {self.plan.weight_version}")
        await asyncio.gather(*(self._guard(sid, "resume", self.server.resume(sid)) for sid in server_ids))
        self.router.fleet_changed()

    async def restore(self, server_ids: list[str], *, reason: str) -> None:
        """Put servers back on their last verified weights (they serve those again)."""

        async def one(server_id: str) -> None:
            if self.server.cell(server_id).state in (ServerState.UPDATING, ServerState.QUARANTINED):
                await self.server.rollback(server_id, reason=reason)

        results = await asyncio.gather(*(one(sid) for sid in server_ids), return_exceptions=True)
        for server_id, result in zip(server_ids, results, strict=True):
            if isinstance(result, BaseException):
                logger.error("could not restore %s: %s", server_id, result)
                self._note(server_id).error = f"{self._note(server_id).error or ''}; restore failed: {result}".strip("; ")
        self.router.fleet_changed()

    def outcomes(self) -> tuple[ServerOutcome, ...]:
        outcomes = []
        for snap in self.server.snapshot():
            note = self.progress.get(snap.server_id, _Progress())
            outcomes.append(
                ServerOutcome(
                    server_id=snap.server_id,
                    state=snap.state.value,
                    weight_version=snap.weight_version,
                    checksum=snap.checksum,
                    loaded=note.loaded,
                    confirmed_checksum=note.confirmed,
                    matched=note.matched,
                    error=note.error,
                    load_timings=note.load_timings,
                )
            )
        return tuple(outcomes)

    def result(
        self, status: UpdateStatus, *, started: float, message: str = "", timings: dict[str, float] | None = None
    ) -> UpdateResult:
        """The run's ``UpdateResult``: its plan, every server's outcome, and a message."""
        plan = self.plan
        outcomes = self.outcomes()
        if not message:
            message = {
                UpdateStatus.COMMITTED: f"every server verified and serving {plan.weight_version}",
                UpdateStatus.REJECTED: "every server refused the checkpoint before touching its weights",
                UpdateStatus.ROLLED_BACK: "rolled back to verified weights",
                UpdateStatus.PARTIAL: "halted part-way; some servers serve the new version",
            }.get(status, status.value)
            failures = [f"{o.server_id}: {o.error}" for o in outcomes if o.error]
            if failures:
                message = f"{message}: " + "; ".join(failures)
        return UpdateResult(
            update_id=plan.update_id,
            status=status,
            model_name=plan.model_name,
            weight_version=plan.weight_version,
            previous_version=plan.previous_version,
            step=plan.step,
            checkpoint=str(plan.checkpoint) if plan.checkpoint else None,
            expected_checksum=plan.expected_checksum,
            checksum_source=plan.checksum_source,
            strategy=plan.strategy.value,
            pause_mode=plan.pause_mode.value,
            servers=outcomes,
            message=message,
            duration_s=time.monotonic() - started,
            timings=timings or {},
        )

    def _healthy(self, server_ids: list[str]) -> list[str]:
        return [sid for sid in server_ids if self._note(sid).error is None]

    async def _guard(self, server_id: str, step: str, work: object) -> None:
        try:
            await work  # type: ignore[misc]
        except MilesError as exc:
            logger.warning("update %s: %s failed on %s: %s", self.plan.update_id, step, server_id, exc)
            note = self._note(server_id)
            note.error = note.error or f"{step} failed: {exc.message}"


async def run_barrier(run: UpdateRun, checkpoint: Path) -> UpdateStatus:
    """All servers switch together while requests wait at the router; any failure rolls all back."""
    ids = run.server.server_ids
    assert run.plan.expected_checksum is not None
    run.router.close_gate(run.plan.model_name)
    try:
        await run.take_out(ids)
        await run.load(ids, checkpoint)
        if run.refused_by_all(ids):
            # Every server refused the checkpoint before touching its weights (its bytes do not
            # match the manifest): nothing changed, so the update is rejected, not rolled back.
            await run.restore(ids, reason=f"update {run.plan.update_id} refused by every server")
            return UpdateStatus.REJECTED
        await run.confirm(ids, run.plan.expected_checksum)
        if run.failed(ids):
            # All-or-nothing: a barrier update never leaves the fleet on two versions.
            await run.restore(ids, reason=f"update {run.plan.update_id} failed on {', '.join(run.failed(ids))}")
            return UpdateStatus.ROLLED_BACK
        await run.admit(ids, run.plan.expected_checksum)
        return UpdateStatus.COMMITTED
    finally:
        run.router.open_gate(run.plan.model_name)


async def run_rolling(run: UpdateRun, checkpoint: Path, *, batch_size: int) -> UpdateStatus:
    """At most ``batch_size`` servers leave the router at a time; the first failure halts."""
    ids = run.server.server_ids
    assert run.plan.expected_checksum is not None
    committed: list[str] = []
    for start in range(0, len(ids), batch_size):
        batch = ids[start : start + batch_size]
        await run.take_out(batch)
        await run.load(batch, checkpoint)
        if not committed and run.refused_by_all(batch):
            await run.restore(batch, reason=f"update {run.plan.update_id} refused by every server")
            return UpdateStatus.REJECTED
        await run.confirm(batch, run.plan.expected_checksum)
        good = run.matched(batch)
        if good:
            await run.admit(good, run.plan.expected_checksum)
            committed.extend(good)
        bad = run.failed(batch)
        if bad:
            await run.restore(bad, reason=f"update {run.plan.update_id} failed on {', '.join(bad)}")
            return UpdateStatus.PARTIAL if committed else UpdateStatus.ROLLED_BACK
    return UpdateStatus.COMMITTED


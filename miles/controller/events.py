"""The controller's typed events: what it, its lock, its servers and its updates log, in one place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from miles.config import SAFETY_SETTINGS, ControllerSettings
from miles.controller.results import UpdateResult
from miles.controller.transaction import WeightUpdate
from miles.rollout.engine_client import WeightsIdentity
from miles.rollout.state import StateChange, VerifiedWeights
from miles.utils.audit_utils.event_logger.logger import EventLogger
from miles.utils.audit_utils.event_logger.models import (
    ChecksumMismatchEvent,
    ChecksumRole,
    InferenceEngineWeightChecksumEvent,
    LockAcquiredEvent,
    LockReleasedEvent,
    ServerStateChangedEvent,
    SettingsChangedEvent,
    WeightsWrittenOutEvent,
    WeightUpdateAbortedEvent,
    WeightUpdateCommittedEvent,
    WeightUpdateStartedEvent,
)
from miles.utils.context_lock import LockTransition, LockTransitionKind

# What an ended update's event, committed or aborted, takes from its result as it is.
_AS_IN_RESULT = {"update_id", "model_name", "step", "duration_s", "timings", "serving_blocked_s"}
# What the events an update logs while it runs take from it as it is.
_AS_IN_UPDATE = ("update_id", "model_name", "weight_version", "step")


class ControllerEvents:
    def __init__(self, logger: EventLogger, *, fleet_changed: Callable[[], None]) -> None:
        self.logger = logger
        # Server states feed routing decisions: every change wakes requests waiting for a server.
        self._fleet_changed = fleet_changed

    # --- RolloutObserver -----------------------------------------------------------------------

    def state_changed(self, change: StateChange) -> None:
        # A StateChange carries exactly the event's fields (its states are read as their values).
        self.logger.log(ServerStateChangedEvent, asdict(change), print_log=False)
        self._fleet_changed()

    def weights_written_out(self, model_name: str, checksum: str, checkpoint: Path) -> None:
        fields = {"model_name": model_name, "checksum": checksum, "checkpoint": str(checkpoint)}
        self.logger.log(WeightsWrittenOutEvent, fields, print_log=False)

    def weights_restored(self, server_id: str, model_name: str, verified: VerifiedWeights) -> None:
        self._checksum(
            model_name, verified.checksum, verified.step or 0, verified.weight_version, server_id, ChecksumRole.RESTORED
        )

    def probed(self, server_id: str) -> None:
        # A probe that found a server answering again makes it routable for requests that had
        # excluded it; wake them rather than leave them to their next bounded re-check.
        self._fleet_changed()

    def drifted(self, server_id: str, model_name: str, *, expected: VerifiedWeights, actual: WeightsIdentity) -> None:
        """A serving engine's weights changed without the controller: a mismatch outside any update."""
        # An engine that keeps no checksum changed at least its version label.
        held = actual.checksum or f"unknown (version {actual.weight_version})"
        fields = {
            "model_name": model_name,
            "server_id": server_id,
            "step": expected.step,
            "weight_version": actual.weight_version,
            "expected": expected.checksum,
            "actual": held,
        }
        self.logger.log(ChecksumMismatchEvent, fields, print_log=True)

    # --- UpdateEvents --------------------------------------------------------------------------

    def confirmed(self, update: WeightUpdate, server_id: str, checksum: str) -> None:
        self._checksum(
            update.model_name, checksum, update.step or 0, update.weight_version, server_id, ChecksumRole.CONFIRMED
        )

    def mismatch(self, update: WeightUpdate, server_id: str, actual: str) -> None:
        fields = {name: getattr(update, name) for name in _AS_IN_UPDATE}
        fields |= {"server_id": server_id, "expected": update.expected_checksum or "", "actual": actual}
        self.logger.log(ChecksumMismatchEvent, fields, print_log=True)

    # --- the controller's own ------------------------------------------------------------------

    def published(self, model_name: str, checksum: str, step: int, weight_version: str) -> None:
        """Training's checksum, recorded on its behalf when it ends a window without logging one."""
        self._checksum(model_name, checksum, step, weight_version, None, ChecksumRole.PUBLISHED)

    def started(self, update: WeightUpdate) -> None:
        fields = {name: getattr(update, name) for name in _AS_IN_UPDATE}
        fields |= {
            "checkpoint": str(update.checkpoint) if update.checkpoint else None,
            "strategy": update.mode.value,
            "pause_mode": update.pause_mode.value,
            "server_ids": tuple(update.server_ids),
            "fencing_token": update.token,
        }
        self.logger.log(WeightUpdateStartedEvent, fields, print_log=False)

    def finished(self, result: UpdateResult) -> None:
        """A committed update, or one that ended any other way (with every server's version)."""
        fields = result.model_dump(include=_AS_IN_RESULT)
        fields["weight_version"] = result.weight_version or ""
        if result.ok:
            fields |= {
                "checksum": result.expected_checksum or "",
                "server_ids": tuple(o.server_id for o in result.servers),
                "checkpoint": result.checkpoint,
            }
            self.logger.log(WeightUpdateCommittedEvent, fields, print_log=False)
            return
        fields |= {
            "reason": f"{result.status.value}: {result.message}",
            "server_versions": {o.server_id: o.weight_version or "" for o in result.servers},
        }
        self.logger.log(WeightUpdateAbortedEvent, fields, print_log=False)

    def settings_changed(self, before: ControllerSettings, after: ControllerSettings) -> None:
        old, new = before.model_dump(mode="json"), after.model_dump(mode="json")
        changed = sorted(name for name in new if new[name] != old[name])
        if not changed:
            return
        safety = bool(SAFETY_SETTINGS.intersection(changed))
        fields = {"before": {n: old[n] for n in changed}, "after": {n: new[n] for n in changed}, "safety": safety}
        self.logger.log(SettingsChangedEvent, fields, print_log=safety)

    def lock_transition(self, transition: LockTransition) -> None:
        fields = {"lock_name": transition.lock_name, "holder": transition.holder, "token": transition.token}
        if transition.kind is LockTransitionKind.ACQUIRED:
            self.logger.log(LockAcquiredEvent, {**fields, "waited_s": transition.waited_s or 0.0}, print_log=False)
            return
        fields |= {"held_s": transition.held_s or 0.0, "reason": "released"}
        self.logger.log(LockReleasedEvent, fields, print_log=False)

    def _checksum(
        self, model_name: str, checksum: str, step: int, version: str | None, server_id: str | None, role: ChecksumRole
    ) -> None:
        fields = {
            "model_name": model_name,
            "checksum": checksum,
            "step": step,
            "weight_version": version,
            "server_id": server_id,
            "role": role,
        }
        self.logger.log(InferenceEngineWeightChecksumEvent, fields, print_log=False)

"""Weight updates read back from an event log as timelines: phases, server steps, outcome.

An update runs from its ``weight_update_started`` to its committed or aborted event (by
``update_id``); its servers' state changes, confirmations and mismatches between are its steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from pydantic import BaseModel, ConfigDict

from miles.utils.audit_utils.event_logger.models import (
    ChecksumMismatchEvent,
    ChecksumRole,
    Event,
    InferenceEngineWeightChecksumEvent,
    ServerStateChangedEvent,
    WeightUpdateAbortedEvent,
    WeightUpdateCommittedEvent,
    WeightUpdateStartedEvent,
    short_checksum,
)

# The order an update goes through its phases (``UpdateResult.timings``); ``transaction`` is the
# sum of those after the gate, so it is not one of them.
PHASE_ORDER = ("lock_wait", "validate", "transfer", "pause", "load", "confirm", "commit", "rollback")


class TimelineStep(BaseModel):
    model_config = ConfigDict(frozen=True)

    at_s: float  # seconds after the update started
    server_id: str | None
    what: str


class UpdateTimeline(BaseModel):
    """One update as its events tell it; ``status`` is ``running`` until it ends."""

    model_config = ConfigDict(frozen=True)

    update_id: str
    model_name: str
    weight_version: str
    strategy: str
    pause_mode: str
    server_ids: tuple[str, ...]
    started_at: datetime
    status: str
    duration_s: float | None
    serving_blocked_s: float | None
    # The phases in the order the update went through them, then any others.
    phases: dict[str, float]
    steps: tuple[TimelineStep, ...]
    message: str | None


def update_timelines(events: Iterable[Event]) -> list[UpdateTimeline]:
    """Every update that started in ``events`` (oldest first), ended or still running."""
    # Each update not yet ended: its started event and the steps seen since.
    open_: dict[str, tuple[WeightUpdateStartedEvent, list[TimelineStep]]] = {}
    done: list[UpdateTimeline] = []
    for event in events:
        if isinstance(event, WeightUpdateStartedEvent):
            open_[event.update_id] = (event, [])
        elif isinstance(event, WeightUpdateCommittedEvent | WeightUpdateAbortedEvent):
            building = open_.pop(event.update_id, None)
            if building is not None:
                done.append(_timeline(*building, end=event))
        else:
            for started, steps in open_.values():
                step = _step(event, started)
                if step is not None:
                    steps.append(step)
    done.extend(_timeline(started, steps) for started, steps in open_.values())
    return sorted(done, key=lambda t: t.started_at)


def ordered_phases(timings: dict[str, float]) -> dict[str, float]:
    known = {name: timings[name] for name in PHASE_ORDER if name in timings}
    others = {name: value for name, value in sorted(timings.items()) if name not in (*PHASE_ORDER, "transaction")}
    return known | others


def _timeline(
    started: WeightUpdateStartedEvent,
    steps: list[TimelineStep],
    end: WeightUpdateCommittedEvent | WeightUpdateAbortedEvent | None = None,
) -> UpdateTimeline:
    """The update as told so far: ``running`` until its ``end`` event."""
    status, message = "running", ""
    if isinstance(end, WeightUpdateCommittedEvent):
        status = "committed"
    elif end is not None:
        status, _, message = end.reason.partition(": ")
        status = status if status.isidentifier() else "aborted"
    return UpdateTimeline(
        update_id=started.update_id,
        model_name=started.model_name,
        weight_version=started.weight_version,
        strategy=started.strategy,
        pause_mode=started.pause_mode,
        server_ids=started.server_ids,
        started_at=started.timestamp,
        status=status,
        duration_s=None if end is None else end.duration_s,
        serving_blocked_s=None if end is None else end.serving_blocked_s,
        phases=ordered_phases({} if end is None else end.timings),
        steps=tuple(steps),
        message=message or None,
    )


def _step(event: Event, started: WeightUpdateStartedEvent) -> TimelineStep | None:
    at = (event.timestamp - started.timestamp).total_seconds()
    if isinstance(event, ServerStateChangedEvent) and event.server_id in started.server_ids:
        return TimelineStep(at_s=at, server_id=event.server_id, what=f"{event.from_state} -> {event.to_state}")
    if (
        isinstance(event, InferenceEngineWeightChecksumEvent)
        and event.role is ChecksumRole.CONFIRMED
        and event.server_id in started.server_ids
    ):
        return TimelineStep(at_s=at, server_id=event.server_id, what=f"confirmed {short_checksum(event.checksum)}")
    if isinstance(event, ChecksumMismatchEvent) and event.update_id == started.update_id:
        return TimelineStep(at_s=at, server_id=event.server_id, what=f"mismatch: {event.summary()}")
    return None

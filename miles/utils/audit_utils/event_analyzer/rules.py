"""The invariants an event log must satisfy, one small rule each, and the registry that lists them.

A rule reads events in timestamp order and yields a ``Finding`` per violation; add one to ``RULES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from miles.utils.audit_utils.event_analyzer.report import Finding
from miles.utils.audit_utils.event_logger.models import (
    ChecksumRole,
    Event,
    InferenceEngineWeightChecksumEvent,
    WeightUpdateCommittedEvent,
)
from miles.utils.weight_version import version_number

_K = TypeVar("_K")
_E = TypeVar("_E", WeightUpdateCommittedEvent, InferenceEngineWeightChecksumEvent)

RuleCheck = Callable[[Sequence[Event]], Iterable[Finding]]
"""Takes every event of a log in timestamp order and yields the violations it finds."""


@dataclass(frozen=True, slots=True)
class Rule:
    """A named invariant over an event log."""

    name: str
    description: str
    check: RuleCheck


CHECKSUM_CONSISTENCY = "checksum_consistency"
WEIGHT_VERSION_ORDER = "weight_version_order"


def check_checksum_consistency(events: Sequence[Event]) -> Iterator[Finding]:
    """Yield a finding for each server report (confirmed or restored) whose checksum differs from
    the latest one published before it for its model and step (none published: not judged)."""
    published: dict[tuple[str, int], InferenceEngineWeightChecksumEvent] = {}
    for event in events:
        if not isinstance(event, InferenceEngineWeightChecksumEvent):
            continue
        key = (event.model_name, event.step)
        if event.role is ChecksumRole.PUBLISHED:
            published[key] = event
            continue
        expected = published.get(key)
        if expected is None or expected.checksum == event.checksum:
            continue
        yield Finding(
            rule=CHECKSUM_CONSISTENCY,
            message=(
                f"server {event.server_id} reported a {event.role.value} checksum for model "
                f"{event.model_name} step {event.step} that differs from the published one: "
                f"expected {expected.checksum}, actual {event.checksum}"
            ),
            model_name=event.model_name,
            server_id=event.server_id,
            step=event.step,
            weight_version=event.weight_version,
            event_ids=(expected.event_id, event.event_id),
        )


def check_weight_version_order(events: Sequence[Event]) -> Iterator[Finding]:
    """Yield a finding when integer versions go backwards: a model's committed versions must
    strictly increase, and a server's confirmed ones never fall below its highest before.
    Restored checksums (rollbacks, restarts) may go back and do not lower the bar."""
    committed: dict[str, tuple[int, WeightUpdateCommittedEvent]] = {}
    confirmed: dict[tuple[str, str], tuple[int, InferenceEngineWeightChecksumEvent]] = {}
    for event in events:
        if isinstance(event, WeightUpdateCommittedEvent):
            earlier = _behind(committed, event.model_name, event, equal_is_behind=True)
            if earlier is not None:
                yield Finding(
                    rule=WEIGHT_VERSION_ORDER,
                    message=(
                        f"model {event.model_name} committed weight version {event.weight_version} "
                        f"(update {event.update_id}) after already committing version {earlier.weight_version} "
                        f"(update {earlier.update_id}); committed versions must strictly increase"
                    ),
                    model_name=event.model_name,
                    step=event.step,
                    weight_version=event.weight_version,
                    event_ids=(earlier.event_id, event.event_id),
                )
        elif isinstance(event, InferenceEngineWeightChecksumEvent) and event.role is ChecksumRole.CONFIRMED:
            if event.server_id is None:
                continue
            previous = _behind(confirmed, (event.model_name, event.server_id), event, equal_is_behind=False)
            if previous is not None:
                yield Finding(
                    rule=WEIGHT_VERSION_ORDER,
                    message=(
                        f"server {event.server_id} confirmed weight version {event.weight_version} of model "
                        f"{event.model_name} (step {event.step}) after having confirmed version "
                        f"{previous.weight_version}; a server's confirmed versions must not go backwards"
                    ),
                    model_name=event.model_name,
                    server_id=event.server_id,
                    step=event.step,
                    weight_version=event.weight_version,
                    event_ids=(previous.event_id, event.event_id),
                )


def _behind(highest: dict[_K, tuple[int, _E]], key: _K, event: _E, *, equal_is_behind: bool) -> _E | None:
    """The earlier event whose integer version ``event``'s is behind, else None (and ``event``'s
    version, when an integer, becomes ``key``'s highest)."""
    version = version_number(event.weight_version)
    if version is None:
        return None
    previous = highest.get(key)
    if previous is None or version > previous[0] or (version == previous[0] and not equal_is_behind):
        highest[key] = (version, event)
        return None
    return previous[1]


RULES: tuple[Rule, ...] = (
    Rule(
        name=CHECKSUM_CONSISTENCY,
        description="servers report the checksum training published for the same model and step",
        check=check_checksum_consistency,
    ),
    Rule(
        name=WEIGHT_VERSION_ORDER,
        description="committed versions increase per model; confirmed versions never go back per server",
        check=check_weight_version_order,
    ),
)
"""Every rule ``analyze_events`` runs by default, in the order their findings are reported."""

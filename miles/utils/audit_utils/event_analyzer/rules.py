"""The invariants an event log must satisfy, one small rule each, the registry that lists them,
what they find (``Finding``, ``AnalysisReport``), and ``analyze_events``, which runs them.

A rule reads events in timestamp order and yields a ``Finding`` per violation; add one to ``RULES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, NonNegativeInt

from miles.errors import MilesError
from miles.utils.audit_utils.event_logger.models import (
    ChecksumRole,
    Event,
    InferenceEngineWeightChecksumEvent,
    WeightUpdateCommittedEvent,
)
from miles.utils.weight_version import version_number

_K = TypeVar("_K")
_E = TypeVar("_E", WeightUpdateCommittedEvent, InferenceEngineWeightChecksumEvent)


class Finding(BaseModel):
    """One violation of a rule, with the events that show it (oldest first)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rule: str
    message: str
    model_name: str
    server_id: str | None = None
    step: int | None = None
    weight_version: str | None = None
    event_ids: tuple[str, ...]


class AnalysisReport(BaseModel):
    """The findings of every rule run over ``events_checked`` events; ``passed`` when none."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    findings: tuple[Finding, ...]
    events_checked: NonNegativeInt

    @property
    def passed(self) -> bool:
        """True when no rule found anything."""
        return not self.findings


@dataclass(frozen=True, slots=True)
class Rule:
    """A named invariant over an event log."""

    name: str
    description: str
    # Takes every event of a log in timestamp order and yields the violations it finds.
    check: Callable[[Sequence[Event]], Iterable[Finding]]


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
        yield _finding(
            CHECKSUM_CONSISTENCY,
            f"server {event.server_id} reported a {event.role.value} checksum for model "
            f"{event.model_name} step {event.step} that differs from the published one: "
            f"expected {expected.checksum}, actual {event.checksum}",
            expected,
            event,
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
                yield _finding(
                    WEIGHT_VERSION_ORDER,
                    f"model {event.model_name} committed weight version {event.weight_version} "
                    f"(update {event.update_id}) after already committing version {earlier.weight_version} "
                    f"(update {earlier.update_id}); committed versions must strictly increase",
                    earlier,
                    event,
                )
        elif isinstance(event, InferenceEngineWeightChecksumEvent) and event.role is ChecksumRole.CONFIRMED:
            if event.server_id is None:
                continue
            previous = _behind(confirmed, (event.model_name, event.server_id), event, equal_is_behind=False)
            if previous is not None:
                yield _finding(
                    WEIGHT_VERSION_ORDER,
                    f"server {event.server_id} confirmed weight version {event.weight_version} of model "
                    f"{event.model_name} (step {event.step}) after having confirmed version "
                    f"{previous.weight_version}; a server's confirmed versions must not go backwards",
                    previous,
                    event,
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


def _finding(rule: str, message: str, earlier: _E, event: _E) -> Finding:
    """A finding of ``rule`` about ``event``, shown by ``earlier`` and ``event``."""
    return Finding(
        rule=rule,
        message=message,
        model_name=event.model_name,
        server_id=getattr(event, "server_id", None),
        step=event.step,
        weight_version=event.weight_version,
        event_ids=(earlier.event_id, event.event_id),
    )


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


def analyze_events(events: Iterable[Event], *, rules: Sequence[Rule] = RULES) -> AnalysisReport:
    """Check ``events`` (in any order: sorted stably by timestamp) against ``rules``; findings by
    rule, then by time. Raises MilesError when two rules share a name."""
    names = [rule.name for rule in rules]
    if len(set(names)) != len(names):
        raise MilesError("analyzer rules must have distinct names", rules=names)
    ordered = sorted(events, key=lambda event: event.timestamp)
    findings = tuple(finding for rule in rules for finding in rule.check(ordered))
    return AnalysisReport(findings=findings, events_checked=len(ordered))

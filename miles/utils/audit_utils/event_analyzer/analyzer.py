"""Run the registered rules over a list of events and gather what they find."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from miles.errors import MilesError
from miles.utils.audit_utils.event_analyzer.report import AnalysisReport
from miles.utils.audit_utils.event_analyzer.rules import RULES, Rule
from miles.utils.audit_utils.event_logger.models import Event


def analyze_events(events: Iterable[Event], *, rules: Sequence[Rule] = RULES) -> AnalysisReport:
    """Check ``events`` (in any order: sorted stably by timestamp) against ``rules``; findings by
    rule, then by time. Raises MilesError when two rules share a name."""
    names = [rule.name for rule in rules]
    if len(set(names)) != len(names):
        raise MilesError("analyzer rules must have distinct names", rules=names)
    ordered = sorted(events, key=lambda event: event.timestamp)
    findings = tuple(finding for rule in rules for finding in rule.check(ordered))
    return AnalysisReport(findings=findings, events_checked=len(ordered))

"""Offline checks over an event log: does what the fleet reported agree with what was published?"""

from miles.utils.audit_utils.event_analyzer.rules import (
    CHECKSUM_CONSISTENCY,
    RULES,
    WEIGHT_VERSION_ORDER,
    AnalysisReport,
    Finding,
    Rule,
    analyze_events,
)

__all__ = [
    "CHECKSUM_CONSISTENCY",
    "RULES",
    "WEIGHT_VERSION_ORDER",
    "AnalysisReport",
    "Finding",
    "Rule",
    "analyze_events",
]

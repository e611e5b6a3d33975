"""Typed events and their JSONL log: ``models`` defines events, ``logger`` writes and reads them."""

from miles.utils.audit_utils.event_logger.logger import EventLogger, iter_logged_events, read_events
from miles.utils.audit_utils.event_logger.models import (
    ChecksumRole,
    Event,
    EventSource,
    InferenceEngineWeightChecksumEvent,
    LockAcquiredEvent,
    LockReleasedEvent,
    WeightUpdateCommittedEvent,
    WeightUpdateStartedEvent,
    parse_event,
)

__all__ = [
    "ChecksumRole",
    "Event",
    "EventLogger",
    "EventSource",
    "InferenceEngineWeightChecksumEvent",
    "LockAcquiredEvent",
    "LockReleasedEvent",
    "WeightUpdateCommittedEvent",
    "WeightUpdateStartedEvent",
    "iter_logged_events",
    "parse_event",
    "read_events",
]

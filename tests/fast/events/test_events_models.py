"""The typed events: strict, frozen, UTC, and every type survives a JSON round trip unchanged."""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, datetime, timedelta, timezone
from typing import get_args

import pytest
from pydantic import ValidationError

from miles.errors import EventLogError, EventValidationError
from miles.utils.audit_utils.event_logger.models import (
    EVENT_CLASSES,
    EVENT_TYPES,
    BaseEvent,
    ChecksumMismatchEvent,
    ChecksumRole,
    Event,
    EventSource,
    InferenceEngineWeightChecksumEvent,
    LockAcquiredEvent,
    LockReleasedEvent,
    ServerStateChangedEvent,
    SettingsChangedEvent,
    WeightsWrittenOutEvent,
    WeightUpdateAbortedEvent,
    WeightUpdateCommittedEvent,
    WeightUpdateStartedEvent,
    build_event,
    parse_event,
    short_checksum,
)

T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
SOURCE = EventSource(component="trainer", id="node-1:42")

SAMPLES: tuple[BaseEvent, ...] = (
    InferenceEngineWeightChecksumEvent(
        model_name="gpt-xyz", checksum="abc123def456", step=42, timestamp=T0, source=SOURCE
    ),
    InferenceEngineWeightChecksumEvent(
        model_name="gpt-xyz",
        checksum="abc123def456",
        step=42,
        weight_version="7",
        server_id="rollout-0",
        role=ChecksumRole.CONFIRMED,
    ),
    WeightUpdateStartedEvent(
        update_id="u-1",
        model_name="gpt-xyz",
        weight_version="7",
        step=42,
        checkpoint="/ckpt/step-42",
        strategy="rolling",
        pause_mode="retract",
        server_ids=("rollout-0", "rollout-1"),
        fencing_token=3,
    ),
    WeightUpdateCommittedEvent(
        update_id="u-1",
        model_name="gpt-xyz",
        weight_version="7",
        step=42,
        checksum="abc123def456",
        server_ids=("rollout-0", "rollout-1"),
        duration_s=1.25,
        checkpoint="/ckpt/step-42",
    ),
    WeightUpdateAbortedEvent(
        update_id="u-2",
        model_name="gpt-xyz",
        weight_version="8",
        step=None,
        reason="checksum mismatch on rollout-1",
        server_versions={"rollout-0": "7", "rollout-1": "7"},
    ),
    ChecksumMismatchEvent(
        update_id=None,
        model_name="gpt-xyz",
        server_id="rollout-1",
        step=43,
        weight_version="8",
        expected="abc",
        actual="def",
    ),
    ServerStateChangedEvent(
        server_id="rollout-1",
        model_name="gpt-xyz",
        from_state="updating",
        to_state="quarantined",
        weight_version="8",
        reason="checksum mismatch",
    ),
    LockAcquiredEvent(lock_name="InferenceController", holder="update u-2", token=4, waited_s=0.5),
    LockReleasedEvent(lock_name="InferenceController", holder="trainer", token=5, held_s=30.0, reason="lease_expired"),
    SettingsChangedEvent(
        before={"require_published_checksum": True}, after={"require_published_checksum": False}, safety=True
    ),
    WeightsWrittenOutEvent(model_name="gpt-xyz", checksum="abc123def456", checkpoint="/state/snapshots/step-42"),
)
SAMPLE_IDS = [f"{index}-{sample.type}" for index, sample in enumerate(SAMPLES)]


def test_seed_construction_works_with_defaults() -> None:
    event = InferenceEngineWeightChecksumEvent(model_name="gpt-xyz", checksum="abc123def456", step=42)

    assert event.type == "inference_engine_weight_checksum"
    assert (event.model_name, event.checksum, event.step) == ("gpt-xyz", "abc123def456", 42)
    assert event.role is ChecksumRole.PUBLISHED
    assert event.weight_version is None and event.server_id is None
    assert event.timestamp.tzinfo is UTC
    assert abs(datetime.now(UTC) - event.timestamp) < timedelta(minutes=1)
    assert event.source == EventSource(component="miles", id=f"{socket.gethostname()}:{os.getpid()}")
    assert len(event.event_id) == 32 and int(event.event_id, 16) >= 0


def test_every_event_type_has_a_sample() -> None:
    assert {sample.type for sample in SAMPLES} == set(EVENT_TYPES)
    assert {type(sample) for sample in SAMPLES} == set(EVENT_CLASSES)


@pytest.mark.parametrize("event", SAMPLES, ids=SAMPLE_IDS)
def test_round_trip_json_model_json_is_unchanged(event: BaseEvent) -> None:
    first = event.model_dump_json()

    parsed = parse_event(first)
    from_dict = parse_event(json.loads(first))

    assert type(parsed) is type(event)
    assert parsed == event == from_dict
    assert parsed.model_dump_json() == first
    assert parse_event(first.encode()) == event


@pytest.mark.parametrize("event", SAMPLES, ids=SAMPLE_IDS)
def test_extra_fields_are_rejected(event: BaseEvent) -> None:
    data = {**event.model_dump(mode="json"), "surprise": 1}

    with pytest.raises(ValidationError, match="surprise"):
        type(event).model_validate(data)
    with pytest.raises(EventValidationError, match="surprise"):
        parse_event(data)


def test_extra_fields_inside_the_source_are_rejected() -> None:
    data = SAMPLES[0].model_dump(mode="json")
    data["source"]["extra"] = "x"

    with pytest.raises(EventValidationError, match="source.extra"):
        parse_event(data)


def test_events_are_frozen() -> None:
    event = SAMPLES[0]
    with pytest.raises(ValidationError):
        event.step = 1  # type: ignore[misc]


def test_naive_timestamps_are_refused() -> None:
    with pytest.raises(ValidationError, match="timezone"):
        LockAcquiredEvent(lock_name="l", holder="h", token=1, waited_s=0, timestamp=datetime(2026, 1, 1))
    data = SAMPLES[0].model_dump(mode="json")
    data["timestamp"] = "2026-01-01T00:00:00"
    with pytest.raises(EventValidationError, match="timestamp"):
        parse_event(data)


def test_aware_timestamps_are_normalised_to_utc() -> None:
    paris = timezone(timedelta(hours=1))
    event = LockAcquiredEvent(
        lock_name="l", holder="h", token=1, waited_s=0, timestamp=datetime(2026, 1, 1, 13, tzinfo=paris)
    )

    assert event.timestamp == datetime(2026, 1, 1, 12, tzinfo=UTC)
    assert event.timestamp.tzinfo is UTC
    assert '"timestamp":"2026-01-01T12:00:00Z"' in event.model_dump_json()


@pytest.mark.parametrize("role", [ChecksumRole.CONFIRMED, ChecksumRole.RESTORED])
def test_server_reports_need_a_server_id(role: ChecksumRole) -> None:
    with pytest.raises(ValidationError, match="server_id"):
        InferenceEngineWeightChecksumEvent(model_name="m", checksum="c", step=1, role=role)

    event = InferenceEngineWeightChecksumEvent(model_name="m", checksum="c", step=1, role=role.value, server_id="s")
    assert event.role is role


def test_negative_step_is_refused() -> None:
    with pytest.raises(ValidationError, match="step"):
        InferenceEngineWeightChecksumEvent(model_name="m", checksum="c", step=-1)


def test_json_lists_become_tuples() -> None:
    data = SAMPLES[2].model_dump(mode="json")
    assert data["server_ids"] == ["rollout-0", "rollout-1"]

    event = parse_event(data)

    assert isinstance(event, WeightUpdateStartedEvent)
    assert event.server_ids == ("rollout-0", "rollout-1")


def test_unknown_type_and_bad_json_are_validation_errors() -> None:
    with pytest.raises(EventValidationError, match="does not match any of the expected tags|tag"):
        parse_event({"type": "no_such_event"})
    with pytest.raises(EventValidationError) as raised:
        parse_event('{"type": "lock_acquired", ')
    assert isinstance(raised.value, EventLogError)
    assert isinstance(raised.value, ValueError)


def test_build_event_accepts_a_dict_without_type_and_refuses_another_type() -> None:
    event = build_event(LockAcquiredEvent, {"lock_name": "l", "holder": "h", "token": 1, "waited_s": 0})
    assert event.type == "lock_acquired"

    with pytest.raises(EventValidationError, match="LockReleasedEvent"):
        build_event(
            LockReleasedEvent, {"type": "lock_acquired", "lock_name": "l", "holder": "h", "token": 1, "held_s": 0}
        )


def test_involved_servers_and_summary() -> None:
    assert SAMPLES[0].involved_servers() == ()
    assert SAMPLES[1].involved_servers() == ("rollout-0",)
    assert SAMPLES[4].involved_servers() == ("rollout-0", "rollout-1")
    assert SAMPLES[6].summary() == "updating -> quarantined (checksum mismatch)"
    assert short_checksum("0123456789abcdef") == "0123456789ab…"
    assert short_checksum("abc") == "abc"


def test_the_union_and_the_class_list_agree() -> None:
    union, _discriminator = get_args(Event)
    assert get_args(union) == EVENT_CLASSES

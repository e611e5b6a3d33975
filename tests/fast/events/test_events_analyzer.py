"""The analyzer's rules: checksum consistency and weight version order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta

import pytest

from miles.errors import MilesError
from miles.utils.audit_utils.event_analyzer import (
    CHECKSUM_CONSISTENCY,
    RULES,
    WEIGHT_VERSION_ORDER,
    Finding,
    Rule,
    analyze_events,
)
from miles.utils.audit_utils.event_logger.models import (
    ChecksumRole,
    Event,
    InferenceEngineWeightChecksumEvent,
    LockAcquiredEvent,
    WeightUpdateCommittedEvent,
)
from miles.utils.weight_version import version_number

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def checksum(
    seconds: float,
    value: str,
    *,
    step: int = 1,
    model: str = "m",
    role: ChecksumRole = ChecksumRole.PUBLISHED,
    server: str | None = None,
    version: str | None = None,
) -> InferenceEngineWeightChecksumEvent:
    return InferenceEngineWeightChecksumEvent(
        model_name=model,
        checksum=value,
        step=step,
        role=role,
        server_id=server,
        weight_version=version,
        timestamp=T0 + timedelta(seconds=seconds),
    )


def confirmed(seconds: float, value: str, server: str, **kwargs: object) -> InferenceEngineWeightChecksumEvent:
    return checksum(seconds, value, role=ChecksumRole.CONFIRMED, server=server, **kwargs)  # type: ignore[arg-type]


def restored(seconds: float, value: str, server: str, **kwargs: object) -> InferenceEngineWeightChecksumEvent:
    return checksum(seconds, value, role=ChecksumRole.RESTORED, server=server, **kwargs)  # type: ignore[arg-type]


def committed(seconds: float, version: str, *, model: str = "m") -> WeightUpdateCommittedEvent:
    return WeightUpdateCommittedEvent(
        update_id=f"u-{version}",
        model_name=model,
        weight_version=version,
        step=None,
        checksum="c",
        server_ids=("s0",),
        duration_s=0.1,
        timestamp=T0 + timedelta(seconds=seconds),
    )


# --- checksum_consistency ------------------------------------------------------------------------


def test_matching_checksums_pass() -> None:
    events = [
        checksum(0, "aaa", step=1),
        confirmed(1, "aaa", "s0", step=1, version="1"),
        confirmed(2, "aaa", "s1", step=1, version="1"),
        restored(3, "aaa", "s1", step=1, version="1"),
        LockAcquiredEvent(lock_name="L", holder="h", token=1, waited_s=0),
    ]

    report = analyze_events(events)

    assert report.passed
    assert report.findings == ()
    assert report.events_checked == 5


def test_a_mismatch_is_reported_with_server_model_and_step() -> None:
    published = checksum(0, "aaa", step=7, model="gpt-xyz")
    good = confirmed(1, "aaa", "s0", step=7, model="gpt-xyz", version="3")
    bad = confirmed(2, "bbb", "s1", step=7, model="gpt-xyz", version="3")

    report = analyze_events([published, good, bad])

    assert not report.passed
    [finding] = report.findings
    assert finding == Finding(
        rule=CHECKSUM_CONSISTENCY,
        message=finding.message,
        model_name="gpt-xyz",
        server_id="s1",
        step=7,
        weight_version="3",
        event_ids=(published.event_id, bad.event_id),
    )
    for fact in ("s1", "gpt-xyz", "step 7", "expected aaa", "actual bbb"):
        assert fact in finding.message


def test_a_restored_mismatch_is_reported_too() -> None:
    report = analyze_events([checksum(0, "aaa"), restored(1, "zzz", "s0")])

    [finding] = report.findings
    assert finding.rule == CHECKSUM_CONSISTENCY
    assert "restored" in finding.message


def test_reports_compare_with_the_latest_publication_for_their_model_and_step() -> None:
    events = [
        checksum(0, "old", step=1),
        checksum(1, "new", step=1),  # training republished step 1
        checksum(2, "other-step", step=2),
        checksum(3, "other-model", step=1, model="n"),
        confirmed(4, "new", "s0", step=1),
        confirmed(5, "unjudged", "s0", step=3),  # nothing published for step 3
    ]

    assert analyze_events(events).passed


def test_a_report_before_its_publication_is_not_judged_against_it() -> None:
    assert analyze_events([confirmed(0, "bbb", "s0"), checksum(1, "aaa")]).passed


def test_events_are_sorted_by_time_before_the_rules_run() -> None:
    published = checksum(0, "aaa")
    bad = confirmed(1, "bbb", "s0")

    report = analyze_events([bad, published])

    assert [finding.event_ids for finding in report.findings] == [(published.event_id, bad.event_id)]


# --- weight_version_order ------------------------------------------------------------------------


def test_committed_versions_going_backwards_are_reported() -> None:
    first, second, back = committed(0, "5"), committed(1, "9"), committed(2, "7")

    [finding] = analyze_events([first, second, back, committed(3, "10")]).findings

    assert finding.rule == WEIGHT_VERSION_ORDER
    assert (finding.model_name, finding.server_id, finding.weight_version) == ("m", None, "7")
    assert finding.event_ids == (second.event_id, back.event_id)
    assert "7" in finding.message and "9" in finding.message


def test_committing_the_same_version_twice_is_reported() -> None:
    [finding] = analyze_events([committed(0, "5"), committed(1, "5")]).findings
    assert finding.weight_version == "5"


def test_committed_versions_are_ordered_per_model() -> None:
    assert analyze_events([committed(0, "9", model="a"), committed(1, "2", model="b")]).passed


def test_non_integer_versions_are_not_compared() -> None:
    events = [committed(0, "9"), committed(1, "v2"), committed(2, "abc"), committed(3, "10")]
    assert analyze_events(events).passed
    # The comparison skips "v2" but still holds later integers to the highest one committed.
    [finding] = analyze_events([*events, committed(4, "3")]).findings
    assert finding.weight_version == "3"


def test_a_server_confirming_an_older_version_is_reported() -> None:
    events = [
        confirmed(0, "c", "s0", version="4"),
        confirmed(1, "c", "s0", version="4"),  # confirming the same version again is fine
        confirmed(2, "c", "s1", version="2"),  # another server is judged on its own history
        confirmed(3, "c", "s0", version="3"),
    ]

    [finding] = analyze_events(events).findings

    assert finding.rule == WEIGHT_VERSION_ORDER
    assert (finding.server_id, finding.weight_version) == ("s0", "3")
    assert finding.event_ids == (events[1].event_id, events[3].event_id)
    assert "s0" in finding.message


def test_a_restored_older_version_is_not_reported_but_a_later_confirmation_below_the_max_is() -> None:
    events = [
        confirmed(0, "c", "s0", version="5"),
        restored(1, "c", "s0", version="3"),  # rollback after a failed update: allowed
        confirmed(2, "c", "s0", version="6"),
    ]
    assert analyze_events(events).passed

    after_rollback = [*events[:2], confirmed(2, "c", "s0", version="4")]
    [finding] = analyze_events(after_rollback).findings
    assert (finding.server_id, finding.weight_version) == ("s0", "4")


def test_integer_version_accepts_only_base_10_integers() -> None:
    assert version_number("42") == 42
    assert version_number("-1") == -1
    for text in ("1_000", " 7", "4.0", "٣", "", "v1", None):
        assert version_number(text) is None


# --- the registry --------------------------------------------------------------------------------


def test_the_registry_holds_both_rules() -> None:
    assert [rule.name for rule in RULES] == [CHECKSUM_CONSISTENCY, WEIGHT_VERSION_ORDER]


def test_custom_rules_can_be_run() -> None:
    def every_lock(events: Sequence[Event]) -> Iterator[Finding]:
        for event in events:
            if isinstance(event, LockAcquiredEvent):
                yield Finding(rule="no_locks", message="a lock", model_name="-", event_ids=(event.event_id,))

    rule = Rule(name="no_locks", description="never lock", check=every_lock)
    events = [
        checksum(0, "a"),
        confirmed(1, "b", "s0"),
        LockAcquiredEvent(lock_name="L", holder="h", token=1, waited_s=0),
    ]

    report = analyze_events(events, rules=(rule,))
    assert [finding.rule for finding in report.findings] == ["no_locks"]
    assert [finding.rule for finding in analyze_events(events, rules=(*RULES, rule)).findings] == [
        CHECKSUM_CONSISTENCY,
        "no_locks",
    ]
    with pytest.raises(MilesError, match="distinct"):
        analyze_events(events, rules=(rule, rule))

"""ControllerMetrics from tables, without processes: staleness, outcomes, the events it counts."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miles.config import UpdatePauseMode
from miles.controller.health import FleetHealth, FleetStatus, LockHealth
from miles.controller.results import UpdateMode, UpdateResult, UpdateStatus
from miles.http.metrics import ControllerMetrics, RequestHistory, outcome_of
from miles.utils.audit_utils.event_logger.models import (
    ChecksumMismatchEvent,
    LockAcquiredEvent,
    ServerStateChangedEvent,
)


def empty_health() -> FleetHealth:
    lock = LockHealth(
        name="InferenceController", held=False, holder=None, held_since=None, held_for_s=None, token=None,
        waiters=0, detached=False, lease_expires_at=None,
    )  # fmt: skip
    return FleetHealth(status=FleetStatus.OK, ok=True, models={}, servers=[], lock=lock, last_update=None, uptime_s=1.0)


def committed(version: str, previous: str | None) -> UpdateResult:
    return UpdateResult(
        update_id=f"u{version}", status=UpdateStatus.COMMITTED, model_name="m", weight_version=version,
        previous_version=previous, step=int(version), checkpoint=None, expected_checksum="c",
        checksum_source=None, strategy=UpdateMode.BARRIER, pause_mode=UpdatePauseMode.DRAIN,
        message="", duration_s=0.1, timings={"load": 0.05}, serving_blocked_s=0.02, bytes_moved=10,
    )  # fmt: skip


def answer(start: str, tokens: int = 2) -> bytes:
    return (
        b'{"text":"x","output_ids":[1],"meta_info":{"completion_tokens":%d,"weight_version":"%s",'
        b'"weight_version_start":"%s"}}' % (tokens, start.encode(), start.encode())
    )


def values(metrics: ControllerMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


@pytest.mark.parametrize(
    ("commits", "start", "behind"),
    [
        ([], "1", 0),  # nothing committed yet: nothing is newer
        (["2"], "2", 0),
        (["2"], "1", 1),  # the version the first update replaced
        (["2", "3", "4"], "2", 2),
        (["2", "3"], "0", 3),  # unknown: older than every version known (1, 2, 3)
    ],
)
def test_staleness_counts_committed_versions_newer_than_the_answer(commits: list[str], start: str, behind: int) -> None:
    metrics = ControllerMetrics(empty_health)
    previous = "1"
    for version in commits:
        metrics.update_done(committed(version, previous))
        previous = version
    metrics.request_done("m", server="s", outcome="ok", started=time.perf_counter(), content=answer(start))
    buckets = values(metrics, "miles_sample_staleness_versions_bucket")
    below = {float(dict(k)["le"]): v for k, v in buckets.items()}
    assert below[float(behind)] == 1
    assert all(v == 0 for le, v in below.items() if le < behind)


def test_a_batch_answer_counts_every_sample_and_its_tokens() -> None:
    metrics = ControllerMetrics(empty_health)
    batch = b"[" + answer("1", 3) + b"," + answer("1", 4) + b"]"
    metrics.request_done("m", server="s", outcome="ok", started=time.perf_counter(), content=batch)
    assert values(metrics, "miles_generated_tokens_total") == {(("model", "m"), ("server", "s")): 7}
    assert values(metrics, "miles_sample_staleness_versions_count") == {(("model", "m"),): 2}


def test_a_failed_answer_counts_no_tokens() -> None:
    metrics = ControllerMetrics(empty_health)
    metrics.request_done("m", server="s", outcome="server_error", started=time.perf_counter(), content=answer("1"))
    assert values(metrics, "miles_generated_tokens_total") == {}
    assert values(metrics, "miles_requests_total") == {
        (("model", "m"), ("outcome", "server_error"), ("server", "s")): 1
    }


@pytest.mark.parametrize(
    ("status", "outcome"), [(200, "ok"), (307, "ok"), (400, "client_error"), (503, "server_error")]
)
def test_outcome_of_a_status(status: int, outcome: str) -> None:
    assert outcome_of(status) == outcome


def test_events_feed_mismatches_quarantines_and_the_lock() -> None:
    metrics = ControllerMetrics(empty_health)
    metrics.event(ChecksumMismatchEvent(model_name="m", server_id="s1", expected="a" * 32, actual="b" * 32))
    metrics.event(
        ServerStateChangedEvent(server_id="s1", model_name="m", from_state="updating", to_state="quarantined")
    )
    metrics.event(ServerStateChangedEvent(server_id="s1", model_name="m", from_state="serving", to_state="updating"))
    metrics.event(LockAcquiredEvent(lock_name="L", holder="h", token=1, waited_s=0.5))
    assert values(metrics, "miles_checksum_mismatches_total") == {(("model", "m"), ("server", "s1")): 1}
    assert values(metrics, "miles_quarantines_total") == {(("model", "m"), ("server", "s1")): 1}
    assert values(metrics, "miles_lock_wait_seconds_count") == {(("holder", "h"),): 1}


def test_request_history_keeps_the_last_seconds_and_forgets_older_ones() -> None:
    history = RequestHistory(seconds=5)
    history.record(0.010, ok=True, now=100.2)
    history.record(0.030, ok=False, now=100.9)
    history.record(0.005, ok=True, now=103.0)
    window = history.window(now=103.5)
    assert window.start == 99
    assert window.requests == [0, 2, 0, 0, 1]
    assert window.failed == [0, 1, 0, 0, 0]
    assert window.mean_latency_ms == [None, 20.0, None, None, 5.0]
    # Five seconds on, the slot of second 100 is reused for 105: the old counts are gone.
    history.record(0.001, ok=True, now=105.1)
    later = history.window(now=105.2)
    assert later.start == 101 and later.requests == [0, 0, 1, 0, 1]

"""``miles events DIR --timeline``: updates read back from a real log as timelines of 80 columns."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import typer
from typer.testing import CliRunner

from miles.commands import events as events_command
from miles.utils.audit_utils.event_analyzer.timeline import update_timelines
from miles.utils.audit_utils.event_logger import (
    ChecksumRole,
    EventLogger,
    InferenceEngineWeightChecksumEvent,
    WeightUpdateCommittedEvent,
    WeightUpdateStartedEvent,
)
from miles.utils.audit_utils.event_logger.logger import read_events
from miles.utils.audit_utils.event_logger.models import (
    ChecksumMismatchEvent,
    ServerStateChangedEvent,
    WeightUpdateAbortedEvent,
)

T0 = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
GOOD = "0123456789abcdef0123456789abcdef"
BAD = "fedcba9876543210fedcba9876543210"
LONG_SERVER = "a-server-with-a-long-id-0"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def write_log(directory: Path) -> None:
    """A committed update, a rolled-back one with a mismatch, and one still running."""
    with EventLogger(directory, component="controller", source_id="ctl-0") as log:

        def started(update_id: str, version: str, seconds: float, servers: list[str]) -> None:
            log.log(
                WeightUpdateStartedEvent,
                {
                    "update_id": update_id, "model_name": "tiny", "weight_version": version, "strategy": "barrier",
                    "pause_mode": "drain", "server_ids": servers, "timestamp": at(seconds),
                },
                print_log=False,
            )  # fmt: skip

        def state(server: str, old: str, new: str, seconds: float) -> None:
            log.log(
                ServerStateChangedEvent,
                {
                    "server_id": server,
                    "model_name": "tiny",
                    "from_state": old,
                    "to_state": new,
                    "timestamp": at(seconds),
                },
                print_log=False,
            )

        started("u-1", "2", 0, ["s-0", LONG_SERVER])
        state("s-0", "serving", "updating", 0.01)
        log.log(
            InferenceEngineWeightChecksumEvent,
            {"model_name": "tiny", "checksum": GOOD, "step": 2, "server_id": "s-0", "role": ChecksumRole.CONFIRMED,
             "timestamp": at(0.2)},
            print_log=False,
        )  # fmt: skip
        state("s-0", "updating", "serving", 0.3)
        state("other", "serving", "updating", 0.3)  # another model's server: not this update's step
        log.log(
            WeightUpdateCommittedEvent,
            {"update_id": "u-1", "model_name": "tiny", "weight_version": "2", "checksum": GOOD,
             "server_ids": ["s-0", LONG_SERVER], "duration_s": 0.31, "serving_blocked_s": 0.29,
             "timings": {"transaction": 0.3, "load": 0.25, "lock_wait": 0.001, "pause": 0.01, "confirm": 0.02},
             "timestamp": at(0.31)},
            print_log=False,
        )  # fmt: skip
        started("u-2", "3", 5, ["s-0", LONG_SERVER])
        log.log(
            ChecksumMismatchEvent,
            {"update_id": "u-2", "model_name": "tiny", "server_id": LONG_SERVER, "expected": GOOD, "actual": BAD,
             "timestamp": at(5.2)},
            print_log=False,
        )  # fmt: skip
        log.log(
            WeightUpdateAbortedEvent,
            {"update_id": "u-2", "model_name": "tiny", "weight_version": "3",
             "reason": "rolled_back: checksum mismatch",
             "server_versions": {"s-0": "2", LONG_SERVER: "2"}, "duration_s": 0.5, "timings": {"rollback": 0.1},
             "timestamp": at(5.5)},
            print_log=False,
        )  # fmt: skip
        started("u-3", "4", 9, ["s-0"])


def test_updates_become_timelines_with_their_phases_and_steps(tmp_path: Path) -> None:
    write_log(tmp_path)
    first, second, third = update_timelines(read_events(tmp_path))
    assert (first.update_id, first.status, second.status, third.status) == (
        "u-1",
        "committed",
        "rolled_back",
        "running",
    )
    # Phases in the order an update goes through them; the aggregate is left out.
    assert list(first.phases) == ["lock_wait", "pause", "load", "confirm"]
    assert first.serving_blocked_s == 0.29
    assert [(round(s.at_s, 2), s.server_id, s.what) for s in first.steps] == [
        (0.01, "s-0", "serving -> updating"),
        (0.2, "s-0", "confirmed 0123456789ab…"),
        (0.3, "s-0", "updating -> serving"),
    ]
    assert second.message == "checksum mismatch"
    assert [s.server_id for s in second.steps] == [LONG_SERVER]
    assert third.duration_s is None and third.steps == ()


def invoke(*args: str) -> tuple[int, str]:
    app = typer.Typer()
    app.command()(events_command.events)
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "80"})
    return result.exit_code, result.output


def test_the_timeline_fits_80_columns_and_keeps_ids_whole(tmp_path: Path) -> None:
    write_log(tmp_path)
    code, output = invoke(str(tmp_path), "--timeline")
    assert code == 0, output
    lines = output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert any(
        line.startswith("05:06:07.000 u-1 tiny -> 2 barrier committed 310.0ms blocked 290.0ms") for line in lines
    )
    load = next(line for line in lines if line.strip().startswith("load"))
    assert load.count("#") == 40  # the longest phase fills the bar
    assert any(LONG_SERVER in line and "mismatch" in line for line in lines)
    assert "running" in output


def test_the_timeline_filters_and_prints_json(tmp_path: Path) -> None:
    write_log(tmp_path)
    code, output = invoke(str(tmp_path), "--timeline", "--server", LONG_SERVER, "--json")
    assert code == 0, output
    updates = [json.loads(line) for line in output.splitlines()]
    assert [u["update_id"] for u in updates] == ["u-1", "u-2"]
    code, output = invoke(str(tmp_path), "--timeline", "--limit", "1")
    assert code == 0 and "u-3" in output and "u-1" not in output


def test_a_log_without_updates_says_so(tmp_path: Path) -> None:
    with EventLogger(tmp_path, component="controller", source_id="c"):
        pass
    code, output = invoke(str(tmp_path), "--timeline")
    assert code == 0 and "no weight updates" in output

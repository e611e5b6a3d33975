"""``miles events DIR``: the table, the filters, JSON lines, and --check exit codes, on real logs."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from miles.commands import events as events_command
from miles.utils.audit_utils.event_logger import (
    ChecksumRole,
    EventLogger,
    InferenceEngineWeightChecksumEvent,
    LockAcquiredEvent,
    WeightUpdateCommittedEvent,
    WeightUpdateStartedEvent,
)

T0 = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
PUBLISHED = "0123456789abcdef0123456789abcdef"
WRONG = "fedcba9876543210fedcba9876543210"


def at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


def write_log(directory: Path, *, server_checksum: str) -> None:
    """A trainer and a controller logging one update into one directory, as two processes would."""
    with EventLogger(directory, component="trainer", source_id="trainer-0") as trainer:
        trainer.log(
            InferenceEngineWeightChecksumEvent,
            {"model_name": "gpt-xyz", "checksum": PUBLISHED, "step": 42, "timestamp": at(0)},
            print_log=False,
        )
    with EventLogger(directory, component="controller", source_id="ctl-0") as controller:
        controller.log(
            WeightUpdateStartedEvent,
            {
                "update_id": "u-1",
                "model_name": "gpt-xyz",
                "weight_version": "7",
                "step": 42,
                "checkpoint": "/ckpt/42",
                "strategy": "barrier",
                "pause_mode": "drain",
                "server_ids": ["rollout-0", "rollout-1"],
                "fencing_token": None,
                "timestamp": at(1),
            },
            print_log=False,
        )
        for seconds, server in ((2, "rollout-0"), (3, "rollout-1")):
            controller.log(
                InferenceEngineWeightChecksumEvent,
                {
                    "model_name": "gpt-xyz",
                    "checksum": server_checksum,
                    "step": 42,
                    "weight_version": "7",
                    "server_id": server,
                    "role": ChecksumRole.CONFIRMED,
                    "timestamp": at(seconds),
                },
                print_log=False,
            )
        controller.log(
            WeightUpdateCommittedEvent,
            {
                "update_id": "u-1",
                "model_name": "gpt-xyz",
                "weight_version": "7",
                "step": 42,
                "checksum": PUBLISHED,
                "server_ids": ["rollout-0", "rollout-1"],
                "duration_s": 0.5,
                "timestamp": at(4),
            },
            print_log=False,
        )
        controller.log(
            LockAcquiredEvent,
            {"lock_name": "InferenceController", "holder": "u-1", "token": 1, "waited_s": 0.0, "timestamp": at(5)},
            print_log=False,
        )


@pytest.fixture
def good_log(tmp_path: Path) -> Path:
    write_log(tmp_path / "good", server_checksum=PUBLISHED)
    return tmp_path / "good"


@pytest.fixture
def bad_log(tmp_path: Path) -> Path:
    write_log(tmp_path / "bad", server_checksum=WRONG)
    return tmp_path / "bad"


def run(*args: str | Path) -> Result:
    # A wide terminal keeps rich from folding table cells, so the assertions can look for whole values.
    return CliRunner().invoke(events_command.app, [str(arg) for arg in args], env={"COLUMNS": "250"})


def table_rows(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("│")]


def test_table_shows_every_event_in_time_order(good_log: Path) -> None:
    result = run(good_log)

    assert result.exit_code == 0, result.output
    rows = table_rows(result.output)
    assert len(rows) == 6
    assert "6 of 6 events" in result.output
    for header in ("time", "type", "source", "model", "server", "step", "version", "details"):
        assert header in result.output
    first = rows[0]
    assert "2026-03-04 05:06:07.000" in first
    assert "inference_engine_weight_checksum" in first
    assert "trainer/trainer-0" in first and "gpt-xyz" in first and "42" in first
    assert "published 0123456789ab…" in first
    assert PUBLISHED not in result.output  # checksums are shortened
    assert "rollout-0,rollout-1" in rows[1] and "update u-1 barrier/drain" in rows[1]
    assert "rollout-1" in rows[3] and "confirmed" in rows[3]
    assert "lock_acquired" in rows[5]


def test_filter_by_type_server_and_limit(good_log: Path) -> None:
    by_type = run(good_log, "--type", "weight_update_committed", "--type", "lock_acquired")
    assert by_type.exit_code == 0, by_type.output
    assert [("weight_update_committed" in row, "lock_acquired" in row) for row in table_rows(by_type.output)] == [
        (True, False),
        (False, True),
    ]

    by_server = run(good_log, "--server", "rollout-1")
    assert by_server.exit_code == 0, by_server.output
    # The update's start and commit name both servers; only rollout-1's own confirmation is shown.
    assert len(table_rows(by_server.output)) == 3
    assert "rollout-0," in table_rows(by_server.output)[0]

    limited = run(good_log, "--limit", "2")
    assert [("weight_update_committed" in row, "lock_acquired" in row) for row in table_rows(limited.output)] == [
        (True, False),
        (False, True),
    ]


def test_unknown_type_is_an_error_listing_the_valid_ones(good_log: Path) -> None:
    result = run(good_log, "--type", "checksum")

    assert result.exit_code == 2
    assert "unknown event type(s) checksum" in result.output
    assert "inference_engine_weight_checksum" in result.output and "lock_released" in result.output


def test_json_prints_parseable_event_lines(good_log: Path) -> None:
    result = run(good_log, "--json", "--type", "inference_engine_weight_checksum")

    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["role"] for line in lines] == ["published", "confirmed", "confirmed"]
    assert lines[0]["checksum"] == PUBLISHED


def test_check_passes_with_exit_0(good_log: Path) -> None:
    result = run(good_log, "--check")

    assert result.exit_code == 0, result.output
    assert "check passed: 6 events, no findings" in result.output


def test_check_reports_findings_with_exit_1(bad_log: Path) -> None:
    result = run(bad_log, "--check")

    assert result.exit_code == 1, result.output
    assert "check failed: 2 finding(s) in 6 events" in result.output
    assert "[checksum_consistency] server rollout-0" in result.output
    assert f"expected {PUBLISHED}" in result.output and f"actual {WRONG}" in result.output


def test_check_ignores_display_filters_and_speaks_json(bad_log: Path) -> None:
    result = run(bad_log, "--check", "--json", "--type", "lock_acquired")

    assert result.exit_code == 1, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0]["type"] == "lock_acquired"
    assert [(line["rule"], line["server_id"]) for line in lines[1:]] == [
        ("checksum_consistency", "rollout-0"),
        ("checksum_consistency", "rollout-1"),
    ]


def test_missing_or_unreadable_directory_exits_2(tmp_path: Path) -> None:
    missing = run(tmp_path / "nope", "--check")
    assert missing.exit_code == 2
    assert "does not exist" in missing.stderr

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert run(not_a_dir).exit_code == 2

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "x.jsonl").write_text("not json\n")
    result = run(corrupt)
    assert result.exit_code == 2
    assert f"{corrupt / 'x.jsonl'}:1" in result.stderr


def test_mounted_as_a_subcommand_the_usage_is_miles_events_dir(bad_log: Path) -> None:
    root = typer.Typer()
    root.add_typer(events_command.app, name="events")

    @root.command()
    def version() -> None:  # a second command makes ``root`` a real group, as ``miles`` is
        typer.echo("0")

    runner = CliRunner()
    result = runner.invoke(root, ["events", str(bad_log), "--check", "--limit", "1"], env={"COLUMNS": "250"})
    assert result.exit_code == 1, result.output
    assert len(table_rows(result.output)) == 1

    usage = runner.invoke(root, ["events", "--help"], env={"COLUMNS": "250"})
    assert usage.exit_code == 0
    assert "events [OPTIONS]" in usage.output and "DIR" in usage.output
    for option in ("--type", "--server", "--limit", "--json", "--check"):
        assert option in usage.output

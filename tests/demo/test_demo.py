"""A short ``miles demo`` run end to end: the command, its run directory, and the summary's promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_a_short_demo_keeps_every_promise(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles.cli",
            "demo",
            "--sft-steps",
            "6",
            "--steps",
            "6",
            "--servers",
            "2",
            "--users",
            "2",
            "--runs-dir",
            str(runs),
            "--no-live",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    latest = runs / "latest"
    assert latest.is_symlink()
    summary = json.loads((latest / "summary.json").read_text())
    assert summary["steps"] == 12
    assert summary["updates_committed"] == 12
    assert summary["updates_failed"] == 0
    assert summary["requests_failed"] == 0
    assert summary["requests_served"] > 0
    assert summary["checksum_mismatches"] == 0
    assert summary["events_check_passed"] is True
    assert summary["final_weight_version"] == "12"
    for key in ("update_latency_p50_s", "update_latency_p95_s", "reward_first", "reward_last"):
        assert isinstance(summary[key], float)
    for name in ("report.md", "reward.png", "updates.png", "requests.png"):
        assert (latest / name).stat().st_size > 0
    assert any((latest / "events").glob("*.jsonl"))
    assert "miles demo summary" in done.stdout
    # The event log it leaves passes the same audit from the command line.
    audit = subprocess.run(
        [sys.executable, "-m", "miles.cli", "events", str(latest / "events"), "--check", "--limit", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr

"""``miles demo --ray``: the same demo with its servers on a local Ray cluster of two nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


def test_the_demo_on_ray_keeps_the_same_promises(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, "-m", "miles.cli", "demo", "--ray", "--sft-steps", "6", "--steps", "6"]
        + ["--servers", "2", "--users", "2", "--runs-dir", str(runs), "--no-live"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # One engine on each node, each on the logical GPU Ray gave it.
    placed = [line for line in done.stdout.splitlines() if "Ray node" in line]
    assert len(placed) == 2 and len({line.split("Ray node")[1].split()[0] for line in placed}) == 2, placed
    summary = json.loads((runs / "latest" / "summary.json").read_text())
    assert summary["updates_committed"] == 12 and summary["updates_failed"] == 0
    assert summary["requests_failed"] == 0 and summary["requests_served"] > 0
    assert summary["checksum_mismatches"] == 0 and summary["events_check_passed"] is True
    assert summary["final_weight_version"] == "12"
    assert "miles demo summary" in done.stdout

"""A short ``miles demo`` run end to end: the command, its run directory, and the summary's promises."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


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


def _demo(runs: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "miles.cli",
        "demo",
        "--servers",
        "2",
        "--users",
        "2",
        "--runs-dir",
        str(runs),
        "--no-live",
        *extra,
    ]


def _ranks_of(controller_url: str) -> dict[int, int]:
    """The trainer rank processes alive that were started for the controller at ``controller_url``
    (their spec names it): pid by rank (rank 0 is the one given the report pipe)."""
    ranks = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # not a process, or gone
        if b"miles.train.rank_process" in argv and any(controller_url.encode() in a for a in argv):
            ranks[0 if b"--report-fd" in argv else 1] = int(proc.name)
    return ranks


def test_a_demo_trained_by_two_fsdp2_ranks_keeps_every_promise(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = subprocess.run(
        _demo(runs, "--trainer-ranks", "2", "--sft-steps", "4", "--steps", "4"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((runs / "latest" / "summary.json").read_text())
    assert summary["trainer"] == "2 FSDP2 ranks (gloo)"
    # Every rank wrote its own rows into the engines' shared-memory buckets: no gather.
    assert summary["transfer_path"] == "shm, direct shards"
    assert summary["steps"] == 8
    assert summary["updates_committed"] == 8
    assert summary["updates_failed"] == 0
    assert summary["final_weight_version"] == "8"
    assert summary["requests_failed"] == 0
    assert summary["requests_served"] > 0
    assert summary["checksum_mismatches"] == 0
    assert summary["events_check_passed"] is True
    assert 0 < summary["publish_latency_p50_s"] <= summary["publish_latency_p95_s"]
    # Rank 0 reported whole steps: both ranks' samples (4 prompts x 8 in GRPO, measured by both).
    training = json.loads((runs / "latest" / "training.json").read_text())
    assert [s["num_samples"] for s in training["steps"] if s["phase"] == "grpo"] == [64] * 4
    assert "2 FSDP2 ranks (gloo)" in done.stdout
    assert "shm, direct shards" in done.stdout
    for rank in (0, 1):
        assert (runs / "latest" / "logs" / f"trainer-rank-{rank}.log").exists()
    url = re.search(r"controller at (http://\S+);", done.stdout)
    assert url is not None and _ranks_of(url.group(1)) == {}


@pytest.mark.parametrize("ending", ["a rank dies", "interrupted"])
def test_a_demo_whose_rank_dies_or_that_is_interrupted_ends_every_rank_in_bounded_time(
    tmp_path: Path, ending: str
) -> None:
    runs = tmp_path / "runs"
    demo = subprocess.Popen(
        _demo(runs, "--trainer-ranks", "2", "--sft-steps", "400", "--steps", "0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert demo.stdout is not None
        url = None
        for line in demo.stdout:
            if found := re.search(r"controller at (http://\S+);", line):
                url = found.group(1)
            if line.startswith("step"):  # the ranks have trained and published a step
                break
        assert url is not None, demo.stderr.read() if demo.stderr else ""
        ranks = _ranks_of(url)
        assert sorted(ranks) == [0, 1]
        stopped = time.monotonic()
        if ending == "a rank dies":
            os.kill(ranks[1], signal.SIGKILL)
        else:
            demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=60)
        assert time.monotonic() - stopped < 30
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    if ending == "a rank dies":
        assert demo.returncode == 2, out[-2000:] + err[-2000:]
        assert "the trainer's rank 1 was killed by SIGKILL" in err, err[-3000:]
    else:
        assert demo.returncode == 130, out[-2000:] + err[-2000:]
    assert _ranks_of(url) == {}

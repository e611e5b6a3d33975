"""A controller killed outright (kill -9 of `miles serve`) and started again on the same events
directory resumes from what its log committed: its servers come up on those weights, what
training published is known, no version goes back, and /health says where it resumed from."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoModelForCausalLM

from miles.rollout.engine_process import free_port
from miles.testing import copy_checkpoint, process_alive, wait_serving
from miles.train.push import PushPublisher
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import saved_state_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@contextmanager
def serving(checkpoint: Path, events: Path) -> Iterator[tuple[str, int]]:
    """`miles serve` on ``events``; yields its URL and pid; killed (with its engines) at the end.

    Each controller keeps its working files (engine logs, written-out weights) in a directory of
    its own beside the log, as a temporary one would be, but removed with the test's."""
    port = free_port()
    state = events.parent / f"state-{port}"
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "serve", "--checkpoint", str(checkpoint), "--servers", "1"]
        + ["--port", str(port), "--events-dir", str(events)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MILES_WRITE_OUT_INTERVAL_S": "0", "MILES_STATE_DIR": str(state)},
    )
    try:
        wait_serving(url, serve)
        yield url, serve.pid
    finally:
        if serve.poll() is None:
            serve.kill()
        serve.wait(timeout=60)


def servers_of(url: str) -> list[tuple[str, str, str | None]]:
    report = httpx.get(f"{url}/health", timeout=10, trust_env=False).json()
    return [(s["state"], s["weight_version"], s["checksum"]) for s in report["servers"]]


def kill_hard(url: str, pid: int) -> None:
    """kill -9 the controller; its engines follow it (they watch their parent)."""
    engines = [s["pid"] for s in httpx.get(f"{url}/health", timeout=10, trust_env=False).json()["servers"]]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(process_alive(p) for p in engines):
        assert time.monotonic() < deadline, "the engines outlived their controller"
        time.sleep(0.05)


def update(url: str, checkpoint: Path, version: str) -> httpx.Response:
    body = {"checkpoint": str(checkpoint), "weight_version": version}
    return httpx.post(f"{url}/update_weights", json=body, timeout=120, trust_env=False)


def resumed_from(url: str) -> dict[str, Any]:
    report = httpx.get(f"{url}/health", timeout=10, trust_env=False).json()
    return dict(report["models"]["tiny"]["resumed_from"])


def test_a_controller_started_again_resumes_what_its_log_committed(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    events = tmp_path / "events"
    v3, v4 = read_manifest(checkpoints["v3"]), read_manifest(checkpoints["v4"])
    # Which copy is resumed when newer ones are gone or changed: tests/fast/events/test_resume.py.
    moving = copy_checkpoint(checkpoints["v3"], tmp_path / "moving")
    with serving(checkpoints["v1"], events) as (url, pid):
        for checkpoint, version in ((checkpoints["v2"], "5"), (moving, "10")):
            answer = update(url, checkpoint, version)
            assert answer.status_code == 200 and answer.json()["status"] == "committed", answer.text
        kill_hard(url, pid)

    with serving(checkpoints["v1"], events) as (url, pid):
        # It serves version 10 (v3's weights), not the --checkpoint's version 1, and says why.
        assert servers_of(url) == [("serving", "10", v3.checksum)]
        resumed = resumed_from(url)
        assert (resumed["weight_version"], resumed["checksum"]) == ("10", v3.checksum), resumed
        assert Path(resumed["checkpoint"]) == moving and resumed["note"] is None, resumed
        # Nothing at or below what the log committed commits again.
        older = update(url, checkpoints["v3"], "7")
        assert older.status_code == 409 and older.json()["status"] == "rejected", older.text
        assert "10" in older.json()["message"]
        # Pushed weights (on no disk) are resumed from the copy an engine writes out.
        v4_weights = saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoints["v4"]))
        asyncio.run(PushPublisher(url, path="shm", timeout_s=30).push(v4_weights, step=12))
        written = wait_for_write_out(events)
        kill_hard(url, pid)

    with serving(checkpoints["v1"], events) as (url, pid):
        assert servers_of(url) == [("serving", "12", v4.checksum)]
        resumed = resumed_from(url)
        assert resumed["weight_version"] == "12" and resumed["checkpoint"] == written, resumed
        assert update(url, checkpoints["v3"], "11").json()["status"] == "rejected"
        assert update(url, checkpoints["v3"], "13").json()["status"] == "committed"
    audit = subprocess.run(
        [sys.executable, "-m", "miles.cli", "events", str(events), "--check"], capture_output=True, text=True
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr


def wait_for_write_out(events: Path) -> str:
    """Where the log says pushed weights were written out, once it says so."""
    deadline = time.monotonic() + 60
    while True:
        for log in events.glob("*.jsonl"):
            for line in log.read_text().splitlines():
                if line and json.loads(line)["type"] == "weights_written_out":
                    return str(json.loads(line)["checkpoint"])
        assert time.monotonic() < deadline, "the pushed weights were never written out"
        time.sleep(0.1)

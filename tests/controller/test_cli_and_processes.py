"""The controller's command line against a real `miles serve`, and no engine outliving its parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from miles.rollout.engine_process import free_port
from miles.testing import process_alive, wait_serving


def _miles(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "miles.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_serve_update_health_commands(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "miles.cli",
            "serve",
            "--checkpoint",
            str(checkpoints["v1"]),
            "--servers",
            "2",
            "--port",
            str(port),
            "--events-dir",
            str(tmp_path / "events"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MILES_LOG_DIR": str(tmp_path / "logs")},
    )
    try:
        wait_serving(url, serve)
        health = _miles("health", "--url", url, "--json")
        assert health.returncode == 0, health.stderr
        report = json.loads(health.stdout)
        assert [s["state"] for s in report["servers"]] == ["serving", "serving"]
        pids = [s["pid"] for s in report["servers"]]

        table = _miles("health", "--url", url)
        assert table.returncode == 0 and "tiny-0" in table.stdout and "lock: free" in table.stdout
        assert max(len(line) for line in table.stdout.splitlines()) <= 80
        watched = _miles("health", "--url", url, "--watch", "--interval", "0.1", "--count", "3")
        assert watched.returncode == 0, watched.stderr
        assert "tiny-1" in watched.stdout and "lock: free" in watched.stdout
        lost = _miles(
            "health", "--url", f"http://127.0.0.1:{free_port()}", "--watch", "--interval", "0.1", "--count", "2"
        )
        assert lost.returncode == 0 and "cannot reach the controller" in lost.stdout

        updated = _miles("update", "--checkpoint", str(checkpoints["v2"]), "--url", url, "--strategy", "rolling")
        assert updated.returncode == 0, updated.stdout + updated.stderr
        assert "committed" in updated.stdout
        older = _miles("update", "--checkpoint", str(checkpoints["v1"]), "--url", url, "--json")
        assert older.returncode == 1
        assert json.loads(older.stdout)["status"] == "rejected"
        unreachable = _miles("health", "--url", f"http://127.0.0.1:{free_port()}")
        assert unreachable.returncode == 2 and "cannot reach" in unreachable.stderr
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
    assert serve.returncode == 0
    assert not any(process_alive(pid) for pid in pids)
    # The engines' logs hold what the engines say, not transformers' "Loading weights" bar.
    logs = sorted((tmp_path / "logs").glob("*.log"))
    assert [log.name for log in logs] == ["tiny-0.log", "tiny-1.log"]
    for log in logs:
        text = log.read_text()
        assert "Loading weights" not in text and "it/s]" not in text, text[-2000:]
    audit = _miles("events", str(tmp_path / "events"), "--check")
    assert audit.returncode == 0, audit.stdout
    timeline = _miles("events", str(tmp_path / "events"), "--timeline")
    assert timeline.returncode == 0, timeline.stderr
    assert " rolling committed " in timeline.stdout and " rejected " not in timeline.stdout
    for phase in ("lock_wait", "validate", "pause", "load", "confirm", "commit"):
        assert f"  {phase} " in timeline.stdout, timeline.stdout


def test_engines_die_with_a_parent_that_is_killed(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f'''
        import asyncio, sys
        from pathlib import Path
        from miles.rollout.spec import RolloutSpec
        from miles.rollout.sft_rollout import SFTRollout

        async def main():
            spec = RolloutSpec(
                name="orphan", checkpoint=Path("{checkpoints["v1"]}"), num_servers=2, num_threads=1,
                log_dir=Path("{tmp_path}") / "logs", snapshot_dir=Path("{tmp_path}") / "snapshots",
            )
            fleet = SFTRollout(spec)
            await fleet.start()
            print(" ".join(str(s.pid) for s in fleet.snapshot()), flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
    ''')
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(process_alive(p) for p in pids)
        parent.kill()  # no cleanup code runs in the parent: the engines must notice on their own
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(process_alive(p) for p in pids):
            assert time.monotonic() < deadline, "engines outlived their killed parent"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_serve_ends_waiting_requests_on_sigterm_and_leaves_no_files(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    serve = subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "serve", "--checkpoint", str(checkpoints["v1"]), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    try:
        wait_serving(url, serve)
        assert any(scratch.iterdir()), "the controller keeps its working files in the temp dir"
        body = {"text": "x", "stream": True, "min_weight_version": "999999", "sampling_params": {"max_new_tokens": 2}}
        answers: list[int] = []

        def wait_for_version() -> None:
            answers.append(httpx.post(f"{url}/generate", json=body, timeout=120, trust_env=False).status_code)

        client = threading.Thread(target=wait_for_version)
        client.start()
        time.sleep(1.0)  # the stream now waits for a version that will never come
        started = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
        client.join(timeout=60)
        assert time.monotonic() - started < 20
        assert answers == [503]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert serve.returncode == 0
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize(
    ("env", "flags", "expected"),
    [
        (
            {"MILES_ADMIN_TOKEN": "short"},
            [],
            "MILES_ADMIN_TOKEN: a token must have at least 16 characters; generate one with `openssl rand -hex 32`",
        ),
        ({"MILES_PORT": "abc"}, [], "MILES_PORT='abc': input should be a valid integer"),
        ({}, ["--port", "70000"], "--port=70000: input should be less than or equal to 65535"),
        (
            {"MILES_STARTUP_TIMEOUT_S": "-5"},
            [],
            "MILES_STARTUP_TIMEOUT_S='-5': input should be greater than or equal to 1",
        ),
        ({"MILES_DEFAULT_STRATEGY": "sideways"}, [], "input should be 'barrier' or 'rolling'"),
        ({}, ["--ray", "--cpus-per-engine", "-1"], "--cpus-per-engine=-1.0: input should be greater than 0"),
    ],
    ids=["short-token", "port-not-a-number", "port-flag-too-large", "negative-duration", "unknown-enum", "cpus-flag"],
)
def test_a_bad_setting_is_one_line_naming_it_and_nothing_starts(
    checkpoints: dict[str, Path], env: dict[str, str], flags: list[str], expected: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "miles.cli", "serve", "--checkpoint", str(checkpoints["v1"]), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("miles: ") and expected in lines[0], result.stderr[-3000:]
    if "MILES_ADMIN_TOKEN" in env:
        assert "short" not in lines[0]  # a credential is never shown, even a bad one

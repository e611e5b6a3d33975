"""No SGLang server outlives a controller killed outright (``kill -9`` of ``miles serve``): each runs
under ``miles.rollout.with_parent``, which ends it when its parent dies. The launcher is the test
suite's stand-in for ``sglang.launch_server``, which, like SGLang, does not watch its parent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from miles.rollout.engine_process import free_port
from miles.testing import descendants, process_alive

STANDIN = [sys.executable, str(Path(__file__).parent / "sglang_standin.py")]


def wait_for(predicate, *, what: str, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)  # other processes, observed through /proc and HTTP: nothing to wait on


def test_no_server_outlives_a_controller_killed_outright(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    fleet = {
        "policy": {
            "cls": "miles.rollout.sglang_rollout.SGLangRollout",
            "checkpoint": str(checkpoints["v1"]),
            "num_servers": 2,
            "devices": ["cpu", "cpu"],
            "sglang": {"launcher": STANDIN},
        }
    }
    spec = tmp_path / "fleet.json"
    spec.write_text(json.dumps(fleet))
    port = free_port()
    # Killed outright, the controller cannot remove its working files: they go under tmp_path.
    env = {**os.environ, "MILES_STATE_DIR": str(tmp_path / "state")}
    serve = subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "serve", "--fleet", str(spec), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )

    def healthy() -> bool:
        assert serve.poll() is None, "miles serve exited"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, what="miles serve to serve", timeout=120)
        tree = descendants(serve.pid)
        assert len(tree) >= 4, tree  # two wrappers and the two servers under them
        serve.kill()
        serve.wait()
        wait_for(lambda: not any(process_alive(p) for p in tree), what="every server to end", timeout=30)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()

"""``miles serve --ray``: a controller as the named actor on a Ray cluster of its own, its engines
as actors; stopped cleanly by Ctrl-C, nothing left behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from miles.rollout.engine_process import free_port
from miles.testing import process_alive

pytestmark = pytest.mark.timeout(300)


def test_serve_on_ray_answers_and_stops_with_everything_it_started(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A cluster of its own: Ray's files in a directory of this test's (short: Ray's socket paths
    # must fit in 107 bytes), no token authentication.
    ray_dir = Path(tempfile.mkdtemp(prefix="miles-ray-", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(ray_dir), "RAY_AUTH_MODE": "disabled"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "serve", "--ray", "--checkpoint", str(checkpoints["v1"])]
        + ["--servers", "2", "--port", str(port), "--cpus-per-engine", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 180
        report = None
        while time.monotonic() < deadline and serve.poll() is None:
            try:
                answer = httpx.get(f"{url}/health", trust_env=False, timeout=2)
                if answer.status_code == 200:
                    report = answer.json()
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert report is not None, "the controller did not answer /health (its stderr follows the failure)"
        servers = report["servers"]
        assert [s["state"] for s in servers] == ["serving", "serving"]
        assert all(s["node_id"] and s["node_address"] == "127.0.0.1" for s in servers)
        pids = [s["pid"] for s in servers]
        assert all(process_alive(pid) for pid in pids)
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)
        out, err = serve.communicate(timeout=90)
        shutil.rmtree(ray_dir, ignore_errors=True)
        if report is None:
            print(f"`miles serve --ray` exited {serve.returncode}; its stderr:\n{err[-5000:]}")
    assert serve.returncode == 0, err[-3000:]
    assert "miles_inference_controller" in err
    deadline = time.monotonic() + 30
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(process_alive(pid) for pid in pids)

"""``miles serve --ray``: a controller as the named actor on a Ray cluster of its own, its engines
as actors; on a two-core machine with no flags but the checkpoint; nothing listening beyond
loopback; stopped cleanly by Ctrl-C, nothing left behind; a placement the cluster cannot hold
refused within seconds, naming the flag to lower."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.rollout.engine_process import free_port
from miles.testing import descendants, on_loopback, process_alive
from miles.testing import listening as addresses

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def ray_dir() -> Iterator[Path]:
    """Ray's files for a cluster the command starts itself (short: Ray's socket paths must fit in
    107 bytes); every process still running from it killed afterwards, even when the test failed."""
    directory = Path(tempfile.mkdtemp(prefix="miles-ray-", dir="/tmp"))
    try:
        yield directory
    finally:
        for pid in _processes_under(directory):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(directory, ignore_errors=True)


def _processes_under(directory: Path) -> list[int]:
    """The processes whose command line names ``directory`` (a Ray cluster's raylet, GCS, workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if str(directory).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _serve(*args: str, ray_dir: Path, port: int) -> subprocess.Popen[str]:
    # A cluster of its own, no token authentication, bound to loopback.
    env = {**os.environ, "RAY_TMPDIR": str(ray_dir), "RAY_AUTH_MODE": "disabled", "MILES_PORT": str(port)}
    env.pop("MILES_NUM_CPUS_PER_ENGINE", None)
    return subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "serve", "--ray", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_serve_on_ray_with_no_flags_fits_two_cores_answers_on_loopback_and_stops_with_everything(
    checkpoints: dict[str, Path], ray_dir: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Two engines and no --cpus-per-engine: one CPU each would not fit two cores beside the
    # controller's actor, and used to wait out the 180 s start-up timeout.
    serve = _serve("--checkpoint", str(checkpoints["v1"]), "--servers", "2", ray_dir=ray_dir, port=port)
    report = None
    try:
        deadline = time.monotonic() + 150
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
        # The machine's CPUs, split: at most one each, together within what the node has.
        share = httpx.get(f"{url}/config", trust_env=False, timeout=10).json()["settings"]["num_cpus_per_engine"]
        assert 0 < share <= 1
        # Nothing the command started (the controller, Ray's processes, the engines) listens
        # anywhere but loopback.
        listening = addresses({serve.pid, *descendants(serve.pid), *pids})
        assert ("127.0.0.1", port) in listening
        assert [a for a in listening if not on_loopback(a[0])] == []
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)
        out, err = serve.communicate(timeout=90)
        if report is None:
            print(f"`miles serve --ray` exited {serve.returncode}; its stderr:\n{err[-5000:]}")
    assert serve.returncode == 0, err[-3000:]
    assert "miles_inference_controller" in err
    deadline = time.monotonic() + 30
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(process_alive(pid) for pid in pids)


def test_a_placement_the_machine_cannot_hold_fails_within_seconds_naming_the_flag(
    checkpoints: dict[str, Path], ray_dir: Path
) -> None:
    started = time.monotonic()
    serve = _serve(
        "--checkpoint", str(checkpoints["v1"]), "--servers", "2", "--cpus-per-engine", "8", ray_dir=ray_dir, port=0
    )
    try:
        # Ray's own start takes most of it; waiting on the placement group took 180 s more.
        out, err = serve.communicate(timeout=90)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.communicate()
    assert time.monotonic() - started < 90
    assert serve.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"miles: the cluster cannot place rollout tiny: 2 engines need 8 CPUs each \(16 in all\), the cluster has "
        r"[\d.]+ CPUs? free \([\d.]+ in all, 0\.1 held by this controller\): lower --cpus-per-engine "
        r"\(num_cpus_per_engine; [\d.]+ would fit\) or add nodes",
        last,
    ), last
    # The cluster it started is gone with it.
    deadline = time.monotonic() + 30
    while _processes_under(ray_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_under(ray_dir) == []

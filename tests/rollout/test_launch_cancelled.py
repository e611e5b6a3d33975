"""A launch cancelled while its process is being started (a controller stopping while the
supervisor restarts an engine) leaves no process running and no files behind: the thread that
forks cannot be cancelled, so the launch waits for it and stops what it started."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from miles.rollout.runtime import EngineCommand, LaunchSlot, LocalRuntime
from miles.rollout.spec import RolloutSpec


class Sleeper(EngineCommand):
    """The edge faked: an "engine" that never answers, marked so its process can be found."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def argv(self, slot: LaunchSlot, checkpoint: Path) -> list[str]:
        return [sys.executable, "-c", f"import time; time.sleep(120)  # {self.marker}"]

    def environment(self, slot: LaunchSlot) -> dict[str, str]:
        return {}


def marked(marker: str) -> list[int]:
    """The processes whose command line carries ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


async def test_a_launch_cancelled_while_its_process_starts_stops_it(tmp_path: Path) -> None:
    marker = f"miles-test-{uuid.uuid4().hex}"
    loop = asyncio.get_running_loop()
    # One worker: once a no-op has run on it, the launch's start (queued before) has finished.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    spec = RolloutSpec(
        name="cancelled",
        checkpoint=tmp_path,
        log_dir=tmp_path / "logs",
        snapshot_dir=tmp_path / "snapshots",
        startup_timeout_s=60,
    )
    runtime = LocalRuntime(spec)
    async with httpx.AsyncClient(trust_env=False) as http:
        launching = asyncio.create_task(runtime.launch("s-0", Sleeper(marker), tmp_path, device="cpu", http=http))
        await asyncio.sleep(0)  # the launch runs up to its first wait: the thread that starts the process
        launching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await launching
        await loop.run_in_executor(None, lambda: None)
        try:
            assert marked(marker) == [], "a cancelled launch left its process running"
            assert not runtime.alive("s-0")
        finally:
            await runtime.close()
            for pid in marked(marker):  # cleanup on failure: only the process this test started
                os.kill(pid, signal.SIGKILL)

"""miles.rollout.with_parent: a wrapped program never outlives whoever launched the wrapper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from miles.testing import descendants

# A launcher that starts the wrapper around a program that would run for ever (and starts a
# child of its own, as SGLang starts its scheduler), prints their pids, and waits.
LAUNCHER = """
import subprocess, sys, time
child = [sys.executable, "-c", "import time; time.sleep(600)"]
program = [sys.executable, "-c", f"import subprocess, time; subprocess.Popen({child!r}); time.sleep(600)"]
wrapper = subprocess.Popen([sys.executable, "-m", "miles.rollout.with_parent", "--", *program])
print(wrapper.pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return state == "Z"


def wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)  # a separate process ends in its own time; nothing to wait on but /proc
    return False


def start_launcher() -> tuple[subprocess.Popen[str], int, list[int]]:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    wrapper = int(launcher.stdout.readline())
    assert wait_for(lambda: len(descendants(wrapper)) == 2), "the program and its child did not start"
    return launcher, wrapper, descendants(wrapper)


def test_the_program_and_its_children_end_when_the_launcher_is_killed() -> None:
    launcher, wrapper, program = start_launcher()
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        assert wait_for(lambda: all(gone(p) for p in [wrapper, *program])), "something outlived the launcher"
    finally:
        for pid in [wrapper, *program]:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_program_ends_when_the_wrapper_itself_is_killed_outright() -> None:
    launcher, wrapper, program = start_launcher()
    try:
        os.kill(wrapper, signal.SIGKILL)
        assert wait_for(lambda: gone(program[0])), "the program outlived its wrapper"
    finally:
        launcher.kill()
        launcher.wait()
        for pid in program:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_ends_the_whole_group() -> None:
    launcher, wrapper, program = start_launcher()
    try:
        os.kill(wrapper, signal.SIGTERM)
        assert wait_for(lambda: all(gone(p) for p in [wrapper, *program])), "SIGTERM left something running"
    finally:
        launcher.kill()
        launcher.wait()

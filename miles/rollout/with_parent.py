"""Run a server program so that it never outlives the process that launched it.

``python -m miles.rollout.with_parent [--remove DIR] -- PROGRAM ARGS...`` runs PROGRAM in a
process group of its own and ends the whole group (SGLang's and vLLM's child processes too) when
told to stop, when the program exits, or when the wrapper's parent dies; killed outright, the
kernel ends the program (``PR_SET_PDEATHSIG``). ``--remove DIR`` is removed once it has ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys

_POLL_S = 0.5
# Less than its launcher gives it (EngineProcess.stop: 10 s) before SIGKILL: the group is ended and
# the directory removed before the wrapper itself could be killed, which would leave the directory.
_GRACE_S = 8.0
_PR_SET_PDEATHSIG = 1


def _die_with_this_process() -> None:
    # Runs in the child between fork and exec; this wrapper has a single thread, so that is safe.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pgid, sig)


def _end_group(child: subprocess.Popen[bytes], *, grace_s: float) -> None:
    _signal_group(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=grace_s)
    # Whatever the program started and left behind goes too.
    _signal_group(child.pid, signal.SIGKILL)
    child.wait()


def run(argv: list[str]) -> int:
    """Run ``argv`` until it exits or this process's parent dies; returns its exit code."""
    parent = os.getppid()
    child = subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_this_process)
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        try:
            code = child.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            if stopping or os.getppid() != parent:
                _end_group(child, grace_s=_GRACE_S)
                return 0 if stopping else 1
            continue
        _signal_group(child.pid, signal.SIGKILL)
        return code


def main() -> None:
    argv = sys.argv[1:]
    # ``--remove DIR``: a directory the program works in that goes with it (vLLM's sockets).
    remove: list[str] = []
    while argv[:1] == ["--remove"] and len(argv) > 1:
        remove.append(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m miles.rollout.with_parent [--remove DIR] -- PROGRAM [ARGS...]")
    try:
        code = run(argv)
    finally:
        for directory in remove:
            shutil.rmtree(directory, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()

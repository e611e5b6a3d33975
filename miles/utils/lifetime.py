"""Tying a process's life to another's: ``exit_when_gone(pid)`` ends this process when ``pid`` ends.

A child that must never outlive the process that launched it (an engine, a trainer rank) watches
its launcher through a pidfd, which becomes readable when that process exits, however it exits
(killed outright included), so nothing is left running when the launcher cannot clean up.
"""

from __future__ import annotations

import os
import select
import threading


def exit_when_gone(pid: int) -> None:
    """End this process (``os._exit(0)``) once ``pid`` has exited, watching from a daemon thread."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)

    def watch() -> None:
        select.select([pidfd], [], [])
        os._exit(0)

    threading.Thread(target=watch, name=f"miles-exit-with-{pid}", daemon=True).start()

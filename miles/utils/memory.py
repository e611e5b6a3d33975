"""How much host memory can be had now without pushing anything out."""

from __future__ import annotations

import contextlib
import os


def available_host_memory() -> int | None:
    """Bytes of host memory available now (None: unknown): ``MemAvailable`` (it counts
    reclaimable page cache), else ``sysconf``'s free pages."""
    # Not Linux, or an unexpected format: ask sysconf.
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None

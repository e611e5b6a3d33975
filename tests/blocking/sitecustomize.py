"""Imported at start-up by every Python process the suite starts (``tests/conftest.py`` puts this
directory on their PYTHONPATH): watches the process for blocking calls on its event loops, as the
suite's own process is watched, and leaves what it finds where the suite looks after each test.

The watch starts when the process's first event loop starts running (asyncio's and uvloop's
loops both announce themselves through ``asyncio._set_running_loop``): a blocking call can only
be caught on a running loop, and the imports before it (torch, transformers: thousands of file
reads) then run at full speed.

Ray's own processes (its workers, dashboard and monitors, started by the Ray runtime's tests) run
Ray's code on their loops, which is not ours to police; the engines they start are watched.
"""

import os
import sys
import threading
from pathlib import Path

_RAY_PACKAGE = f"{os.sep}site-packages{os.sep}ray{os.sep}"


def _watch_from_the_first_running_loop(log_dir: Path) -> None:
    import asyncio
    import asyncio.events

    announce = asyncio.events._set_running_loop
    once = threading.Lock()

    def set_running_loop(loop: object) -> None:
        if loop is not None and once.acquire(blocking=False):
            asyncio.events._set_running_loop = asyncio._set_running_loop = announce
            import no_blocking

            no_blocking.watch_this_process(log_dir)
        announce(loop)

    # uvloop looks the name up on ``asyncio`` once, when it is imported (after this module).
    asyncio.events._set_running_loop = asyncio._set_running_loop = set_running_loop


if os.environ.get("MILES_TEST_BLOCKING_LOG") and _RAY_PACKAGE not in (sys.argv[0] if sys.argv else ""):
    _watch_from_the_first_running_loop(Path(os.environ["MILES_TEST_BLOCKING_LOG"]))

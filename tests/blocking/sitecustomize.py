"""Imported at start-up by every Python process the suite starts (``tests/conftest.py`` puts this
directory on their PYTHONPATH): watches the process for blocking calls on its event loops, as the
suite's own process is watched, and leaves what it finds where the suite looks after each test.

Ray's own processes (its workers, dashboard and monitors, started by the Ray runtime's tests) run
Ray's code on their loops, which is not ours to police; the engines they start are watched.
"""

import os
import sys
from pathlib import Path

_RAY_PACKAGE = f"{os.sep}site-packages{os.sep}ray{os.sep}"

if os.environ.get("MILES_TEST_BLOCKING_LOG") and _RAY_PACKAGE not in (sys.argv[0] if sys.argv else ""):
    import no_blocking

    no_blocking.watch_this_process(Path(os.environ[no_blocking.LOG_DIR_ENV]))

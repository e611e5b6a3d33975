"""Imported at start-up by every Python process the suite starts (``tests/conftest.py`` puts this
directory on their PYTHONPATH): watches the process for blocking calls on its event loops, as the
suite's own process is watched, and leaves what it finds where the suite looks after each test."""

import os
from pathlib import Path

if os.environ.get("MILES_TEST_BLOCKING_LOG"):
    import no_blocking

    no_blocking.watch_this_process(Path(os.environ[no_blocking.LOG_DIR_ENV]))

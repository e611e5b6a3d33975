"""Switching off the progress bars of the libraries miles uses: miles shows its own progress, or none.

transformers draws a tqdm bar for every model it saves ("Writing model shards") or loads
("Loading weights"), and huggingface_hub one for every download; in miles' output, its engines'
logs and the benchmarks' tables they are noise (one per checkpoint a trainer writes), and in a
log file each redraw is another line. Called once at each process's start-up (the ``miles``
command, an engine, the forkserver engines are forked from, a benchmark), never at import time.
"""

from __future__ import annotations

import os
import sys

# huggingface_hub reads it when imported, and transformers asks huggingface_hub when imported: set
# before either is, it turns off both (in this process and in the processes it starts).
_HUB_VARIABLE = "HF_HUB_DISABLE_PROGRESS_BARS"


def disable_library_progress_bars() -> None:
    """Turn off transformers' and huggingface_hub's progress bars for this process and its children.

    Imports neither library (the ``miles`` command starts without them); where one is imported
    already, its bars are switched off through its own API as well.
    """
    os.environ[_HUB_VARIABLE] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()

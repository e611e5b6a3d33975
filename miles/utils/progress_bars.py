"""Switching off the progress bars of the libraries miles uses: miles shows its own progress, or none.

transformers and huggingface_hub draw a tqdm bar per model saved, loaded or downloaded: noise in
miles' output and logs (a line per redraw). Called once at each process's start-up, never at import.
"""

from __future__ import annotations

import os
import sys

# huggingface_hub reads it when imported, and transformers asks huggingface_hub when imported: set
# before either is, it turns off both (in this process and in the processes it starts).
_HUB_VARIABLE = "HF_HUB_DISABLE_PROGRESS_BARS"


def disable_library_progress_bars() -> None:
    """Turn off transformers' and huggingface_hub's progress bars for this process and its
    children, importing neither (where one is imported already, through its own API too)."""
    os.environ[_HUB_VARIABLE] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()

"""No blocking call on a running event loop: BlockBuster with miles' allow-list, for the suite's
own process (``tests/conftest.py``) and, through ``sitecustomize.py`` here, for every Python
process the suite starts (engines, the CLI).

BlockBuster patches the blocking calls (``time.sleep``, file and socket I/O, ``os`` calls, a
contended ``threading.Lock``...) to raise ``BlockingError`` when they run on a thread whose event
loop is running. What may block anyway, and why, is listed in ``MAY_BLOCK``; besides that, test
code may block its own loop (see ``_made_by_test_code``).
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import blockbuster.blockbuster
from blockbuster import BlockBuster, BlockingError

_ROOT = Path(__file__).resolve().parents[2]
_TEST_CODE = (str(_ROOT / "tests") + os.sep, str(_ROOT / "miles" / "testing.py"))
_OUR_CODE = (str(_ROOT / "miles") + os.sep, str(_ROOT / "tests") + os.sep)
_ASYNC_CODE = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE

# Calls inside which blocking on a running loop is accepted, for every kind of blocking call:
# (the end of a file's path, function names).
MAY_BLOCK: tuple[tuple[str, set[str]], ...] = (
    # logging's handlers write each record where it is logged (pytest's capture handlers too):
    # the accepted cost of logging from asyncio code, here as in production.
    ("logging/__init__.py", {"emit", "flush"}),
    # FastAPI looks up an endpoint's source file once per route (then cached), for its errors.
    ("fastapi/routing.py", {"_extract_endpoint_context"}),
    # The event log appends one flushed line per event where the event happens; EventLogger's
    # docstring says why that stays on the caller's thread, the loop included.
    ("miles/utils/audit_utils/event_logger/logger.py", {"_write", "_open_file"}),
    # Start-up, before the controller serves anything: reading each model's manifest, creating
    # its state directory. The blocking facade builds it on its loop thread (its asyncio parts
    # belong to that loop), so this runs on a loop that serves nothing yet.
    ("miles/controller/core.py", {"__init__"}),
    # A rollout reads its start checkpoint's manifest (a few KB) once, when it is built, to know
    # the name of the model it serves: construction, before it runs anything.
    ("miles/rollout/rollout.py", {"__init__"}),
)


def _made_by_test_code() -> bool:
    """Whether test code made the blocking call itself (reading a manifest to compare with,
    corrupting a file): the nearest frame that is test code or an async function, within what
    the loop is running, is test code. That blocks only the test's own loop, at its choice; a
    blocking call reached from an async function of the product is what this module catches."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == __file__:
            frame = frame.f_back  # this module's own frames, from BlockBuster's check
            continue
        if code.co_filename.startswith(_TEST_CODE):
            return True
        if code.co_flags & _ASYNC_CODE:
            return False
        if code.co_name == "_run" and code.co_filename.endswith(os.path.join("asyncio", "events.py")):
            return False  # the loop's callback: what called the loop is not running on it
        frame = frame.f_back
    return False


def watch(on_blocking: Callable[[str], None]) -> BlockBuster:
    """Activate BlockBuster: a blocking call on a running loop raises BlockingError where it is
    made, and ``on_blocking`` gets where it was made from, even if the code catches the error (a
    handler answering 500, a control loop logging it and going on). ``deactivate()`` undoes it."""

    class RecordedBlockingError(BlockingError):
        def __init__(self, func: str) -> None:
            super().__init__(func)
            ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(_OUR_CODE)]
            on_blocking(f"{func}, called from:\n{''.join(traceback.format_list(ours[-8:]))}")

    # The patched calls raise whatever this name holds when they are called.
    blockbuster.blockbuster.BlockingError = RecordedBlockingError
    buster = BlockBuster()
    for function in buster.functions.values():
        blocking_is_fine = function.can_block_predicate
        function.can_block_predicate = lambda *a, _fine=blocking_is_fine, **k: _fine(*a, **k) or _made_by_test_code()
        for filename, names in MAY_BLOCK:
            function.can_block_in(filename, names)
    buster.activate()
    return buster


LOG_DIR_ENV = "MILES_TEST_BLOCKING_LOG"


def watch_this_process(log_dir: Path) -> None:
    """``watch`` for the whole life of this process, appending what it finds to a file of its own
    in ``log_dir`` (read by the suite after each test)."""
    log = log_dir / f"{os.getpid()}.log"
    command = " ".join(sys.orig_argv)

    def record(found: str) -> None:
        with open(log, "a") as out:
            out.write(f"in `{command}`: {found}\n")

    watch(record)

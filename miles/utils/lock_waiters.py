"""The FIFO queue of tasks waiting for a ContextLock: hand-off, reminders, cancellation safety."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

GrantT = TypeVar("GrantT")


@dataclass(eq=False, slots=True)
class _Waiter(Generic[GrantT]):
    holder: str
    future: asyncio.Future[GrantT]
    enqueued_mono: float
    reminder: asyncio.TimerHandle | None = None


class WaiterQueue(Generic[GrantT]):
    """Tasks waiting for one lock, served strictly first come, first served.

    The lock hands its next grant straight to the first waiter (``grant_next``), so a newcomer
    can never overtake the queue. Must be used from the loop that runs the waiting tasks.
    """

    def __init__(
        self,
        *,
        lock_name: str,
        reminder_interval_s: float,
        describe_holder: Callable[[], str],
        logger: logging.Logger,
    ) -> None:
        self._lock_name = lock_name
        self._reminder_interval_s = reminder_interval_s
        self._describe_holder = describe_holder
        self._logger = logger
        self._waiters: deque[_Waiter[GrantT]] = deque()

    def live_count(self) -> int:
        """How many tasks are still waiting (cancelled ones not yet cleaned up excluded)."""
        # copy() is atomic under the GIL, so statistics() may call this from another thread.
        return sum(1 for waiter in self._waiters.copy() if not waiter.future.done())

    async def wait(
        self, *, holder: str, timeout: float | None, on_lost_grant: Callable[[GrantT], None]
    ) -> GrantT:
        """Queue the current task and return the grant ``grant_next`` hands it.

        Raises TimeoutError after ``timeout`` seconds and CancelledError when cancelled; either
        way the waiter leaves the queue. A waiter granted just before its cancellation took
        effect calls ``on_lost_grant(grant)`` so the lock passes on instead of leaking.
        """
        loop = asyncio.get_running_loop()
        waiter: _Waiter[GrantT] = _Waiter(
            holder=holder, future=loop.create_future(), enqueued_mono=time.monotonic()
        )
        self._waiters.append(waiter)
        waiter.reminder = loop.call_later(self._reminder_interval_s, self._remind, waiter)
        try:
            # asyncio.timeout, not wait_for: wait_for (3.11) would run this in a new task, and
            # the caller records its grant in its own context right after we return.
            async with asyncio.timeout(timeout):
                try:
                    return await waiter.future
                except asyncio.CancelledError:
                    self._leave(waiter, on_lost_grant)
                    raise
        finally:
            if waiter.reminder is not None:
                waiter.reminder.cancel()

    def grant_next(self, make_grant: Callable[[str, float], GrantT]) -> bool:
        """Hand ``make_grant(holder, waited_s)`` to the first live waiter; False if none waits."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if waiter.future.done():  # cancelled; its task cleans up in _leave
                continue
            waited = time.monotonic() - waiter.enqueued_mono
            waiter.future.set_result(make_grant(waiter.holder, waited))
            return True
        return False

    def _leave(self, waiter: _Waiter[GrantT], on_lost_grant: Callable[[GrantT], None]) -> None:
        if waiter.future.done() and not waiter.future.cancelled():
            on_lost_grant(waiter.future.result())
            return
        waiter.future.cancel()
        with contextlib.suppress(ValueError):  # grant_next may have popped it already
            self._waiters.remove(waiter)

    def _remind(self, waiter: _Waiter[GrantT]) -> None:
        if waiter.future.done():
            return
        self._logger.warning(
            "%r has waited %.1fs for lock %r, which is %s; if that holder is stuck, end its "
            "section (release / release_token) or give its lease a TTL",
            waiter.holder,
            time.monotonic() - waiter.enqueued_mono,
            self._lock_name,
            self._describe_holder(),
        )
        loop = asyncio.get_running_loop()
        waiter.reminder = loop.call_later(self._reminder_interval_s, self._remind, waiter)

"""ContextLock: owner tracking by context, not re-entrant, FIFO waiters with reminders, fencing
tokens, statistics. Interleavings are forced with events, never with sleeps."""

from __future__ import annotations

import asyncio
import contextvars
import logging

import pytest

from miles.errors import LockNestingError, LockNotHeldError, LockReentryError, LockTimeoutError
from miles.testing import wait_until
from miles.utils.context_lock import ContextLock, LockTransition, LockTransitionKind


class Holder:
    """A task that holds the lock until told to let go (tasks it did not start stay strangers)."""

    def __init__(self, lock: ContextLock, name: str = "holder") -> None:
        self.held = asyncio.Event()
        self.let_go = asyncio.Event()
        self.task = asyncio.create_task(self._run(lock, name))

    async def _run(self, lock: ContextLock, name: str) -> None:
        async with lock.hold(holder=name):
            self.held.set()
            await self.let_go.wait()

    async def release(self) -> None:
        self.let_go.set()
        await self.task


async def holding(lock: ContextLock, name: str = "holder") -> Holder:
    holder = Holder(lock, name)
    await holder.held.wait()
    return holder


async def test_a_grant_has_a_fresh_token_and_statistics_show_the_holder() -> None:
    lock = ContextLock("L")
    assert lock.statistics().held is False
    first = await lock.acquire(holder="a")
    stats = lock.statistics()
    assert (stats.held, stats.holder, stats.token, stats.waiters) == (True, "a", first.token, 0)
    lock.release()
    async with lock.hold(holder="b") as second:
        assert second.token > first.token
    assert lock.statistics().held is False


async def test_ownership_follows_the_context_and_its_child_tasks() -> None:
    lock = ContextLock("L")
    async with lock.hold(holder="owner"):
        assert lock.owned()

        async def child() -> bool:
            return lock.owned()

        assert await asyncio.create_task(child())
    # A task started outside the section does not own it.
    seen = asyncio.Event()
    other_owned: list[bool] = []

    async def stranger() -> None:
        await seen.wait()
        other_owned.append(lock.owned())

    task = asyncio.create_task(stranger())
    async with lock.hold(holder="owner"):
        seen.set()
        await task
    assert other_owned == [False]


async def test_a_child_that_outlives_the_section_loses_it() -> None:
    lock = ContextLock("L")
    go = asyncio.Event()

    async def late_child() -> bool:
        await go.wait()
        return lock.owned()

    async with lock.hold(holder="owner"):
        task = asyncio.create_task(late_child())
    go.set()
    assert await task is False


async def test_taking_it_twice_or_nesting_two_locks_is_refused() -> None:
    lock, other = ContextLock("L"), ContextLock("M")
    async with lock.hold(holder="a"):
        with pytest.raises(LockReentryError, match="already holds"):
            await lock.acquire(holder="a again")
        with pytest.raises(LockNestingError, match="while holding lock 'L'"):
            await other.acquire(holder="a")
    assert lock.statistics().held is False and other.statistics().held is False


async def test_releasing_without_holding_is_refused() -> None:
    lock = ContextLock("L")
    with pytest.raises(LockNotHeldError, match="does not hold"):
        lock.release()
    holder = await holding(lock)
    # The test's own task did not inherit the holder's grant: it cannot release the lock.
    with pytest.raises(LockNotHeldError):
        lock.release()
    await holder.release()


async def test_waiters_are_served_first_come_first_served() -> None:
    lock = ContextLock("L")
    order: list[str] = []
    first = await holding(lock, "first")

    async def waiter(name: str) -> None:
        async with lock.hold(holder=name):
            order.append(name)

    tasks = []
    for name in ("w1", "w2", "w3"):
        tasks.append(asyncio.create_task(waiter(name)))
        await wait_until(lambda: lock.statistics().waiters >= len(tasks), what=f"{name} to wait", interval=0)
    await first.release()
    await asyncio.gather(*tasks)
    assert order == ["w1", "w2", "w3"]


async def test_a_timed_out_or_cancelled_waiter_leaves_no_trace() -> None:
    lock = ContextLock("L")
    holder = await holding(lock)
    with pytest.raises(LockTimeoutError, match="gave up"):
        await lock.acquire(holder="impatient", timeout=0.01)
    cancelled = asyncio.create_task(lock.acquire(holder="cancelled"))
    await wait_until(lambda: lock.statistics().waiters >= 1, what="a waiter", interval=0)
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    assert lock.statistics().waiters == 0
    await holder.release()
    async with lock.hold(holder="next"):
        assert lock.statistics().holder == "next"


async def test_a_waiter_cancelled_as_it_is_granted_passes_the_lock_on() -> None:
    lock = ContextLock("L")
    await lock.acquire(holder="holder")
    loop = asyncio.get_running_loop()
    # Fresh contexts: these tasks must not inherit the grant the test's own context holds.
    unlucky = loop.create_task(lock.acquire(holder="unlucky"), context=contextvars.Context())
    patient = loop.create_task(lock.acquire(holder="patient"), context=contextvars.Context())
    await wait_until(lambda: lock.statistics().waiters >= 2, what="two waiters", interval=0)
    lock.release()  # hands the lock to "unlucky", which has not resumed yet...
    unlucky.cancel()  # ...and is cancelled before it can
    await asyncio.gather(unlucky, return_exceptions=True)
    grant = await patient
    assert lock.statistics().holder == "patient" and grant.holder == "patient"


async def test_a_waiter_is_reminded_of_who_holds_the_lock(caplog: pytest.LogCaptureFixture) -> None:
    lock = ContextLock("L", reminder_interval_s=0.01)
    holder = await holding(lock, "slow holder")
    waiting = asyncio.create_task(lock.hold(holder="waiter").__aenter__())
    with caplog.at_level(logging.WARNING, logger="miles.lock"):
        await wait_until(
            lambda: any("slow holder" in r.getMessage() for r in caplog.records), what="a reminder", interval=0.005
        )
    await holder.release()
    await waiting


async def test_transitions_are_reported_and_a_failing_hook_breaks_nothing() -> None:
    seen: list[LockTransition] = []

    def hook(transition: LockTransition) -> None:
        seen.append(transition)
        raise RuntimeError("observer bug")

    lock = ContextLock("L", on_transition=hook)
    async with lock.hold(holder="a") as grant:
        pass
    assert [(t.kind, t.holder, t.token) for t in seen] == [
        (LockTransitionKind.ACQUIRED, "a", grant.token),
        (LockTransitionKind.RELEASED, "a", grant.token),
    ]
    assert seen[1].held_s is not None and seen[0].waited_s == 0.0


async def test_hold_releases_when_its_block_raises() -> None:
    lock = ContextLock("L")
    with pytest.raises(ValueError, match="boom"):
        async with lock.hold(holder="a"):
            raise ValueError("boom")
    assert lock.statistics().held is False


def test_a_lock_needs_a_name_and_a_positive_reminder() -> None:
    with pytest.raises(ValueError, match="name"):
        ContextLock("")
    with pytest.raises(ValueError, match="reminder_interval_s"):
        ContextLock("L", reminder_interval_s=0)

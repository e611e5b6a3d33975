"""ContextLock: mutual exclusion, ownership by context, fencing tokens, leases, observability."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from datetime import UTC, datetime

import pytest

from miles.errors import (
    LeaseExpiredError,
    LockError,
    LockNestingError,
    LockNotHeldError,
    LockReentryError,
    LockTimeoutError,
    StaleLockError,
)
from miles.utils.context_lock import (
    ContextLock,
    LockLease,
    LockTransition,
    LockTransitionKind,
)


class _Recorder:
    def __init__(self) -> None:
        self.transitions: list[LockTransition] = []

    def __call__(self, transition: LockTransition) -> None:
        self.transitions.append(transition)

    def kinds(self) -> list[tuple[LockTransitionKind, str, int]]:
        return [(t.kind, t.holder, t.token) for t in self.transitions]


def _outside(coro):
    # A task in a fresh context: spawned from inside a section it would inherit the section (and
    # acquiring would then be re-entry), so competing holders are started this way.
    return asyncio.create_task(coro, context=contextvars.Context())


async def _until(predicate) -> None:
    # Yield to the loop (no timed sleep) until the other tasks have reached the awaited state.
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


# --- mutual exclusion and fairness -------------------------------------------------------------


async def test_sections_never_overlap_and_are_served_in_arrival_order() -> None:
    lock = ContextLock("InferenceController")
    inside = 0
    order: list[int] = []

    async def worker(index: int) -> None:
        nonlocal inside
        async with lock:
            inside += 1
            assert inside == 1
            order.append(index)
            for _ in range(3):
                await asyncio.sleep(0)
                assert inside == 1
            inside -= 1

    await asyncio.gather(*(worker(i) for i in range(50)))
    assert order == list(range(50))
    assert lock.statistics().held is False
    assert lock.statistics().token is None


async def test_async_with_defaults_the_holder_to_the_task_name() -> None:
    lock = ContextLock("L")

    async def body() -> str | None:
        async with lock as lease:
            assert isinstance(lease, LockLease)
            return lock.statistics().holder

    assert await asyncio.create_task(body(), name="weight-pusher") == "weight-pusher"


async def test_reentry_raises_at_once_in_the_section_and_in_its_children() -> None:
    lock = ContextLock("InferenceController")
    async with lock.hold(holder="update_rollout_weights") as lease:
        with pytest.raises(LockReentryError) as caught:
            await lock.acquire(holder="again")
        message = str(caught.value)
        assert "InferenceController" in message
        assert "update_rollout_weights" in message
        assert f"token {lease.token}" in message
        assert "@requires_lock" in message  # says how to fix it

        async def child() -> None:
            async with lock:
                pass

        with pytest.raises(LockReentryError):
            await asyncio.create_task(child())
    assert not lock.owned()


async def test_nesting_a_second_lock_raises() -> None:
    outer = ContextLock("InferenceController")
    inner = ContextLock("Router")
    async with outer.hold(holder="restart"):
        with pytest.raises(LockNestingError) as caught:
            await inner.acquire(holder="route")
        assert "InferenceController" in str(caught.value)
        assert "Router" in str(caught.value)
        assert inner.statistics().held is False
    async with inner.hold(holder="route"):  # fine once the first lock is released
        assert inner.owned()


async def test_a_body_that_raises_releases() -> None:
    recorder = _Recorder()
    lock = ContextLock("L", on_transition=recorder)
    with pytest.raises(ValueError, match="boom"):
        async with lock.hold(holder="h"):
            raise ValueError("boom")
    assert lock.statistics().held is False
    assert recorder.kinds() == [
        (LockTransitionKind.ACQUIRED, "h", 1),
        (LockTransitionKind.RELEASED, "h", 1),
    ]


async def test_a_cancelled_body_releases() -> None:
    lock = ContextLock("L")
    entered = asyncio.Event()

    async def body() -> None:
        async with lock.hold(holder="stuck"):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(body())
    await entered.wait()
    assert lock.statistics().holder == "stuck"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert lock.statistics().held is False
    async with lock.hold(holder="next", timeout=1):
        assert lock.owned()


async def test_a_waiter_cancelled_while_waiting_leaves_no_trace() -> None:
    recorder = _Recorder()
    lock = ContextLock("L", on_transition=recorder)
    await lock.acquire(holder="holder")
    waiter = _outside(lock.acquire(holder="waiter"))
    await _until(lambda: lock.statistics().waiters == 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert lock.statistics().waiters == 0
    lock.release()
    assert lock.statistics().held is False
    lease = await lock.acquire(holder="after")
    assert lease.token == 2  # the cancelled waiter consumed no token
    lock.release()
    assert [k for k in recorder.kinds() if k[1] == "waiter"] == []


async def test_a_waiter_cancelled_just_after_being_granted_passes_the_lock_on() -> None:
    recorder = _Recorder()
    lock = ContextLock("L", on_transition=recorder)
    await lock.acquire(holder="holder")
    first = _outside(lock.acquire(holder="first"))
    await _until(lambda: lock.statistics().waiters == 1)
    second = _outside(lock.acquire(holder="second"))
    await _until(lambda: lock.statistics().waiters == 2)
    lock.release()  # hands the lock to "first" ...
    first.cancel()  # ... which is cancelled before it can resume
    with pytest.raises(asyncio.CancelledError):
        await first
    lease = await second
    assert lease.holder == "second"
    assert lock.statistics().holder == "second"
    assert recorder.kinds()[-3:] == [
        (LockTransitionKind.ACQUIRED, "first", 2),
        (LockTransitionKind.RELEASED, "first", 2),
        (LockTransitionKind.ACQUIRED, "second", 3),
    ]


async def test_acquire_timeout_raises_and_leaves_no_trace() -> None:
    lock = ContextLock("InferenceController")
    await lock.acquire(holder="long_update")
    with pytest.raises(LockTimeoutError) as caught:
        await _outside(lock.acquire(holder="impatient", timeout=0.02))
    assert isinstance(caught.value, TimeoutError)
    assert "long_update" in str(caught.value) and "impatient" in str(caught.value)
    assert lock.statistics().waiters == 0
    lock.release()
    assert lock.statistics().held is False


# --- ownership follows the context -------------------------------------------------------------


async def test_child_tasks_share_the_section_but_a_stale_child_is_refused() -> None:
    lock = ContextLock("InferenceController")
    check_inside = asyncio.Event()
    checked_inside = asyncio.Event()
    check_after = asyncio.Event()

    async def child() -> None:
        await check_inside.wait()
        lock.check_owned("push weights")  # inherited: owns the section
        with pytest.raises(LockNotHeldError, match="only the task that entered"):
            lock.release()
        checked_inside.set()
        await check_after.wait()
        lock.check_owned("push weights")  # the section ended and someone else holds the lock

    async with lock.hold(holder="update"):
        spawned = asyncio.create_task(child())
        check_inside.set()
        await checked_inside.wait()
    async with lock.hold(holder="restart") as other:
        check_after.set()
        with pytest.raises(StaleLockError) as caught:
            await spawned
        message = str(caught.value)
        assert "push weights" in message and "token 1" in message
        assert "restart" in message and f"token {other.token}" in message
        assert lock.owned()


async def test_check_owned_outside_any_section_raises_not_held() -> None:
    lock = ContextLock("InferenceController")
    with pytest.raises(LockNotHeldError, match="async with lock"):
        lock.check_owned("reconfigure")
    assert lock.owned() is False


async def test_releasing_twice_raises_stale() -> None:
    lock = ContextLock("L")
    await lock.acquire(holder="h")
    lock.release()
    with pytest.raises(StaleLockError, match="was released"):
        lock.release()


async def test_with_released_lets_another_task_in_and_reacquires_with_a_new_token() -> None:
    lock = ContextLock("InferenceController")
    other_ran = asyncio.Event()
    child_may_check = asyncio.Event()

    async def other() -> None:
        async with lock.hold(holder="health_probe"):
            other_ran.set()

    async def child() -> None:
        await child_may_check.wait()
        lock.check_owned("late child")

    async with lock.hold(holder="update") as first:
        spawned = asyncio.create_task(child())
        waiting = _outside(other())
        await _until(lambda: lock.statistics().waiters == 1)
        async with lock.with_released():
            assert not lock.owned()
            await other_ran.wait()
        assert lock.owned()
        second = lock.current_lease()
        assert second.holder == "update"
        assert second.token > first.token + 0
        assert second.token == 3  # update=1, health_probe=2, update again=3
        child_may_check.set()
        with pytest.raises(StaleLockError):
            await spawned
    await waiting
    assert lock.statistics().held is False


async def test_check_owned_works_from_a_worker_thread_that_copied_the_context() -> None:
    lock = ContextLock("L")
    async with lock.hold(holder="h"):
        assert await asyncio.to_thread(lock.owned) is True
    with pytest.raises(LockError, match="event loop"):
        await asyncio.to_thread(lock.release)


# --- detached sections and leases --------------------------------------------------------------


async def test_detach_and_reattach_carry_a_section_across_tasks() -> None:
    lock = ContextLock("InferenceController")
    await lock.acquire(holder="start_update_weights")
    lease = lock.detach()
    assert lease.expires_at is None
    assert not lock.owned()
    with pytest.raises(StaleLockError, match=rf"reattach\({lease.token}\)"):
        lock.check_owned("push")
    stats = lock.statistics()
    assert stats.held and stats.detached and stats.token == lease.token

    async def end_window() -> None:
        resumed = lock.reattach(lease.token)
        assert resumed.token == lease.token
        assert lock.owned()
        lock.release()

    await asyncio.create_task(end_window())
    assert lock.statistics().held is False
    with pytest.raises(StaleLockError, match="was released"):
        lock.reattach(lease.token)
    with pytest.raises(StaleLockError, match="never issued"):
        lock.release_token(99)


async def test_a_lease_with_a_short_ttl_expires_and_its_token_is_refused() -> None:
    recorder = _Recorder()
    lock = ContextLock("InferenceController", on_transition=recorder)
    expired: list[LockLease] = []
    await lock.acquire(holder="start_update_weights")
    lease = lock.detach(ttl_s=0.05, on_expire=expired.append)
    assert lease.expires_at is not None and lease.expires_at > datetime.now(UTC)

    # Training died: the next holder waits, and gets the lock once the lease runs out.
    nxt = await lock.acquire(holder="update_rollout_weights", timeout=5)
    assert nxt.token == lease.token + 1
    assert [e.token for e in expired] == [lease.token]
    expiry = [t for t in recorder.transitions if t.kind is LockTransitionKind.LEASE_EXPIRED]
    assert len(expiry) == 1
    assert expiry[0].token == lease.token and expiry[0].holder == "start_update_weights"
    assert expiry[0].held_s is not None and expiry[0].held_s >= 0.04
    lock.release()

    with pytest.raises(LeaseExpiredError):
        lock.reattach(lease.token)
    with pytest.raises(LeaseExpiredError):
        lock.renew(lease.token, 10)
    with pytest.raises(LeaseExpiredError) as caught:
        lock.release_token(lease.token)
    assert "InferenceController" in str(caught.value) and f"token {lease.token}" in str(caught.value)


async def test_an_overdue_lease_expires_even_while_the_loop_is_busy() -> None:
    lock = ContextLock("L")
    expired: list[LockLease] = []
    await lock.acquire(holder="h")
    lease = lock.detach(ttl_s=0.01, on_expire=expired.append)
    time.sleep(0.03)  # block the loop: the timer cannot run, the lazy check must catch it
    assert lock.statistics().held is False
    assert [e.token for e in expired] == [lease.token]
    with pytest.raises(LeaseExpiredError):
        lock.reattach(lease.token)


async def test_renew_extends_a_lease() -> None:
    lock = ContextLock("L")
    await lock.acquire(holder="h")
    lease = lock.detach(ttl_s=0.05)
    renewed = lock.renew(lease.token, 30)
    assert renewed.token == lease.token
    assert renewed.expires_at is not None and lease.expires_at is not None
    assert renewed.expires_at > lease.expires_at
    await asyncio.sleep(0.1)  # past the original TTL
    assert lock.statistics().held is True
    assert lock.statistics().lease_expires_at == renewed.expires_at
    lock.release_token(lease.token)
    with pytest.raises(StaleLockError):
        lock.release_token(lease.token)


async def test_a_failing_on_expire_or_on_transition_hook_never_breaks_the_lock(caplog) -> None:
    def broken(_: object) -> None:
        raise RuntimeError("hook bug")

    lock = ContextLock("L", on_transition=broken)
    with caplog.at_level(logging.ERROR, logger="miles.lock"):
        await lock.acquire(holder="h")
        lock.detach(ttl_s=0.01, on_expire=broken)
        time.sleep(0.02)
        assert lock.statistics().held is False
        async with lock.hold(holder="next"):
            assert lock.owned()
    assert "on_transition hook" in caplog.text and "on_expire callback" in caplog.text


# --- observability -----------------------------------------------------------------------------


async def test_statistics_snapshot_fields() -> None:
    lock = ContextLock("InferenceController")
    free = lock.statistics()
    assert (free.name, free.held, free.holder, free.held_since, free.token) == (
        "InferenceController",
        False,
        None,
        None,
        None,
    )
    assert (free.waiters, free.detached, free.lease_expires_at) == (0, False, None)

    before = datetime.now(UTC)
    await lock.acquire(holder="update_rollout_weights")
    waiter = _outside(lock.acquire(holder="restart"))
    await _until(lambda: lock.statistics().waiters == 1)
    held = lock.statistics()
    assert held.held and held.holder == "update_rollout_weights" and held.token == 1
    assert held.held_since is not None and before <= held.held_since <= datetime.now(UTC)
    assert held.waiters == 1 and held.detached is False and held.lease_expires_at is None

    lease = lock.detach(ttl_s=60)
    detached = lock.statistics()
    assert detached.detached is True and detached.lease_expires_at == lease.expires_at
    lock.release_token(lease.token)
    await waiter
    assert lock.statistics().holder == "restart"
    with pytest.raises(AttributeError):
        detached.held = False  # type: ignore[misc]


async def test_a_waiter_logs_a_reminder_naming_lock_waiter_and_holder(caplog) -> None:
    lock = ContextLock("InferenceController", reminder_interval_s=0.01)
    reminded = asyncio.Event()

    class _Signal(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reminded.set()

    signal = _Signal(level=logging.WARNING)
    logging.getLogger("miles.lock").addHandler(signal)
    try:
        with caplog.at_level(logging.WARNING, logger="miles.lock"):
            await lock.acquire(holder="update_rollout_weights")
            waiter = _outside(lock.acquire(holder="restart_servers"))
            await asyncio.wait_for(reminded.wait(), timeout=5)
            lock.release()
            await waiter
    finally:
        logging.getLogger("miles.lock").removeHandler(signal)
    message = caplog.records[0].getMessage()
    assert "InferenceController" in message
    assert "restart_servers" in message and "update_rollout_weights" in message
    assert "token 1" in message and "waited" in message


async def test_a_lock_busy_on_one_loop_refuses_another_loop() -> None:
    lock = ContextLock("L")
    await lock.acquire(holder="h")
    errors: list[BaseException] = []

    def other_loop() -> None:
        try:
            asyncio.run(lock.acquire(holder="elsewhere"))
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    thread = threading.Thread(target=other_loop)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], LockError)
    assert "another event loop" in str(errors[0])
    lock.release()


async def test_an_attached_section_cannot_be_taken_over_by_token() -> None:
    lock = ContextLock("InferenceController")
    entered = asyncio.Event()
    leave = asyncio.Event()

    async def owner() -> None:
        async with lock.hold(holder="update"):
            entered.set()
            await leave.wait()

    task = _outside(owner())
    await entered.wait()
    token = lock.statistics().token
    assert token is not None
    with pytest.raises(LockNotHeldError, match="attached to another context"):
        lock.release_token(token)
    with pytest.raises(LockNotHeldError, match="attached to another context"):
        lock.reattach(token)
    leave.set()
    await task

    await lock.acquire(holder="window")
    lease = lock.detach()
    lock.reattach(lease.token)
    with pytest.raises(LockReentryError):
        lock.reattach(lease.token)
    lock.release_token(lease.token)  # the owning context may end its section by token too
    assert lock.statistics().held is False

"""The errors a ContextLock raises when it refuses a use: each names the lock, holder and token.

Kept apart from the lock so its logic reads without the prose; every message says how to fix the
misuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.errors import (
    LeaseExpiredError,
    LockError,
    LockNestingError,
    LockNotHeldError,
    LockReentryError,
    LockTimeoutError,
    StaleLockError,
)

FIX_STALE = (
    "a task that outlives its section loses its authority: do this work inside the section, "
    "or take the lock again"
)


@dataclass(frozen=True, slots=True)
class HeldBy:
    """Who holds a lock right now, as far as a message needs to know."""

    holder: str
    token: int


def _state(current: HeldBy | None) -> str:
    return f"held by {current.holder!r} (token {current.token})" if current else "free"


def not_held(lock: str, *, action: str, current: HeldBy | None) -> LockNotHeldError:
    return LockNotHeldError(
        f"{action} needs lock {lock!r}, but this context does not hold it (the lock is "
        f"{_state(current)}). Call it inside `async with lock` / lock.hold(), or from a method "
        "decorated with @with_lock, @acquires_lock or @releases_lock",
        lock=lock,
        holder=current.holder if current else None,
        token=current.token if current else None,
    )


def reentry(lock: str, *, action: str, current: HeldBy) -> LockReentryError:
    return LockReentryError(
        f"{action} on lock {lock!r} from a context that already holds it (holder "
        f"{current.holder!r}, token {current.token}); the lock is not re-entrant. Call the inner "
        "code without taking the lock again (declare it @requires_lock)",
        lock=lock,
        holder=current.holder,
        token=current.token,
    )


def nesting(lock: str, *, action: str, other_lock: str, other: HeldBy) -> LockNestingError:
    return LockNestingError(
        f"{action} on lock {lock!r} while this context holds lock {other_lock!r} (holder "
        f"{other.holder!r}, token {other.token}); nesting two ContextLocks is refused. Release "
        f"{other_lock!r} first, or guard both resources with one lock",
        lock=lock,
        held_lock=other_lock,
        holder=other.holder,
        token=other.token,
    )


def inherited_only(
    lock: str, *, action: str, current: HeldBy, task: str, entered_by: str
) -> LockNotHeldError:
    return LockNotHeldError(
        f"{action} on lock {lock!r} (holder {current.holder!r}, token {current.token}) from task "
        f"{task!r}, which only inherited the section from task {entered_by!r}; a child task may "
        "use the section, but only the task that entered it may end, detach or release it",
        lock=lock,
        holder=current.holder,
        token=current.token,
    )


def attached_here(lock: str, *, action: str, current: HeldBy) -> LockReentryError:
    return LockReentryError(
        f"{action} on lock {lock!r}: this context already holds the section with token "
        f"{current.token} (holder {current.holder!r}); use it directly",
        lock=lock,
        holder=current.holder,
        token=current.token,
    )


def attached_elsewhere(lock: str, *, action: str, current: HeldBy) -> LockNotHeldError:
    return LockNotHeldError(
        f"{action} on lock {lock!r}: the section with token {current.token} (holder "
        f"{current.holder!r}) is attached to another context; only a detached section can be "
        "taken over by its token. Let its owner detach or release it",
        lock=lock,
        holder=current.holder,
        token=current.token,
    )


def token_refused(
    lock: str, *, action: str, token: int, why: str, expired: bool, current: HeldBy | None
) -> StaleLockError:
    """StaleLockError (LeaseExpiredError when ``expired``) for a token that is not live."""
    error_type = LeaseExpiredError if expired else StaleLockError
    return error_type(
        f"{action} refused by lock {lock!r}: the section with token {token} {why}; the lock is "
        f"now {_state(current)}. A fencing token is honoured only while its section is live: "
        "start a new section instead of reusing this token",
        lock=lock,
        token=token,
        holder=current.holder if current else None,
        live_token=current.token if current else None,
    )


def stale_grant(lock: str, *, action: str, token: int, holder: str, why: str) -> StaleLockError:
    """StaleLockError for a context whose (still live) section was detached from it."""
    return StaleLockError(
        f"{action} ran with a stale grant of lock {lock!r}: the section with token {token} "
        f"(holder {holder!r}) {why}; {FIX_STALE}",
        lock=lock,
        holder=holder,
        token=token,
    )


def off_loop(lock: str, *, action: str) -> LockError:
    return LockError(
        f"{action} on lock {lock!r} must run on the event loop the lock is bound to; schedule it "
        "there (asyncio.run_coroutine_threadsafe or loop.call_soon_threadsafe)",
        lock=lock,
    )


def busy_on_other_loop(lock: str, *, current: HeldBy | None) -> LockError:
    return LockError(
        f"lock {lock!r} is in use on another event loop; a ContextLock serves one loop at a "
        "time (it rebinds only while idle): use it only from the loop that holds it",
        lock=lock,
        holder=current.holder if current else None,
        token=current.token if current else None,
    )


def timed_out(
    lock: str, *, waiter: str, timeout: float | None, current: HeldBy | None
) -> LockTimeoutError:
    return LockTimeoutError(
        f"{waiter!r} gave up waiting for lock {lock!r} after {timeout}s; the lock is "
        f"{_state(current)}. Raise the timeout, or find out why that holder does not release "
        "(lock.statistics() shows it)",
        lock=lock,
        waiter=waiter,
        holder=current.holder if current else None,
        token=current.token if current else None,
    )

"""ContextLock: an asyncio lock that knows which context holds it, with fencing tokens and leases.

Ownership follows the asyncio context: acquiring records a grant in a ContextVar, so tasks spawned
inside a held section inherit it. Every section gets a fencing token that is never reused; a grant
counts only while its token is the live one and its section is attached to that context, so a child
task that outlives its section loses its authority. A section can be detached (optionally as a
lease with a TTL), carried across calls by its token, and reattached or released by that token.

Everything lock-related is importable from here: the records (``lock_models``) and the
lock-discipline decorators (``lock_discipline``) are re-exported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType

from miles.utils import lock_refusals as refusals
from miles.utils.lock_models import LockLease, LockStatistics, LockTransition, LockTransitionKind
from miles.utils.lock_sections import EndReason, Section, SectionLedger, SectionMode
from miles.utils.lock_waiters import WaiterQueue

_logger = logging.getLogger("miles.lock")


@dataclass(frozen=True, eq=False, slots=True)
class _Grant:
    """What a context records when a section is attached to it (kept in ``_GRANTS``)."""

    lock: ContextLock
    token: int
    attachment: int
    task: weakref.ref[asyncio.Task[object]] | None  # the task that entered: only it may end it


# A ContextVar must be created once, at module level (contexts keep strong references to their
# variables). Its value is an immutable tuple, so each context sees only its own grants.
_GRANTS: ContextVar[tuple[_Grant, ...]] = ContextVar("miles_context_lock_grants", default=())


def _current_task_name() -> str:
    task = asyncio.current_task()
    return task.get_name() if task is not None else "<no task>"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class ContextLock:
    """An exclusive, FIFO-fair, non-re-entrant asyncio lock that knows who holds it.

    Bound to one running event loop at a time (it rebinds only while idle). Operations that change
    its state must run on that loop; ``owned``, ``check_owned`` and ``statistics`` may also be read
    from other threads (e.g. a worker started by ``asyncio.to_thread`` inside a held section, which
    copies the context). ``on_transition`` is called on every acquire, release and lease expiry; a
    hook that raises is logged and ignored. Waiters log a reminder every ``reminder_interval_s``.
    """

    def __init__(
        self,
        name: str,
        *,
        reminder_interval_s: float = 30.0,
        on_transition: Callable[[LockTransition], None] | None = None,
    ) -> None:
        if not name:
            raise ValueError("ContextLock needs a non-empty name; it appears in every lock message")
        if reminder_interval_s <= 0:
            raise ValueError(f"reminder_interval_s must be > 0 seconds, got {reminder_interval_s!r}")
        self._name = name
        self._reminder_interval_s = reminder_interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sections = SectionLedger(lock_name=name, on_transition=on_transition, logger=_logger)
        self._waiters = self._new_queue()

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<ContextLock {self._name!r} {self._sections.describe()}>"

    # --- taking the lock -----------------------------------------------------------------------

    async def acquire(self, *, holder: str, timeout: float | None = None) -> LockLease:
        """Wait for the lock (FIFO) and attach its section to the current context.

        Returns the grant (a LockLease without expiry). Raises LockReentryError at once if this
        context already owns the lock, LockNestingError if it owns another ContextLock, and
        LockTimeoutError (a TimeoutError) once ``timeout`` seconds pass. A waiter that times out
        or is cancelled leaves no trace; one cancelled just after being granted passes the lock on.
        Use ``timeout`` rather than ``asyncio.wait_for``: on Python 3.11 wait_for runs the acquire
        in a task of its own, whose context (not the caller's) would receive the grant.
        """
        self._bind_running_loop()
        self._expire_if_due()
        self._refuse_reentry_and_nesting(action=f"acquire (as {holder!r})")
        if self._sections.live is None and self._waiters.live_count() == 0:
            section = self._sections.open(holder, 0.0)
        else:
            try:
                section = await self._waiters.wait(
                    holder=holder, timeout=timeout, on_lost_grant=self._pass_on
                )
            except TimeoutError as exc:
                raise refusals.timed_out(
                    self._name, waiter=holder, timeout=timeout, current=self._sections.held_by()
                ) from exc
        self._attach_to_context(section)
        return section.as_lease(self._name)

    def hold(
        self, *, holder: str | None = None, timeout: float | None = None
    ) -> contextlib.AbstractAsyncContextManager[LockLease]:
        """An async context manager: acquire (holder defaults to the task's name), then release.

        On exit it releases the section this context still owns (after ``with_released``, the
        reacquired one). A section detached inside the block stays held for its token's holder;
        one the block already released is not released twice.
        """
        return self._hold(holder=holder or _current_task_name(), timeout=timeout)

    @contextlib.asynccontextmanager
    async def _hold(self, *, holder: str, timeout: float | None) -> AsyncIterator[LockLease]:
        lease = await self.acquire(holder=holder, timeout=timeout)
        try:
            yield lease
        finally:
            if self.owned():
                self.release()

    async def __aenter__(self) -> LockLease:
        return await self.acquire(holder=_current_task_name())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.owned():
            self.release()

    @contextlib.asynccontextmanager
    async def with_released(self) -> AsyncIterator[None]:
        """Release the section this context owns for the block, then reacquire it.

        Others may take the lock meanwhile. The reacquired section has a new token, so children
        spawned before the block lose their authority. The block reacquires also when it raised
        or was cancelled; if that reacquire is itself cancelled, the context ends up holding
        nothing. Raises LockNotHeldError / StaleLockError if this context does not own the lock.
        """
        section = self._owned_section("with_released")
        self._end(EndReason.RELEASED_TEMPORARILY)
        try:
            yield
        finally:
            await self.acquire(holder=section.holder)

    # --- ownership -----------------------------------------------------------------------------

    def owned(self) -> bool:
        """Whether the current context owns the lock (an attached section with the live token)."""
        self._expire_if_due()
        grant = self._context_grant()
        return grant is not None and self._is_live(grant)

    def check_owned(self, action: str) -> None:
        """Return if the current context owns the lock; otherwise raise, naming ``action``.

        Raises LockNotHeldError if this context holds no grant of the lock, StaleLockError if its
        grant is stale (section ended, superseded or detached), LeaseExpiredError if that
        section's lease expired.
        """
        self._expire_if_due()
        grant = self._context_grant()
        if grant is None:
            raise refusals.not_held(self._name, action=action, current=self._sections.held_by())
        if self._is_live(grant):
            return
        section = self._sections.live
        if section is None or section.token != grant.token:
            raise self._sections.refuse_token(grant.token, action=f"{action} (stale grant)")
        why = (
            f"was detached; the context that continues it must call reattach({grant.token})"
            if section.mode is SectionMode.DETACHED
            else "was detached and then reattached in another context"
        )
        raise refusals.stale_grant(
            self._name, action=action, token=grant.token, holder=section.holder, why=why
        )

    def current_lease(self) -> LockLease:
        """The grant of the section this context owns; raises like ``check_owned``."""
        self.check_owned("current_lease")
        section = self._sections.live
        assert section is not None
        return section.as_lease(self._name)

    # --- ending, detaching and resuming sections -----------------------------------------------

    def release(self) -> None:
        """End the section this context owns and hand the lock to the next waiter.

        Raises like ``check_owned`` (StaleLockError when released twice), and LockNotHeldError
        when called from a child task rather than the task that entered the section.
        """
        self._owned_section("release")
        self._end(EndReason.RELEASED)

    def detach(
        self,
        *,
        ttl_s: float | None = None,
        on_expire: Callable[[LockLease], None] | None = None,
    ) -> LockLease:
        """Turn the section this context owns into a detached one and return its lease.

        The lock stays held; this context (and every task it spawned) no longer owns it. With
        ``ttl_s`` the lease expires after that many seconds: the section is then released,
        ``on_expire(lease)`` is called (synchronously, on the loop) and its token is refused with
        LeaseExpiredError. Raises like ``release``, and ValueError for a TTL <= 0.
        """
        section = self._owned_section("detach")
        if ttl_s is not None:
            self._start_lease(section, ttl_s=ttl_s, on_expire=on_expire)
        section.mode = SectionMode.DETACHED
        return section.as_lease(self._name)

    def reattach(self, token: int) -> LockLease:
        """Attach the detached section with this fencing token to the current context.

        An attached section has no lease: its TTL stops until it is detached again. Raises
        StaleLockError if the token is not the live one (released, ended, superseded),
        LeaseExpiredError if its lease ran out, LockNotHeldError if the section is attached to
        another context, LockReentryError if to this one, LockNestingError if this context owns
        another ContextLock.
        """
        section = self._detached_section(token, action=f"reattach({token})")
        self._refuse_reentry_and_nesting(action=f"reattach({token})")
        self._sections.reattach(section)
        self._attach_to_context(section)
        return section.as_lease(self._name)

    def renew(self, token: int, ttl_s: float) -> LockLease:
        """Restart the lease of the detached section with this token: it now expires in ``ttl_s``.

        Keeps the lease's ``on_expire``. Raises like ``reattach`` (StaleLockError,
        LeaseExpiredError, LockNotHeldError for an attached section), and ValueError for ttl_s <= 0.
        """
        section = self._detached_section(token, action=f"renew({token})")
        on_expire = section.lease.on_expire if section.lease is not None else None
        self._start_lease(section, ttl_s=ttl_s, on_expire=on_expire)
        return section.as_lease(self._name)

    def release_token(self, token: int) -> None:
        """End the detached section with this fencing token (or the one this context owns).

        Raises StaleLockError if the token is not live (ended twice, superseded),
        LeaseExpiredError if its lease ran out, LockNotHeldError if another context owns it.
        """
        action = f"release_token({token})"
        self._require_loop_thread(action)
        self._expire_if_due()
        section = self._sections.live
        if section is not None and section.token == token and self.owned():
            self._owned_section(action)  # still refuses a child task that merely inherited it
        else:
            self._detached_section(token, action=action)
        self._end(EndReason.RELEASED)

    def _discard_context_section(self) -> None:
        """End the section this context entered, attached or since detached by it, if still live.

        For ``acquires_lock``: a body that failed must not leave its window open, not even one it
        already detached.
        """
        self._require_loop_thread("discard")
        grant = self._context_grant()
        section = self._sections.live
        if (
            grant is not None
            and section is not None
            and section.token == grant.token
            and (section.mode is SectionMode.DETACHED or self._is_live(grant))
        ):
            self._end(EndReason.RELEASED)

    # --- observing -----------------------------------------------------------------------------

    def statistics(self) -> LockStatistics:
        """A snapshot of the lock: holder, token, waiters, lease. Never raises."""
        self._expire_if_due()
        section = self._sections.live
        return LockStatistics(
            name=self._name,
            held=section is not None,
            holder=section.holder if section else None,
            held_since=section.acquired_at if section else None,
            token=section.token if section else None,
            waiters=self._waiters.live_count(),
            detached=section is not None and section.mode is SectionMode.DETACHED,
            lease_expires_at=section.lease.expires_at if section and section.lease else None,
        )

    # --- internals -----------------------------------------------------------------------------

    def _new_queue(self) -> WaiterQueue[Section]:
        return WaiterQueue(
            lock_name=self._name,
            reminder_interval_s=self._reminder_interval_s,
            describe_holder=self._sections.describe,
            logger=_logger,
        )

    def _bind_running_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._sections.live is not None or self._waiters.live_count():
            raise refusals.busy_on_other_loop(self._name, current=self._sections.held_by())
        # Idle: nothing refers to the old loop any more, so rebinding is safe.
        self._loop = loop
        self._waiters = self._new_queue()

    def _on_loop_thread(self) -> bool:
        return self._loop is not None and _running_loop() is self._loop

    def _require_loop_thread(self, action: str) -> None:
        if self._loop is not None and not self._on_loop_thread():
            raise refusals.off_loop(self._name, action=action)

    def _refuse_reentry_and_nesting(self, *, action: str) -> None:
        for grant in _GRANTS.get():
            other = grant.lock
            if not other._is_live(grant):
                continue
            held = other._sections.held_by()
            assert held is not None
            if other is self:
                raise refusals.reentry(self._name, action=action, current=held)
            raise refusals.nesting(self._name, action=action, other_lock=other.name, other=held)

    def _attach_to_context(self, section: Section) -> None:
        task = asyncio.current_task()
        grant = _Grant(
            lock=self,
            token=section.token,
            attachment=section.attachment,
            task=weakref.ref(task) if task is not None else None,
        )
        _GRANTS.set(tuple(g for g in _GRANTS.get() if g.lock is not self) + (grant,))

    def _context_grant(self) -> _Grant | None:
        return next((grant for grant in _GRANTS.get() if grant.lock is self), None)

    def _is_live(self, grant: _Grant) -> bool:
        section = self._sections.live
        return (
            section is not None
            and section.mode is SectionMode.ATTACHED
            and section.token == grant.token
            and section.attachment == grant.attachment
        )

    def _owned_section(self, action: str) -> Section:
        """The section this context owns, entered by the current task; raises otherwise."""
        self._require_loop_thread(action)
        self.check_owned(action)
        grant = self._context_grant()
        section = self._sections.live
        assert grant is not None and section is not None
        entered_by = grant.task() if grant.task is not None else None
        if entered_by is not asyncio.current_task():
            raise refusals.inherited_only(
                self._name,
                action=action,
                current=section.held_by(),
                task=_current_task_name(),
                entered_by=entered_by.get_name() if entered_by is not None else "<finished>",
            )
        return section

    def _detached_section(self, token: int, *, action: str) -> Section:
        """The live, detached section with this token; raises if the token cannot take it."""
        self._require_loop_thread(action)
        self._expire_if_due()
        section = self._sections.live
        if section is None or section.token != token:
            raise self._sections.refuse_token(token, action=action)
        if section.mode is SectionMode.DETACHED:
            return section
        if self.owned():
            raise refusals.attached_here(self._name, action=action, current=section.held_by())
        raise refusals.attached_elsewhere(self._name, action=action, current=section.held_by())

    def _start_lease(
        self, section: Section, *, ttl_s: float, on_expire: Callable[[LockLease], None] | None
    ) -> None:
        assert self._loop is not None
        self._sections.start_lease(
            section, loop=self._loop, ttl_s=ttl_s, on_expire=on_expire, on_timer=self._on_lease_timer
        )

    def _on_lease_timer(self, section: Section) -> None:
        # The timer is cancelled on renew, reattach and release, so when it fires for the live
        # detached section, that lease has run out (the loop may fire a hair early; immaterial).
        if self._sections.live is section and section.mode is SectionMode.DETACHED:
            self._expire(section)

    def _expire_if_due(self) -> None:
        # The timer runs late when the loop is busy, so every operation checks the clock too;
        # only on the loop's thread, since other threads may read the lock but never change it.
        section = self._sections.live
        if section is not None and self._sections.lease_overdue() and self._on_loop_thread():
            self._expire(section)

    def _expire(self, section: Section) -> None:
        assert section.lease is not None
        on_expire = section.lease.on_expire
        lease = section.as_lease(self._name)
        _logger.warning(
            "lease on lock %r expired (holder %r, token %d, due %s); its token is now refused "
            "and the lock passes to the next waiter",
            self._name,
            section.holder,
            section.token,
            section.lease.expires_at.isoformat(),
        )
        self._sections.close(EndReason.LEASE_EXPIRED)
        if on_expire is not None:
            try:
                on_expire(lease)
            except Exception:  # a failing callback must not keep the lock from moving on
                _logger.exception("on_expire callback of lock %r raised", self._name)
        self._waiters.grant_next(self._sections.open)

    def _end(self, reason: EndReason) -> None:
        self._sections.close(reason)
        # FIFO hand-off: the next waiter gets the lock before any newcomer can ask for it.
        self._waiters.grant_next(self._sections.open)

    def _pass_on(self, section: Section) -> None:
        # A waiter was granted the lock but cancelled before it resumed: nobody will release it.
        if self._sections.live is section:
            self._end(EndReason.ABANDONED)


# Re-exported so that callers import everything lock-related from one module. Imported last and
# safe: lock_discipline refers back to ContextLock only at call time.
from miles.utils.lock_discipline import (  # noqa: E402
    LockRole,
    acquires_lock,
    enforce_lock_discipline,
    lock_exempt,
    releases_lock,
    requires_lock,
    with_lock,
)

__all__ = [
    "ContextLock",
    "LockLease",
    "LockRole",
    "LockStatistics",
    "LockTransition",
    "LockTransitionKind",
    "acquires_lock",
    "enforce_lock_discipline",
    "lock_exempt",
    "releases_lock",
    "requires_lock",
    "with_lock",
]

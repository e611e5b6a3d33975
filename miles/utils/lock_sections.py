"""The sections of one ContextLock: fencing tokens, leases, endings and the transitions they emit.

A section is one holding of the lock, from grant to end. This ledger issues each section a token
that is never reused, keeps the live section, remembers how recent ones ended (so a refusal can say
"expired" rather than just "stale"), runs lease timers and reports every transition. Which context
owns a section, and who waits for the next one, is ContextLock's business.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from miles.errors import StaleLockError
from miles.utils import lock_refusals as refusals
from miles.utils.lock_models import LockLease, LockTransition, LockTransitionKind
from miles.utils.lock_refusals import HeldBy

# How many ended tokens a ledger remembers, to tell "expired" from "released" in refusals. An
# older token is still refused (it is not live), with a less specific message.
_REMEMBERED_ENDINGS = 1024


class SectionMode(enum.Enum):
    ATTACHED = "attached"  # owned by the one context whose grant carries its attachment id
    DETACHED = "detached"  # owned by no context; whoever holds the token may reattach or end it


class EndReason(enum.Enum):
    RELEASED = "was released"
    RELEASED_TEMPORARILY = "was released by with_released() (its block reacquires with a new token)"
    LEASE_EXPIRED = "ended when its lease expired"
    ABANDONED = "was handed to a waiter that was cancelled before it resumed"


@dataclass(eq=False, slots=True)
class LeaseTerms:
    deadline: float  # time.monotonic()
    expires_at: datetime
    on_expire: Callable[[LockLease], None] | None
    timer: asyncio.TimerHandle


@dataclass(eq=False, slots=True)
class Section:
    """One holding of the lock. Mutable, and never handed outside the lock (LockLease is)."""

    token: int
    holder: str
    acquired_at: datetime
    acquired_mono: float
    attachment: int  # changes on every reattach, so grants from before a detach go stale
    mode: SectionMode = SectionMode.ATTACHED
    lease: LeaseTerms | None = None

    def as_lease(self, lock_name: str) -> LockLease:
        return LockLease(
            lock_name=lock_name,
            token=self.token,
            holder=self.holder,
            acquired_at=self.acquired_at,
            expires_at=self.lease.expires_at if self.lease is not None else None,
        )

    def held_by(self) -> HeldBy:
        return HeldBy(holder=self.holder, token=self.token)


class SectionLedger:
    """Issues, ends and times the sections of one lock; emits a LockTransition for each change."""

    def __init__(
        self,
        *,
        lock_name: str,
        on_transition: Callable[[LockTransition], None] | None,
        logger: logging.Logger,
    ) -> None:
        self._lock_name = lock_name
        self._on_transition = on_transition
        self._logger = logger
        self._live: Section | None = None
        self._last_token = 0
        self._last_attachment = 0
        self._endings: OrderedDict[int, EndReason] = OrderedDict()

    @property
    def live(self) -> Section | None:
        """The section holding the lock now, attached or detached; None when the lock is free."""
        return self._live

    def held_by(self) -> HeldBy | None:
        return self._live.held_by() if self._live is not None else None

    def describe(self) -> str:
        section = self._live
        if section is None:
            return "free"
        lease = f", lease expires {section.lease.expires_at.isoformat()}" if section.lease else ""
        return (
            f"held by {section.holder!r} (token {section.token}, {section.mode.value}{lease}) "
            f"since {section.acquired_at.isoformat()}"
        )

    def open(self, holder: str, waited_s: float) -> Section:
        """Start a section with a fresh token (the lock must be free); emits ACQUIRED."""
        assert self._live is None, "a ContextLock section opened while another is live"
        self._last_token += 1
        section = Section(
            token=self._last_token,
            holder=holder,
            acquired_at=datetime.now(UTC),
            acquired_mono=time.monotonic(),
            attachment=self._next_attachment(),
        )
        self._live = section
        self._emit(LockTransitionKind.ACQUIRED, section, waited_s=waited_s, held_s=None)
        return section

    def reattach(self, section: Section) -> None:
        """Mark a detached section attached again, under a new attachment id; drops its lease."""
        self.stop_lease(section)
        section.attachment = self._next_attachment()
        section.mode = SectionMode.ATTACHED

    def close(self, reason: EndReason) -> Section:
        """End the live section; emits RELEASED (LEASE_EXPIRED for an expiry)."""
        section = self._live
        assert section is not None, "a ContextLock section closed while none is live"
        self.stop_lease(section)
        self._live = None
        self._endings[section.token] = reason
        if len(self._endings) > _REMEMBERED_ENDINGS:
            self._endings.popitem(last=False)
        kind = (
            LockTransitionKind.LEASE_EXPIRED
            if reason is EndReason.LEASE_EXPIRED
            else LockTransitionKind.RELEASED
        )
        self._emit(kind, section, waited_s=None, held_s=time.monotonic() - section.acquired_mono)
        return section

    def start_lease(
        self,
        section: Section,
        *,
        loop: asyncio.AbstractEventLoop,
        ttl_s: float,
        on_expire: Callable[[LockLease], None] | None,
        on_timer: Callable[[Section], None],
    ) -> None:
        """(Re)start the section's lease: ``on_timer(section)`` runs on the loop after ``ttl_s``.

        Raises ValueError for ttl_s <= 0.
        """
        if ttl_s <= 0:
            raise ValueError(f"a lease TTL must be > 0 seconds, got {ttl_s!r}")
        self.stop_lease(section)
        section.lease = LeaseTerms(
            deadline=time.monotonic() + ttl_s,
            expires_at=datetime.now(UTC) + timedelta(seconds=ttl_s),
            on_expire=on_expire,
            timer=loop.call_later(ttl_s, on_timer, section),
        )

    @staticmethod
    def stop_lease(section: Section) -> None:
        if section.lease is not None:
            section.lease.timer.cancel()
            section.lease = None

    def lease_overdue(self) -> bool:
        """Whether the live section's lease has run out by the monotonic clock."""
        section = self._live
        return (
            section is not None
            and section.lease is not None
            and time.monotonic() >= section.lease.deadline
        )

    def refuse_token(self, token: int, *, action: str) -> StaleLockError:
        """The error for a token that is not live: LeaseExpiredError if its lease ran out."""
        reason = self._endings.get(token)
        if not 0 < token <= self._last_token:
            why = "was never issued by this lock (a token from another lock or process?)"
        elif reason is None:
            why = "ended and has since been superseded"
        else:
            why = reason.value
        return refusals.token_refused(
            self._lock_name,
            action=action,
            token=token,
            why=why,
            expired=reason is EndReason.LEASE_EXPIRED,
            current=self.held_by(),
        )

    def _next_attachment(self) -> int:
        self._last_attachment += 1
        return self._last_attachment

    def _emit(
        self,
        kind: LockTransitionKind,
        section: Section,
        *,
        waited_s: float | None,
        held_s: float | None,
    ) -> None:
        if self._on_transition is None:
            return
        transition = LockTransition(
            kind=kind,
            lock_name=self._lock_name,
            holder=section.holder,
            token=section.token,
            waited_s=waited_s,
            held_s=held_s,
        )
        try:
            self._on_transition(transition)
        except Exception:  # an observer must never break the lock it observes
            self._logger.exception(
                "on_transition hook of lock %r raised on %s", self._lock_name, kind.value
            )

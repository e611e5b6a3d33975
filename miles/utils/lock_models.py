"""The records a ContextLock hands out: leases, statistics snapshots and transitions (all frozen)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class LockLease:
    """A grant of a ContextLock section, identified by its fencing token.

    Returned by ``acquire`` (``expires_at`` is None) and by ``detach`` / ``reattach`` / ``renew``.
    Whoever holds a detached section's token may reattach, renew or release it; the token is
    honoured only while its section is live.
    """

    lock_name: str
    token: int
    holder: str
    acquired_at: datetime  # UTC
    expires_at: datetime | None  # UTC; None: no TTL (attached, or detached without one)


@dataclass(frozen=True, slots=True, kw_only=True)
class LockStatistics:
    """A snapshot of a ContextLock, for health reports and debugging."""

    name: str
    held: bool
    holder: str | None
    held_since: datetime | None  # UTC
    token: int | None
    waiters: int
    detached: bool
    lease_expires_at: datetime | None  # UTC


class LockTransitionKind(enum.Enum):
    ACQUIRED = "acquired"
    RELEASED = "released"
    LEASE_EXPIRED = "lease_expired"


@dataclass(frozen=True, slots=True, kw_only=True)
class LockTransition:
    """One change of a ContextLock's holder, passed to its ``on_transition`` hook.

    ``waited_s`` is set for ACQUIRED (time spent queued), ``held_s`` for RELEASED and
    LEASE_EXPIRED (time the section was held, attached or detached).
    """

    kind: LockTransitionKind
    lock_name: str
    holder: str
    token: int
    waited_s: float | None
    held_s: float | None

"""The exception hierarchy of miles: every error carries the context needed to act on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class MilesError(Exception):
    """Base of every error miles raises on purpose.

    ``context`` holds the facts that explain the failure (server id, weight version, expected and
    actual checksum, path ...); they are appended to the message so a log line alone is enough to
    act on.
    """

    def __init__(self, message: str, **context: Any) -> None:
        self.message = message
        self.context: Mapping[str, Any] = {k: v for k, v in context.items() if v is not None}
        super().__init__(self._render())

    def _render(self) -> str:
        if not self.context:
            return self.message
        details = ", ".join(f"{key}={value!r}" for key, value in self.context.items())
        return f"{self.message} [{details}]"


# --- locks -------------------------------------------------------------------------------------


class LockError(MilesError):
    """A ContextLock was used against its discipline."""


class LockReentryError(LockError):
    """The current context already holds this lock; taking it again would deadlock."""


class LockNestingError(LockError):
    """The current context holds another ContextLock; nesting two locks is refused."""


class LockNotHeldError(LockError):
    """An operation that needs the lock ran without holding it."""


class StaleLockError(LockError):
    """A context (a child task, a lease) whose grant was superseded tried to use the lock."""


class LeaseExpiredError(StaleLockError):
    """A lease's time ran out; its fencing token is no longer honoured."""


class LockDisciplineError(LockError, TypeError):
    """A class that owns a lock declared a method without saying how it relates to the lock."""


# --- events ------------------------------------------------------------------------------------


class EventLogError(MilesError):
    """An event log could not be written or read."""


# --- weights and checkpoints -------------------------------------------------------------------


class CheckpointError(MilesError):
    """A checkpoint is missing, malformed, or does not match its manifest."""


class ChecksumMismatchError(MilesError):
    """Weights hashed to a checksum other than the one expected."""

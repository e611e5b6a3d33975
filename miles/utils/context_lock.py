"""ContextLock: an exclusive asyncio lock that knows which context holds it, and the decorators that
make a class declare how each of its methods relates to its lock.

A grant is recorded in a ContextVar: tasks spawned inside a held section inherit it, other tasks
do not. Every holding gets a fencing token never reused (an engine can refuse an older holder's calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any, TypeVar

from miles.errors import LockDisciplineError, LockNestingError, LockNotHeldError, LockReentryError, LockTimeoutError

_logger = logging.getLogger("miles.lock")

FuncT = TypeVar("FuncT", bound=Callable[..., Any])
ClassT = TypeVar("ClassT", bound=type)


@dataclass(frozen=True, slots=True, kw_only=True)
class LockGrant:
    """One holding of a ContextLock, identified by its fencing token (never reused)."""

    token: int
    holder: str
    acquired_at: datetime  # UTC


@dataclass(frozen=True, slots=True, kw_only=True)
class LockStatistics:
    """A snapshot of a ContextLock, for health reports and debugging."""

    name: str
    held: bool
    holder: str | None
    held_since: datetime | None  # UTC
    token: int | None
    waiters: int


class LockTransitionKind(Enum):
    ACQUIRED = "acquired"
    RELEASED = "released"


@dataclass(frozen=True, slots=True, kw_only=True)
class LockTransition:
    """One change of holder, for ``on_transition``: ``waited_s`` if ACQUIRED, ``held_s`` if RELEASED."""

    kind: LockTransitionKind
    lock_name: str
    holder: str
    token: int
    waited_s: float | None
    held_s: float | None


# Created once at module level (a context keeps strong references to its variables). Its value is
# an immutable tuple of (lock, token): each context sees only the grants it made or inherited.
_GRANTS: ContextVar[tuple[tuple[ContextLock, int], ...]] = ContextVar("miles_context_lock_grants", default=())


@dataclass(eq=False, slots=True)
class _Waiter:
    holder: str
    future: asyncio.Future[LockGrant]
    since: float


class ContextLock:
    """An exclusive, FIFO-fair, non-re-entrant asyncio lock that knows who holds it; a waiter logs a
    reminder every ``reminder_interval_s``. ``on_transition`` is called on every acquire and release
    (a hook that raises is logged). ``statistics`` and ``owned`` may be called from any thread, the
    rest on the lock's loop."""

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
        self._on_transition = on_transition
        self._grant: LockGrant | None = None
        self._granted_mono = 0.0
        self._waiters: deque[_Waiter] = deque()
        self._last_token = 0

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<ContextLock {self._name!r} {self._describe()}>"

    # --- taking and giving back --------------------------------------------------------------

    async def acquire(self, *, holder: str, timeout: float | None = None) -> LockGrant:
        """Wait (FIFO) for the lock and record it in the current context.

        Raises LockReentryError if this context holds it already, LockNestingError if it holds
        another ContextLock, LockTimeoutError after ``timeout`` s. A waiter that times out or is
        cancelled leaves no trace (one granted just before passes the lock on). Use ``timeout``,
        not ``asyncio.wait_for``: on 3.11 that runs the acquire in its own task, whose context
        would receive the grant.
        """
        self._refuse_reentry_and_nesting(holder)
        if self._grant is None and not self._waiters:
            grant = self._open(holder, waited_s=0.0)
        else:
            grant = await self._wait(holder, timeout)
        _GRANTS.set((*_GRANTS.get(), (self, grant.token)))
        return grant

    def release(self) -> None:
        """Hand the lock to the next waiter; LockNotHeldError unless this context holds it."""
        grant = self.current()
        _GRANTS.set(tuple(g for g in _GRANTS.get() if g[0] is not self))
        self._grant = None
        self._emit(LockTransitionKind.RELEASED, grant, waited_s=None, held_s=time.monotonic() - self._granted_mono)
        self._grant_next()

    @contextlib.asynccontextmanager
    async def hold(self, *, holder: str, timeout: float | None = None) -> AsyncIterator[LockGrant]:
        """``async with lock.hold(holder=...) as grant``: acquire, then release on the way out."""
        grant = await self.acquire(holder=holder, timeout=timeout)
        try:
            yield grant
        finally:
            if self.owned():
                self.release()

    # --- who holds it ------------------------------------------------------------------------

    def owned(self) -> bool:
        """Whether the current context holds the lock (its grant is the live one)."""
        grant = self._grant
        return grant is not None and any(lock is self and token == grant.token for lock, token in _GRANTS.get())

    def check_owned(self, action: str) -> None:
        """Return if the current context holds the lock; raise LockNotHeldError naming ``action``."""
        if not self.owned():
            raise LockNotHeldError(
                f"{action} needs lock {self._name!r}, which this context does not hold ({self._describe()}); "
                "call it from a method that takes the lock",
                lock=self._name,
            )

    def current(self) -> LockGrant:
        """The grant the current context holds; raises like ``check_owned``."""
        self.check_owned("current")
        assert self._grant is not None
        return self._grant

    def statistics(self) -> LockStatistics:
        """A snapshot: holder, token, waiters. Never raises."""
        grant = self._grant
        return LockStatistics(
            name=self._name,
            held=grant is not None,
            holder=grant.holder if grant else None,
            held_since=grant.acquired_at if grant else None,
            token=grant.token if grant else None,
            waiters=sum(1 for w in tuple(self._waiters) if not w.future.done()),
        )

    # --- internals ---------------------------------------------------------------------------

    def _describe(self) -> str:
        grant = self._grant
        if grant is None:
            return "free"
        return f"held by {grant.holder!r} (token {grant.token}) since {grant.acquired_at.isoformat()}"

    def _refuse_reentry_and_nesting(self, holder: str) -> None:
        for lock, token in _GRANTS.get():
            if lock._grant is None or lock._grant.token != token:
                continue  # a grant this context inherited from a section that has ended
            if lock is self:
                raise LockReentryError(
                    f"{holder!r} tried to take lock {self._name!r}, which its context already holds "
                    f"({self._describe()}); taking it again would deadlock",
                    lock=self._name,
                )
            raise LockNestingError(
                f"{holder!r} tried to take lock {self._name!r} while holding lock {lock.name!r}; "
                "nesting two ContextLocks is refused (it invites lock-order deadlocks)",
                lock=self._name,
                held=lock.name,
            )

    def _open(self, holder: str, *, waited_s: float) -> LockGrant:
        self._last_token += 1
        grant = LockGrant(token=self._last_token, holder=holder, acquired_at=datetime.now(UTC))
        self._grant = grant
        self._granted_mono = time.monotonic()
        self._emit(LockTransitionKind.ACQUIRED, grant, waited_s=waited_s, held_s=None)
        return grant

    async def _wait(self, holder: str, timeout: float | None) -> LockGrant:
        waiter = _Waiter(holder=holder, future=asyncio.get_running_loop().create_future(), since=time.monotonic())
        self._waiters.append(waiter)
        deadline = None if timeout is None else waiter.since + timeout
        try:
            while True:
                step = self._reminder_interval_s
                if deadline is not None:
                    step = min(step, max(deadline - time.monotonic(), 0.0))
                # asyncio.wait, not wait_for: it neither cancels the future the lock hands over on
                # a reminder's timeout nor (as 3.11's wait_for does) swallows a cancellation that
                # arrives together with the grant, which would leave a cancelled task holding it.
                done, _ = await asyncio.wait({waiter.future}, timeout=step)
                if done:
                    return waiter.future.result()
                if deadline is not None and time.monotonic() >= deadline:
                    raise LockTimeoutError(  # noqa: TRY301  # the except below removes the waiter, re-raises
                        f"{holder!r} waited {timeout}s for lock {self._name!r} ({self._describe()}) "
                        "and gave up; nothing was changed",
                        lock=self._name,
                    )
                waited = time.monotonic() - waiter.since
                _logger.warning("%r has waited %.0fs for lock %r, %s", holder, waited, self._name, self._describe())
        except BaseException:
            self._leave(waiter)
            raise

    def _leave(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            # Granted while its task was being cancelled or timing out: nobody will release it.
            self._grant = None
            self._emit(LockTransitionKind.RELEASED, waiter.future.result(), waited_s=None, held_s=0.0)
            self._grant_next()
        else:
            waiter.future.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def _grant_next(self) -> None:
        # FIFO hand-off: the first live waiter gets the lock before any newcomer can ask for it.
        while self._waiters:
            waiter = self._waiters.popleft()
            if waiter.future.done():
                continue
            waiter.future.set_result(self._open(waiter.holder, waited_s=time.monotonic() - waiter.since))
            return

    def _emit(
        self, kind: LockTransitionKind, grant: LockGrant, *, waited_s: float | None, held_s: float | None
    ) -> None:
        if self._on_transition is None:
            return
        transition = LockTransition(
            kind=kind, lock_name=self._name, holder=grant.holder, token=grant.token, waited_s=waited_s, held_s=held_s
        )
        try:
            self._on_transition(transition)
        except Exception:  # an observer must never break the lock it observes
            _logger.exception("on_transition hook of lock %r raised on %s", self._name, kind.value)


# --- lock discipline -------------------------------------------------------------------------------


class LockRole(Enum):
    WITH_LOCK = "with_lock"
    REQUIRES = "requires_lock"
    EXEMPT = "lock_exempt"


@dataclass(eq=False, slots=True)
class _Declaration:
    role: LockRole
    qualname: str
    owner: type | None = None  # set by enforce_lock_discipline
    timeout_attribute: str | None = None


_DECLARATION = "__miles_lock_declaration__"
_DECORATORS = "@with_lock, @requires_lock or @lock_exempt"


def _declare(func: Any, role: LockRole) -> _Declaration:
    qualname = getattr(func, "__qualname__", repr(func))
    existing = getattr(func, _DECLARATION, None)
    if isinstance(existing, _Declaration):
        raise LockDisciplineError(
            f"{qualname} is declared both @{existing.role.value} and @{role.value}; keep one of {_DECORATORS}",
            method=qualname,
        )
    if role is not LockRole.EXEMPT and not inspect.isfunction(func):
        raise LockDisciplineError(f"@{role.value} applies to plain methods, not to {func!r}", method=qualname)
    return _Declaration(role=role, qualname=qualname)


def _lock_of(instance: object, declaration: _Declaration) -> ContextLock:
    if declaration.owner is None or not isinstance(instance, declaration.owner):
        raise LockDisciplineError(
            f"{declaration.qualname} is declared @{declaration.role.value} but its class was not decorated "
            "with @enforce_lock_discipline, or it was called on another class's object",
            method=declaration.qualname,
        )
    lock = getattr(instance, "_lock", None)
    if not isinstance(lock, ContextLock):
        raise LockDisciplineError(
            f"{declaration.qualname} guards self._lock, which is {lock!r}, not a ContextLock",
            method=declaration.qualname,
        )
    return lock


def with_lock(func: FuncT) -> FuncT:
    """Run the async method holding the lock (holder: its qualname), waiting at most the owner's
    ``timeout_attribute`` seconds (LockTimeoutError)."""
    declaration = _declare(func, LockRole.WITH_LOCK)
    if not inspect.iscoroutinefunction(func):
        raise LockDisciplineError(
            f"@with_lock needs an async method, but {func.__qualname__} is not one; make it async or "
            "declare it @requires_lock",
            method=func.__qualname__,
        )

    @functools.wraps(func)
    async def wrapper(self: object, /, *args: Any, **kwargs: Any) -> Any:
        lock = _lock_of(self, declaration)
        attribute = declaration.timeout_attribute
        timeout = None if attribute is None else getattr(self, attribute)
        async with lock.hold(holder=declaration.qualname, timeout=timeout):
            return await func(self, *args, **kwargs)

    setattr(wrapper, _DECLARATION, declaration)
    return wrapper  # type: ignore[return-value]


def requires_lock(func: FuncT) -> FuncT:
    """Let the method (sync or async) run only when its context holds the lock (LockNotHeldError)."""
    declaration = _declare(func, LockRole.REQUIRES)

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(self: object, /, *args: Any, **kwargs: Any) -> Any:
            _lock_of(self, declaration).check_owned(declaration.qualname)
            return await func(self, *args, **kwargs)

        setattr(async_wrapper, _DECLARATION, declaration)
        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(func)
    def wrapper(self: object, /, *args: Any, **kwargs: Any) -> Any:
        _lock_of(self, declaration).check_owned(declaration.qualname)
        return func(self, *args, **kwargs)

    setattr(wrapper, _DECLARATION, declaration)
    return wrapper  # type: ignore[return-value]


_ExemptT = TypeVar("_ExemptT")


def lock_exempt(member: _ExemptT) -> _ExemptT:
    """Declare a method (static/class method, property) unrelated to the lock; returned unchanged."""
    for func in _functions_of(member):
        setattr(func, _DECLARATION, _declare(func, LockRole.EXEMPT))
    return member


def _functions_of(member: object) -> list[Callable[..., Any]]:
    if isinstance(member, staticmethod | classmethod):
        return [member.__func__]
    if isinstance(member, property):
        return [f for f in (member.fget, member.fset, member.fdel) if f is not None]
    if isinstance(member, functools.cached_property):
        return [member.func]
    if inspect.isfunction(member):
        return [member]
    return []


def enforce_lock_discipline(*, timeout_attribute: str | None = None) -> Callable[[ClassT], ClassT]:
    """Refuse (LockDisciplineError) a class whose body defines a function, dunders and accessors
    included, without a lock declaration; bind each guarded method to the class (its lock is
    ``self._lock``) and to the attribute bounding how long ``@with_lock`` waits."""

    def check(cls: ClassT) -> ClassT:
        undeclared: list[str] = []
        for name, member in vars(cls).items():
            descriptor = isinstance(member, staticmethod | classmethod | functools.cached_property)
            for func in _functions_of(member):
                declaration = getattr(func, _DECLARATION, None)
                if not isinstance(declaration, _Declaration):
                    undeclared.append(name)
                    continue
                if descriptor and declaration.role is not LockRole.EXEMPT:
                    raise LockDisciplineError(
                        f"{cls.__qualname__}.{name} guards the lock but has no instance to hold it on",
                        cls=cls.__qualname__,
                    )
                if declaration.owner is None:
                    declaration.owner = cls
                    declaration.timeout_attribute = timeout_attribute
        if undeclared:
            raise LockDisciplineError(
                f"class {cls.__qualname__} owns a ContextLock (self._lock) but defines "
                f"{', '.join(undeclared)} without saying how each relates to it; "
                f"decorate each with one of {_DECORATORS}",
                cls=cls.__qualname__,
                methods=undeclared,
            )
        return cls

    return check

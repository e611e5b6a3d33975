"""Lock-discipline decorators: every method of a lock-owning class declares how it uses the lock.

A class that owns a ContextLock is decorated with ``@enforce_lock_discipline`` (the lock lives at
``self._lock`` unless ``lock_attribute`` says otherwise). Each function in its body carries one of
five declarations, and the class refuses to be defined otherwise:

- ``@with_lock``: an async method that runs holding the lock (released in ``finally``).
- ``@acquires_lock``: an async method that opens a section and leaves it held, detached, on return
  (its first half of a window that spans calls); a body that raises releases it.
- ``@releases_lock(token="param")``: an async method that reattaches the section named by that
  fencing token, runs holding it, and releases it in ``finally`` (the window's second half).
- ``@requires_lock``: a method (sync or async) or property accessor that runs only when the calling
  context owns the lock.
- ``@lock_exempt``: a method with no relation to the lock (``__init__``, health reads).
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, overload

from miles.errors import LockDisciplineError

if TYPE_CHECKING:
    from miles.utils.context_lock import ContextLock

FuncT = TypeVar("FuncT", bound=Callable[..., Any])
ClassT = TypeVar("ClassT", bound=type)

_DECLARATION_ATTRIBUTE = "__miles_lock_declaration__"
_DECORATORS = "@with_lock, @acquires_lock, @releases_lock(token=...), @requires_lock or @lock_exempt"


class LockRole(enum.Enum):
    WITH_LOCK = "with_lock"
    ACQUIRES = "acquires_lock"
    RELEASES = "releases_lock"
    REQUIRES = "requires_lock"
    EXEMPT = "lock_exempt"


@dataclass(eq=False, slots=True)
class _Owner:
    """Filled in once, by ``enforce_lock_discipline``, for the class whose body declared the method."""

    cls: type | None = None
    lock_attribute: str = "_lock"
    # Attribute (or property) holding how long @with_lock / @acquires_lock wait for the lock;
    # None means they wait as long as it takes.
    timeout_attribute: str | None = None


@dataclass(frozen=True, eq=False, slots=True)
class _Declaration:
    role: LockRole
    qualname: str
    owner: _Owner


def _declaration_of(func: object) -> _Declaration | None:
    declaration = getattr(func, _DECLARATION_ATTRIBUTE, None)
    return declaration if isinstance(declaration, _Declaration) else None


def _declare(func: object, role: LockRole) -> _Declaration:
    if isinstance(func, staticmethod | classmethod) and role is not LockRole.EXEMPT:
        raise LockDisciplineError(
            f"@{role.value} cannot guard static or class method {func.__func__.__qualname__}: "
            "the lock belongs to an instance. Make it a plain method, or declare it @lock_exempt",
            method=func.__func__.__qualname__,
        )
    if not callable(func):
        raise LockDisciplineError(
            f"@{role.value} applies to functions, not to {type(func).__name__} objects",
            role=role.value,
        )
    qualname = getattr(func, "__qualname__", repr(func))
    existing = _declaration_of(func)
    if existing is not None:
        raise LockDisciplineError(
            f"{qualname} is declared both @{existing.role.value} and @{role.value}; a method has "
            f"exactly one relation to the lock. Keep one of {_DECORATORS}",
            method=qualname,
        )
    return _Declaration(role=role, qualname=qualname, owner=_Owner())


def _mark(func: FuncT, declaration: _Declaration) -> FuncT:
    setattr(func, _DECLARATION_ATTRIBUTE, declaration)
    return func


def _require_coroutine_function(func: Callable[..., Any], role: LockRole) -> None:
    if not inspect.iscoroutinefunction(func):
        raise LockDisciplineError(
            f"@{role.value} needs an async method, but {func.__qualname__} is not one: holding an "
            "asyncio lock takes an await. Make it `async def`, or declare it @requires_lock",
            method=func.__qualname__,
        )


def _lock_of(instance: object, declaration: _Declaration) -> ContextLock:
    # Imported here: context_lock re-exports this module, so a top-level import would be circular.
    from miles.utils.context_lock import ContextLock

    owner = declaration.owner
    if owner.cls is None:
        raise LockDisciplineError(
            f"{declaration.qualname} is declared @{declaration.role.value}, but its class was not "
            "decorated with @enforce_lock_discipline, so the method cannot find its lock. "
            "Decorate the class",
            method=declaration.qualname,
        )
    if not isinstance(instance, owner.cls):
        raise LockDisciplineError(
            f"{declaration.qualname} was called on an object of a class it does not own: a "
            f"{type(instance).__qualname__} is not a {owner.cls.__qualname__}, whose lock the "
            "method guards. Call it on that class's instances only",
            method=declaration.qualname,
            owner=owner.cls.__qualname__,
            got=type(instance).__qualname__,
        )
    lock = getattr(instance, owner.lock_attribute, None)
    if not isinstance(lock, ContextLock):
        raise LockDisciplineError(
            f"{declaration.qualname} guards the lock at self.{owner.lock_attribute}, but that is "
            f"{lock!r}, not a ContextLock. Assign one in __init__ before any guarded call",
            method=declaration.qualname,
            lock_attribute=owner.lock_attribute,
        )
    return lock


def _timeout_of(instance: object, declaration: _Declaration) -> float | None:
    attribute = declaration.owner.timeout_attribute
    return None if attribute is None else getattr(instance, attribute)


def with_lock(func: FuncT) -> FuncT:
    """Run the async method holding the lock (holder: its qualname); released in ``finally``.

    Raises LockDisciplineError (a TypeError) at decoration for a sync method; at call time the
    lock's own errors (LockReentryError, LockNestingError ...).
    """
    declaration = _declare(func, LockRole.WITH_LOCK)
    _require_coroutine_function(func, LockRole.WITH_LOCK)

    @functools.wraps(func)
    async def wrapper(self: object, /, *args: Any, **kwargs: Any) -> Any:
        lock = _lock_of(self, declaration)
        async with lock.hold(holder=declaration.qualname, timeout=_timeout_of(self, declaration)):
            return await func(self, *args, **kwargs)

    return _mark(wrapper, declaration)  # type: ignore[return-value]


def acquires_lock(func: FuncT) -> FuncT:
    """Open a section for the async method and leave it held, detached, when the body returns.

    A body that detached the section itself (``self._lock.detach(ttl_s=...)``) keeps that lease;
    otherwise the section is detached without a TTL. The body learns its token from the lease it
    detached or from ``self._lock.current_lease()``. A body that raises releases the section, even
    one it already detached.
    """
    declaration = _declare(func, LockRole.ACQUIRES)
    _require_coroutine_function(func, LockRole.ACQUIRES)

    @functools.wraps(func)
    async def wrapper(self: object, /, *args: Any, **kwargs: Any) -> Any:
        lock = _lock_of(self, declaration)
        await lock.acquire(holder=declaration.qualname, timeout=_timeout_of(self, declaration))
        try:
            result = await func(self, *args, **kwargs)
        except BaseException:
            lock._discard_context_section()
            raise
        if lock.owned():
            lock.detach()
        return result

    return _mark(wrapper, declaration)  # type: ignore[return-value]


def releases_lock(*, token: str) -> Callable[[FuncT], FuncT]:
    """Declare an async method that ends the detached section named by its ``token`` parameter.

    The argument may be an int fencing token or any object with an int ``.token`` (a LockLease, a
    window result). Before the body runs the section is reattached, raising StaleLockError or
    LeaseExpiredError for a token that is not live (so ending twice raises); the body runs holding
    the lock and the section is released in ``finally``. Raises LockDisciplineError at decoration
    if the method is sync or has no parameter of that name.
    """

    def decorate(func: FuncT) -> FuncT:
        declaration = _declare(func, LockRole.RELEASES)
        _require_coroutine_function(func, LockRole.RELEASES)
        signature = inspect.signature(func)
        if token not in signature.parameters:
            raise LockDisciplineError(
                f"@releases_lock(token={token!r}) on {func.__qualname__}, which has no parameter "
                f"{token!r}; name the parameter that carries the fencing token",
                method=func.__qualname__,
            )

        @functools.wraps(func)
        async def wrapper(self: object, /, *args: Any, **kwargs: Any) -> Any:
            lock = _lock_of(self, declaration)
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            lock.reattach(_fencing_token(bound.arguments[token], declaration, parameter=token))
            try:
                return await func(self, *args, **kwargs)
            finally:
                if lock.owned():
                    lock.release()

        return _mark(wrapper, declaration)  # type: ignore[return-value]

    return decorate


def _fencing_token(value: object, declaration: _Declaration, *, parameter: str) -> int:
    candidate = getattr(value, "token", value)
    # bool is an int subclass, and True would silently mean token 1.
    if isinstance(candidate, int) and not isinstance(candidate, bool):
        return candidate
    raise LockDisciplineError(
        f"{declaration.qualname} takes its fencing token from parameter {parameter!r}, which got "
        f"{value!r}; pass the int token (or the lease / window that carries it as .token)",
        method=declaration.qualname,
        parameter=parameter,
    )


def requires_lock(func: FuncT) -> FuncT:
    """Let the method (sync or async, or a property accessor) run only if its context owns the lock.

    Raises LockNotHeldError / StaleLockError / LeaseExpiredError at call time otherwise (for a
    generator function: when it is called, not while it is iterated).
    """
    declaration = _declare(func, LockRole.REQUIRES)

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(self: object, /, *args: Any, **kwargs: Any) -> Any:
            _lock_of(self, declaration).check_owned(declaration.qualname)
            return await func(self, *args, **kwargs)

        return _mark(async_wrapper, declaration)  # type: ignore[return-value]

    @functools.wraps(func)
    def wrapper(self: object, /, *args: Any, **kwargs: Any) -> Any:
        _lock_of(self, declaration).check_owned(declaration.qualname)
        return func(self, *args, **kwargs)

    return _mark(wrapper, declaration)  # type: ignore[return-value]


_ExemptT = TypeVar("_ExemptT")


def lock_exempt(member: _ExemptT) -> _ExemptT:
    """Declare that the method (or static/class method, or property) has no relation to the lock.

    Returns it unchanged: an exempt method is neither wrapped nor checked.
    """
    for func in _functions_of(member):
        _mark(func, _declare(func, LockRole.EXEMPT))
    return member


def _functions_of(member: object) -> list[Callable[..., Any]]:
    """The plain functions a class-body member consists of (a property has up to three)."""
    if isinstance(member, staticmethod | classmethod):
        return [member.__func__]
    if isinstance(member, property):
        return [f for f in (member.fget, member.fset, member.fdel) if f is not None]
    if isinstance(member, functools.cached_property):
        return [member.func]
    if inspect.isfunction(member):
        return [member]
    return []


@overload
def enforce_lock_discipline(cls: ClassT, /) -> ClassT: ...


@overload
def enforce_lock_discipline(
    *, lock_attribute: str = "_lock", timeout_attribute: str | None = None
) -> Callable[[ClassT], ClassT]: ...


def enforce_lock_discipline(
    cls: ClassT | None = None, /, *, lock_attribute: str = "_lock", timeout_attribute: str | None = None
) -> ClassT | Callable[[ClassT], ClassT]:
    """Refuse a class whose body defines a function without a lock declaration.

    Checks every function in the class body, dunders, static and class methods and property
    accessors included (inherited members are not re-checked), and raises LockDisciplineError
    naming the class and the undeclared methods. On success it tells each guarded method which
    class owns it and where the lock lives, and returns the class unchanged. ``timeout_attribute``
    names an attribute or property giving how long ``@with_lock`` and ``@acquires_lock`` wait for
    the lock (LockTimeoutError after that); without it they wait indefinitely.
    """

    def check(target: ClassT) -> ClassT:
        _check_class(target, lock_attribute=lock_attribute, timeout_attribute=timeout_attribute)
        return target

    return check if cls is None else check(cls)


def _check_class(cls: type, *, lock_attribute: str, timeout_attribute: str | None = None) -> None:
    undeclared: list[str] = []
    misplaced: list[str] = []
    declarations: list[_Declaration] = []
    for name, member in vars(cls).items():
        in_descriptor = isinstance(member, staticmethod | classmethod | functools.cached_property)
        for func in _functions_of(member):
            declaration = _declaration_of(func)
            label = name if func.__name__ == name else f"{name} ({func.__name__})"
            if declaration is None:
                undeclared.append(label)
            elif in_descriptor and declaration.role is not LockRole.EXEMPT:
                misplaced.append(label)
            else:
                declarations.append(declaration)
    if undeclared:
        raise LockDisciplineError(
            f"class {cls.__qualname__} owns a ContextLock (self.{lock_attribute}) but defines "
            f"{', '.join(undeclared)} without saying how each relates to the lock. Decorate each "
            f"with one of {_DECORATORS}",
            cls=cls.__qualname__,
            methods=undeclared,
        )
    if misplaced:
        raise LockDisciplineError(
            f"class {cls.__qualname__} guards {', '.join(misplaced)}, which are static methods, "
            "class methods or cached properties: those have no instance whose lock they could "
            "hold. Make them plain methods or properties, or declare them @lock_exempt",
            cls=cls.__qualname__,
            methods=misplaced,
        )
    for declaration in declarations:
        # A function first declared in another class body keeps that owner: calling it on this
        # class's objects is then refused unless they are also instances of the first class.
        if declaration.owner.cls is None:
            declaration.owner.cls = cls
            declaration.owner.lock_attribute = lock_attribute
            declaration.owner.timeout_attribute = timeout_attribute

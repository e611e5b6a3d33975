"""Lock-discipline decorators: declared methods, windows spanning calls, refusals at definition."""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass

import pytest

from miles.errors import (
    LeaseExpiredError,
    LockDisciplineError,
    LockNotHeldError,
    LockReentryError,
    LockTimeoutError,
    StaleLockError,
)
from miles.utils.context_lock import (
    ContextLock,
    LockLease,
    acquires_lock,
    enforce_lock_discipline,
    lock_exempt,
    releases_lock,
    requires_lock,
    with_lock,
)


@dataclass(frozen=True)
class UpdateWindow:
    token: int
    servers: tuple[str, ...]


@enforce_lock_discipline
class Controller:
    """A miniature of the InferenceController's lock use."""

    @lock_exempt
    def __init__(self, *, lease_ttl_s: float | None = None) -> None:
        self._lock = ContextLock("InferenceController")
        self._lease_ttl_s = lease_ttl_s
        self._weights = "v0"
        self.ended: list[int] = []
        self.entered = asyncio.Event()
        self.proceed = asyncio.Event()

    @lock_exempt
    def __repr__(self) -> str:
        return f"Controller(weights={self._weights!r})"

    @property
    @requires_lock
    def weights(self) -> str:
        return self._weights

    @weights.setter
    @requires_lock
    def weights(self, value: str) -> None:
        self._weights = value

    @lock_exempt
    def health(self) -> str:
        return self._lock.statistics().holder or "idle"

    @requires_lock
    def _apply(self, version: str) -> None:
        self._weights = version

    @requires_lock
    async def _apply_async(self, version: str) -> None:
        await asyncio.sleep(0)
        self._weights = version

    @with_lock
    async def update_rollout_weights(self, version: str) -> str:
        self.entered.set()
        await self.proceed.wait()
        await self._apply_async(version)
        return self.weights

    @with_lock
    async def failing_update(self) -> None:
        raise RuntimeError("load failed")

    @with_lock
    async def nested_update(self) -> None:
        await self.update_rollout_weights("nested")

    @acquires_lock
    async def start_update_weights(self) -> UpdateWindow:
        self._apply("pushing")
        if self._lease_ttl_s is not None:
            lease = self._lock.detach(ttl_s=self._lease_ttl_s)
            return UpdateWindow(token=lease.token, servers=("s0",))
        return UpdateWindow(token=self._lock.current_lease().token, servers=("s0", "s1"))

    @acquires_lock
    async def start_failing_window(self, *, detach_first: bool) -> UpdateWindow:
        if detach_first:
            self._lock.detach(ttl_s=60)
        raise RuntimeError("no servers")

    @releases_lock(token="window")
    async def end_update_weights(self, window: UpdateWindow | LockLease | int, *, step: int) -> str:
        self._apply(f"v{step}")
        self.ended.append(step)
        return self._weights

    @staticmethod
    @lock_exempt
    def describe() -> str:
        return "controller"

    @lock_exempt
    @classmethod
    def kind(cls) -> str:
        return cls.__name__


def _outside(coro):
    return asyncio.create_task(coro, context=contextvars.Context())


async def _until(predicate) -> None:
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


# --- with_lock and requires_lock ---------------------------------------------------------------


async def test_with_lock_runs_the_method_holding_the_lock_and_releases() -> None:
    controller = Controller()
    controller.proceed.set()
    assert await controller.update_rollout_weights("v1") == "v1"
    assert controller._lock.statistics().held is False

    controller.proceed.clear()
    controller.entered.clear()
    running = asyncio.create_task(controller.update_rollout_weights("v2"))
    await controller.entered.wait()
    assert controller.health() == "Controller.update_rollout_weights"  # holder is the qualname
    controller.proceed.set()
    await running


async def test_with_lock_releases_when_the_body_raises() -> None:
    controller = Controller()
    with pytest.raises(RuntimeError, match="load failed"):
        await controller.failing_update()
    assert controller._lock.statistics().held is False


async def test_a_with_lock_method_calling_another_is_refused_as_reentry() -> None:
    controller = Controller()
    controller.proceed.set()
    with pytest.raises(LockReentryError, match="Controller.update_rollout_weights"):
        await controller.nested_update()
    assert controller._lock.statistics().held is False


async def test_requires_lock_on_a_sync_method_and_a_property() -> None:
    controller = Controller()
    with pytest.raises(LockNotHeldError, match="Controller._apply"):
        controller._apply("v9")
    with pytest.raises(LockNotHeldError, match="Controller.weights"):
        _ = controller.weights
    with pytest.raises(LockNotHeldError):
        controller.weights = "v9"
    with pytest.raises(LockNotHeldError):
        await controller._apply_async("v9")
    assert repr(controller) == "Controller(weights='v0')"  # exempt: no lock needed

    async with controller._lock.hold(holder="test"):
        controller._apply("v1")
        controller.weights = "v2"
        assert controller.weights == "v2"
        await controller._apply_async("v3")
        assert controller.weights == "v3"


async def test_static_and_class_methods_can_be_exempt() -> None:
    assert Controller.describe() == "controller"
    assert Controller.kind() == "Controller"


# --- windows: acquires_lock ... releases_lock --------------------------------------------------


async def test_a_window_blocks_others_until_releases_lock_ends_it() -> None:
    controller = Controller()
    controller.proceed.set()
    window = await controller.start_update_weights()
    stats = controller._lock.statistics()
    assert stats.held and stats.detached and stats.token == window.token
    assert stats.holder == "Controller.start_update_weights"
    assert stats.lease_expires_at is None  # detached by the decorator, without a TTL

    blocked = _outside(controller.update_rollout_weights("v1"))
    await _until(lambda: controller._lock.statistics().waiters == 1)
    assert not blocked.done()
    with pytest.raises(StaleLockError):
        controller._apply("meanwhile")  # the caller's context no longer owns the window

    assert await _outside(controller.end_update_weights(window, step=7)) == "v7"
    assert await blocked == "v1"
    assert controller.ended == [7]

    with pytest.raises(StaleLockError, match="was released"):
        await controller.end_update_weights(window, step=8)  # ending twice
    assert controller.ended == [7]  # refused before the body ran


async def test_releases_lock_takes_an_int_or_an_object_with_a_token() -> None:
    controller = Controller()
    window = await controller.start_update_weights()
    assert await controller.end_update_weights(window.token, step=1) == "v1"
    window = await controller.start_update_weights()
    assert await controller.end_update_weights(window=window, step=2) == "v2"
    with pytest.raises(LockDisciplineError, match="fencing token"):
        await controller.end_update_weights("not-a-token", step=3)
    with pytest.raises(LockDisciplineError):
        await controller.end_update_weights(True, step=3)


async def test_acquires_lock_keeps_a_lease_the_body_detached() -> None:
    controller = Controller(lease_ttl_s=60)
    window = await controller.start_update_weights()
    stats = controller._lock.statistics()
    assert stats.detached and stats.lease_expires_at is not None and stats.token == window.token
    await controller.end_update_weights(window, step=1)
    assert controller._lock.statistics().held is False


async def test_acquires_lock_releases_when_the_body_raises() -> None:
    controller = Controller()
    for detach_first in (False, True):
        with pytest.raises(RuntimeError, match="no servers"):
            await controller.start_failing_window(detach_first=detach_first)
        assert controller._lock.statistics().held is False


async def test_an_expired_window_is_refused_before_the_body_runs() -> None:
    controller = Controller(lease_ttl_s=0.02)
    window = await controller.start_update_weights()
    # The trainer stalls; the next update waits for the lease to run out, then proceeds.
    controller.proceed.set()
    assert await _outside(controller.update_rollout_weights("v1")) == "v1"
    with pytest.raises(LeaseExpiredError):
        await controller.end_update_weights(window, step=1)
    assert controller.ended == []
    with pytest.raises(LeaseExpiredError):
        controller._lock.renew(window.token, 10)


# --- refusals at class definition --------------------------------------------------------------


def test_an_undeclared_method_fails_at_class_definition() -> None:
    with pytest.raises(LockDisciplineError) as caught:

        @enforce_lock_discipline
        class Sloppy:
            @lock_exempt
            def __init__(self) -> None:
                self._lock = ContextLock("L")

            async def update(self) -> None:
                pass

    message = str(caught.value)
    assert "Sloppy" in message and "update" in message
    for decorator in ("@with_lock", "@acquires_lock", "@releases_lock", "@requires_lock", "@lock_exempt"):
        assert decorator in message
    assert isinstance(caught.value, TypeError)


def test_undeclared_dunders_properties_and_static_methods_fail_too() -> None:
    with pytest.raises(LockDisciplineError) as caught:

        @enforce_lock_discipline(lock_attribute="_guard")
        class Sloppy:
            def __repr__(self) -> str:
                return "sloppy"

            @property
            def state(self) -> str:
                return "serving"

            @staticmethod
            def helper() -> None:
                pass

            @classmethod
            def build(cls) -> None:
                pass

    message = str(caught.value)
    for name in ("__repr__", "state", "helper", "build"):
        assert name in message
    assert "self._guard" in message


def test_an_undeclared_property_setter_fails() -> None:
    with pytest.raises(LockDisciplineError, match="state"):

        @enforce_lock_discipline
        class Sloppy:
            @property
            @requires_lock
            def state(self) -> str:
                return "serving"

            @state.setter
            def state(self, value: str) -> None:
                pass


def test_misdeclared_methods_are_refused() -> None:
    with pytest.raises(LockDisciplineError, match="async"):

        class SyncWithLock:
            @with_lock
            def update(self) -> None:
                pass

    with pytest.raises(TypeError):

        class SyncAcquires:
            @acquires_lock
            def start(self) -> None:
                pass

    with pytest.raises(LockDisciplineError, match="no parameter 'window'"):

        class WrongParameter:
            @releases_lock(token="window")
            async def end(self, token: int) -> None:
                pass

    with pytest.raises(LockDisciplineError, match="both"):

        class Twice:
            @with_lock
            @requires_lock
            async def update(self) -> None:
                pass

    with pytest.raises(LockDisciplineError, match="static methods, class methods"):

        @enforce_lock_discipline
        class GuardedStatic:
            @staticmethod
            @requires_lock
            def helper() -> None:
                pass


def test_inherited_members_are_not_rechecked() -> None:
    class Base:
        def undeclared(self) -> str:
            return "base"

    @enforce_lock_discipline
    class Child(Base):
        @lock_exempt
        def __init__(self) -> None:
            self._lock = ContextLock("L")

    assert Child().undeclared() == "base"


# --- refusals at call time ---------------------------------------------------------------------


async def test_a_guarded_method_called_on_a_foreign_object_is_refused() -> None:
    @enforce_lock_discipline
    class Other:
        @lock_exempt
        def __init__(self) -> None:
            self._lock = ContextLock("Other")

    other = Other()
    with pytest.raises(LockDisciplineError, match="class it does not own"):
        await Controller.update_rollout_weights(other, "v1")  # type: ignore[arg-type]
    with pytest.raises(LockDisciplineError, match="class it does not own"):
        Controller._apply(other, "v1")  # type: ignore[arg-type]
    assert other._lock.statistics().held is False

    @enforce_lock_discipline
    class Sub(Controller):
        @requires_lock
        def extra(self) -> str:
            return self._weights

    sub = Sub()
    sub.proceed.set()
    assert await sub.update_rollout_weights("v5") == "v5"  # a subclass instance is owned
    async with sub._lock.hold(holder="t"):
        assert sub.extra() == "v5"


async def test_a_guarded_method_in_an_unenforced_class_or_without_a_lock_is_refused() -> None:
    class Unenforced:
        @with_lock
        async def update(self) -> None:
            pass

    with pytest.raises(LockDisciplineError, match="@enforce_lock_discipline"):
        await Unenforced().update()

    @enforce_lock_discipline
    class NoLock:
        @lock_exempt
        def __init__(self) -> None:
            self._lock = None

        @requires_lock
        def read(self) -> None:
            pass

    with pytest.raises(LockDisciplineError, match="not a ContextLock"):
        NoLock().read()


async def test_decorated_methods_keep_their_names_and_docs() -> None:
    assert Controller.update_rollout_weights.__name__ == "update_rollout_weights"
    assert Controller.end_update_weights.__qualname__ == "Controller.end_update_weights"
    assert Controller.update_rollout_weights.__wrapped__.__name__ == "update_rollout_weights"
    assert Controller.__dict__["weights"].fget.__name__ == "weights"


async def test_timeout_attribute_bounds_how_long_with_lock_waits() -> None:
    @enforce_lock_discipline(timeout_attribute="lock_timeout")
    class Bounded:
        @lock_exempt
        def __init__(self) -> None:
            self._lock = ContextLock("Bounded")
            self.lock_timeout = 0.05

        @with_lock
        async def guarded(self) -> str:
            return "ran"

    owner = Bounded()
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> None:
        async with owner._lock.hold(holder="blocker"):
            entered.set()
            await release.wait()

    blocker = asyncio.create_task(hold())
    await entered.wait()
    with pytest.raises(LockTimeoutError):
        await owner.guarded()
    release.set()
    await blocker
    assert await owner.guarded() == "ran"

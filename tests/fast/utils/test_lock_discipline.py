"""Lock discipline: every method of a lock-owning class declares how it relates to the lock, and
the declarations are enforced at definition and at call time."""

from __future__ import annotations

import asyncio

import pytest

from miles.errors import LockDisciplineError, LockNotHeldError, LockTimeoutError
from miles.utils.context_lock import ContextLock, enforce_lock_discipline, lock_exempt, requires_lock, with_lock


@enforce_lock_discipline(timeout_attribute="timeout_s")
class Controller:
    """A miniature of the InferenceController's lock use."""

    @lock_exempt
    def __init__(self, timeout_s: float | None = None) -> None:
        self._lock = ContextLock("InferenceController")
        self.timeout_s = timeout_s
        self._weights = "v0"
        self.entered = asyncio.Event()
        self.proceed = asyncio.Event()

    @property
    @requires_lock
    def weights(self) -> str:
        return self._weights

    @with_lock
    async def update(self, version: str) -> str:
        self._set(version)
        return self.weights

    @with_lock
    async def slow_update(self) -> None:
        self.entered.set()
        await self.proceed.wait()

    @requires_lock
    def _set(self, version: str) -> None:
        self._weights = version

    @lock_exempt
    def health(self) -> bool:
        return self._lock.statistics().held

    @staticmethod
    @lock_exempt
    def describe() -> str:
        return "controller"


async def test_with_lock_holds_it_and_requires_lock_checks_it() -> None:
    controller = Controller()
    assert await controller.update("v1") == "v1"
    assert controller.health() is False
    with pytest.raises(LockNotHeldError, match="Controller._set"):
        controller._set("v2")
    with pytest.raises(LockNotHeldError, match="weights"):
        _ = controller.weights
    assert Controller.describe() == "controller"


async def test_with_lock_waits_at_most_the_owners_timeout() -> None:
    controller = Controller(timeout_s=0.01)
    holder = asyncio.create_task(controller.slow_update())
    await controller.entered.wait()
    with pytest.raises(LockTimeoutError):
        await controller.update("v9")
    controller.proceed.set()
    await holder
    assert await controller.update("v2") == "v2"


def test_an_undeclared_method_is_refused_at_definition() -> None:
    with pytest.raises(LockDisciplineError, match="forgot"):

        @enforce_lock_discipline()
        class Careless:
            @lock_exempt
            def __init__(self) -> None:
                self._lock = ContextLock("x")

            def forgot(self) -> None:
                pass


def test_declarations_that_cannot_work_are_refused() -> None:
    with pytest.raises(LockDisciplineError, match="async"):

        class SyncWithLock:
            @with_lock
            def update(self) -> None:  # type: ignore[misc]
                pass

    with pytest.raises(LockDisciplineError, match="both"):

        class Twice:
            @with_lock
            @with_lock
            async def update(self) -> None:
                pass

    with pytest.raises(LockDisciplineError, match="no instance"):

        @enforce_lock_discipline()
        class Static:
            @staticmethod
            @requires_lock
            def helper() -> None:
                pass


async def test_a_guarded_method_needs_its_owner_and_a_lock() -> None:
    class Undecorated:
        @with_lock
        async def update(self) -> None:
            pass

    with pytest.raises(LockDisciplineError, match="enforce_lock_discipline"):
        await Undecorated().update()

    @enforce_lock_discipline()
    class NoLock:
        @lock_exempt
        def __init__(self) -> None:
            self._lock = None

        @with_lock
        async def update(self) -> None:
            pass

    with pytest.raises(LockDisciplineError, match="not a ContextLock"):
        await NoLock().update()

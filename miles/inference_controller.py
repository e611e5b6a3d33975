"""The InferenceController: the blocking facade over ``AsyncInferenceController``.

The seed's API, for a plain script: the asyncio core and its HTTP API run on a background thread.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import uvloop

from miles.config import ControllerSettings
from miles.controller.core import AsyncInferenceController
from miles.controller.fleet import DEFAULT_SERVER_CLS
from miles.controller.health import FleetHealth
from miles.controller.results import UpdateResult, UpdateWindow
from miles.http.runner import HttpServer
from miles.utils.audit_utils.event_logger.logger import EventLogger

__all__ = ["AsyncInferenceController", "InferenceController"]

T = TypeVar("T")


class _LoopThread:
    """An asyncio event loop running in a daemon thread, for the blocking facade."""

    def __init__(self) -> None:
        # uvloop: the controller's loop carries every routed request; libuv halves its overhead.
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="miles-controller-loop", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class InferenceController:
    """The blocking facade: serves the checkpoint and answers HTTP on ``port`` once constructed."""

    def __init__(
        self,
        rollout_server_cls: str | type | Mapping[str, Any] = DEFAULT_SERVER_CLS,
        model_checkpoint: str | Path | None = None,
        port: int | None = None,
        *,
        serve_http: bool = True,
        **kwargs: Any,
    ) -> None:
        if port is not None:
            kwargs["port"] = port
        self._runner = _LoopThread()
        self._http: Any = None
        try:
            # Built on the loop thread: the router and the lock bind to this loop.
            build = functools.partial(AsyncInferenceController, rollout_server_cls, model_checkpoint, **kwargs)
            self.core = self._runner.call(_call_sync(build))
            self.event_logger: EventLogger = self.core.event_logger
            self._runner.call(self.core.start())
            if serve_http:
                self._http = HttpServer(self.core)
                self._runner.call(self._http.start())
        except BaseException:
            self.close()
            raise
        # Where the HTTP API answers; None with serve_http=False.
        self.port: int | None = self._http.port if self._http else None
        self.url: str | None = self._http.url if self._http else None

    def update_rollout_weights(self, new_checkpoint: str | Path, **kwargs: Any) -> UpdateResult:
        """Blocking twin of ``AsyncInferenceController.update_rollout_weights``."""
        return self._runner.call(self.core.update_rollout_weights(new_checkpoint, **kwargs))

    def start_update_weights(self, model_name: str | None = None, **kwargs: Any) -> UpdateWindow:
        return self._runner.call(self.core.start_update_weights(model_name, **kwargs))

    def end_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateResult:
        return self._runner.call(self.core.end_update_weights(window, **kwargs))

    def renew_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateWindow:
        return self._runner.call(self.core.renew_update_weights(window, **kwargs))

    def abort_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateResult:
        return self._runner.call(self.core.abort_update_weights(window, **kwargs))

    def health(self) -> FleetHealth:
        return self._runner.call(_call_sync(self.core.health))

    def reconfigure(self, patch: dict[str, Any]) -> ControllerSettings:
        return self._runner.call(self.core.reconfigure(patch))

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the controller's loop (for callers mixing in async code)."""
        return self._runner.call(coro, timeout)

    def close(self) -> None:
        """Stop HTTP, abort open windows, stop every server; idempotent."""
        if self._runner is None:
            return
        try:
            if self._http is not None:
                self._runner.call(self._http.stop())
            core = getattr(self, "core", None)
            if core is not None:
                self._runner.call(core.close())
        finally:
            self._runner.stop()
            self._runner = None  # type: ignore[assignment]

    def __enter__(self) -> InferenceController:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _call_sync(func: Callable[[], T]) -> T:
    return func()

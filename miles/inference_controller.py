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
        # uvloop: the controller's loop carries every routed request; libuv halves its overhead.
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="miles-controller-loop", daemon=True)
        self._thread.start()
        self._http: Any = None
        try:
            # Built on the loop thread: the router and the lock bind to this loop.
            build = functools.partial(AsyncInferenceController, rollout_server_cls, model_checkpoint, **kwargs)
            self.core = self.run(_call_sync(build))
            self.event_logger: EventLogger = self.core.event_logger
            self.run(self.core.start())
            if serve_http:
                self._http = HttpServer(self.core)
                self.run(self._http.start())
        except BaseException:
            self.close()
            raise
        # Where the HTTP API answers; None with serve_http=False.
        self.port: int | None = self._http.port if self._http else None
        self.url: str | None = self._http.url if self._http else None

    def update_rollout_weights(self, new_checkpoint: str | Path, **kwargs: Any) -> UpdateResult:
        """Blocking twin of ``AsyncInferenceController.update_rollout_weights``."""
        return self.run(self.core.update_rollout_weights(new_checkpoint, **kwargs))

    def start_update_weights(self, model_name: str | None = None, **kwargs: Any) -> UpdateWindow:
        return self.run(self.core.start_update_weights(model_name, **kwargs))

    def end_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateResult:
        return self.run(self.core.end_update_weights(window, **kwargs))

    def renew_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateWindow:
        return self.run(self.core.renew_update_weights(window, **kwargs))

    def abort_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateResult:
        return self.run(self.core.abort_update_weights(window, **kwargs))

    def health(self) -> FleetHealth:
        return self.run(_call_sync(self.core.health))

    def reconfigure(self, patch: dict[str, Any]) -> ControllerSettings:
        return self.run(self.core.reconfigure(patch))

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the controller's loop (for callers mixing in async code)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        """Stop HTTP, abort open windows, stop every server; idempotent."""
        if self._loop.is_closed():
            return
        try:
            if self._http is not None:
                self.run(self._http.stop())
            core = getattr(self, "core", None)
            if core is not None:
                self.run(core.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> InferenceController:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _call_sync(func: Callable[[], T]) -> T:
    return func()

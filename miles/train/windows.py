"""The controller's window API as a pusher uses it (``WindowClient``), and the client for each
way a controller is reached (``window_client``); ``push_in_window`` runs a push inside a window.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar, runtime_checkable

from miles.controller.core import AsyncInferenceController
from miles.controller.results import UpdateResult, UpdateStatus, UpdateWindow
from miles.errors import PublishError
from miles.http.windows import HttpWindows
from miles.inference_controller import InferenceController
from miles.ray.windows import RayWindows, is_actor_handle
from miles.train.engine_calls import PushStats
from miles.utils.audit_utils.event_logger import InferenceEngineWeightChecksumEvent

logger = logging.getLogger("miles.train")

T = TypeVar("T")


@runtime_checkable
class WindowClient(Protocol):
    """The calls a push makes to the controller, wherever the controller runs."""

    async def open(self, *, model_name: str | None, ttl_s: float, staged: bool) -> UpdateWindow:
        """Open a window (``start_update_weights``) on the model's servers."""

    async def renew(self, window: UpdateWindow) -> None:
        """Extend the window's lease by its ``ttl_s`` from now."""

    async def publish(self, event: InferenceEngineWeightChecksumEvent) -> None:
        """Record the checksum training published, which the commit is held to."""

    async def end(self, window: UpdateWindow, *, checksum: str, step: int, weight_version: str) -> UpdateResult:
        """Verify every server of the window against ``checksum`` and commit (or say why not)."""

    async def abort(self, window: UpdateWindow, *, reason: str) -> None:
        """Put the window's servers back on their verified weights."""


class LocalWindows:
    """The window API of a controller in this process: an ``AsyncInferenceController`` on this
    loop, or the blocking ``InferenceController``, whose coroutines run on its own loop."""

    def __init__(self, controller: AsyncInferenceController | InferenceController) -> None:
        self._blocking = controller if isinstance(controller, InferenceController) else None
        self.controller = controller.core if isinstance(controller, InferenceController) else controller

    async def _run(self, call: Coroutine[Any, Any, T]) -> T:
        return await (call if self._blocking is None else asyncio.to_thread(self._blocking.run, call))

    async def open(self, *, model_name: str | None, ttl_s: float, staged: bool) -> UpdateWindow:
        return await self._run(self.controller.start_update_weights(model_name, ttl_s=ttl_s, staged=staged))

    async def renew(self, window: UpdateWindow) -> None:
        await self._run(self.controller.renew_update_weights(window.token))

    async def publish(self, event: InferenceEngineWeightChecksumEvent) -> None:
        self.controller.event_logger.log(InferenceEngineWeightChecksumEvent, event, print_log=False)

    async def end(self, window: UpdateWindow, *, checksum: str, step: int, weight_version: str) -> UpdateResult:
        return await self._run(
            self.controller.end_update_weights(
                window.token, checksum=checksum, step=step, weight_version=weight_version
            )
        )

    async def abort(self, window: UpdateWindow, *, reason: str) -> None:
        await self._run(self.controller.abort_update_weights(window.token, reason=reason))


def window_client(controller: object) -> WindowClient:
    """The client of ``controller`` (any of the message below; a URL with ``MILES_ADMIN_TOKEN``
    from the environment when it is set); TypeError for anything else."""
    if isinstance(controller, str):
        return HttpWindows(controller, admin_token=os.environ.get("MILES_ADMIN_TOKEN", "").strip() or None)
    if isinstance(controller, AsyncInferenceController | InferenceController):
        return LocalWindows(controller)
    if is_actor_handle(controller):
        return RayWindows(controller)
    if isinstance(controller, WindowClient):
        return controller
    raise TypeError(
        f"cannot push through a {type(controller).__name__}: give an AsyncInferenceController, an "
        "InferenceController, the URL of a controller's HTTP API, the named controller's Ray actor "
        "handle (miles.ray.controller.get_controller()), or a WindowClient"
    )


async def keep_alive(client: WindowClient, window: UpdateWindow) -> None:
    """Renew the window's lease every third of it until cancelled, so the lease stays short (a
    trainer that dies holds the fleet for one lease) however long the push takes."""
    while True:
        await asyncio.sleep(window.ttl_s / 3)
        try:
            await client.renew(window)
        except Exception as exc:  # noqa: BLE001  # a heartbeat must not die of one failed beat
            logger.warning("could not renew window %d: %s", window.token, exc)


async def abort_quietly(client: WindowClient, window: UpdateWindow, *, reason: str) -> None:
    """Abort the window, logging a failure: the window also ends with its lease, and the error
    that made the push abort is the one to report."""
    try:
        await client.abort(window, reason=reason)
    except Exception as exc:  # noqa: BLE001  # best effort, see above
        logger.warning("could not abort window %d: %s", window.token, exc)


async def push_in_window(
    client: WindowClient, window: UpdateWindow, push: Callable[[], Awaitable[str]], *, step: int, stats: PushStats
) -> str:
    """Run ``push`` (it returns the model checksum) while the window's lease is renewed, publish
    that checksum and end the window; returns the checksum. Whatever fails aborts the window and is
    raised as a PublishError (a cancellation as it is), as is a window the controller did not commit."""
    began = time.perf_counter()
    version = str(step)
    renewing = asyncio.create_task(keep_alive(client, window), name=f"renew-window-{window.token}")
    try:
        checksum = await push()
        pushed = time.perf_counter()
        await client.publish(
            InferenceEngineWeightChecksumEvent(
                model_name=window.model_name, checksum=checksum, step=step, weight_version=version
            )
        )
        ended = await client.end(window, checksum=checksum, step=step, weight_version=version)
    except BaseException as exc:
        await abort_quietly(client, window, reason=f"the push failed: {exc}")
        if isinstance(exc, PublishError | asyncio.CancelledError):
            raise
        raise PublishError(f"pushing step {step} failed: {exc}") from exc
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
    if ended.status is not UpdateStatus.COMMITTED:
        raise PublishError(f"the controller did not commit step {step}: {ended.status.value}: {ended.message}")
    stats.timings |= {"push": pushed - began, "commit": time.perf_counter() - pushed}
    return checksum

"""The named controller's window API through its Ray actor handle (``get_controller()``).

Importing this module does not import Ray: an actor handle exists only once Ray is imported, and
that is all ``is_actor_handle`` looks for.
"""

from __future__ import annotations

import sys
from typing import Any

from miles.controller.results import UpdateResult, UpdateWindow
from miles.utils.audit_utils.event_logger import InferenceEngineWeightChecksumEvent


def is_actor_handle(value: object) -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(value, ray.actor.ActorHandle)


class RayWindows:
    """The window API of an ``InferenceControllerActor``'s handle (each call awaits its ObjectRef)."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    async def open(self, *, model_name: str | None, ttl_s: float, staged: bool) -> UpdateWindow:
        return await self._actor.start_update_weights.remote(model_name, ttl_s=ttl_s, staged=staged)

    async def renew(self, window: UpdateWindow) -> None:
        await self._actor.renew_update_weights.remote(window.token)

    async def publish(self, event: InferenceEngineWeightChecksumEvent) -> None:
        await self._actor.log_event.remote(event)

    async def end(self, window: UpdateWindow, *, checksum: str, step: int, weight_version: str) -> UpdateResult:
        return await self._actor.end_update_weights.remote(
            window.token, checksum=checksum, step=step, weight_version=weight_version
        )

    async def abort(self, window: UpdateWindow, *, reason: str) -> None:
        await self._actor.abort_update_weights.remote(window.token, reason=reason)

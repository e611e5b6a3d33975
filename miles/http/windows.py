"""The controller's window API over its HTTP API, for a trainer in another process.

A refusal is a PublishError with the controller's message; a controller that does not answer
raises httpx's error.
"""

from __future__ import annotations

import contextlib
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from miles.controller.results import UpdateResult, UpdateWindow
from miles.errors import PublishError
from miles.http.controller_app import AbortWindowRequest, EndWindowRequest, RenewWindowRequest, StartWindowRequest
from miles.protocol.base import ErrorAnswer, ResponseModel
from miles.utils.audit_utils.event_logger import InferenceEngineWeightChecksumEvent

M = TypeVar("M", bound=BaseModel)


class _Logged(ResponseModel):
    """What ``POST /events`` answers."""

    event_id: str
    type: str


class HttpWindows:
    """The window API of the controller whose HTTP API is at ``url``; ``admin_token``: what its
    admin endpoints take, as ``Authorization: Bearer``, when it has one."""

    def __init__(self, url: str, *, admin_token: str | None) -> None:
        self.url = url.rstrip("/")
        self._headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}

    async def _post(self, path: str, body: BaseModel, *, answer: type[M]) -> M:
        """POST ``body`` to ``path``, read the answer as ``answer``; PublishError otherwise."""
        async with httpx.AsyncClient(trust_env=False, timeout=None, headers=self._headers) as http:
            response = await http.post(f"{self.url}{path}", json=body.model_dump(mode="json"))
        with contextlib.suppress(ValidationError):
            return answer.model_validate_json(response.content)
        try:
            refused = ErrorAnswer.model_validate_json(response.content)
        except ValidationError:
            raise PublishError(
                f"the controller at {self.url} answered {path} with {response.status_code} and a body that is "
                f"no answer of its API: {response.text[:300]!r}"
            ) from None
        raise PublishError(f"the controller refused {path}: {refused.error.message}")

    async def open(self, *, model_name: str | None, ttl_s: float, staged: bool) -> UpdateWindow:
        request = StartWindowRequest(model_name=model_name, ttl_s=ttl_s, staged=staged)
        return await self._post("/update_weights/start", request, answer=UpdateWindow)

    async def renew(self, window: UpdateWindow) -> None:
        await self._post("/update_weights/renew", RenewWindowRequest(token=window.token), answer=UpdateWindow)

    async def publish(self, event: InferenceEngineWeightChecksumEvent) -> None:
        await self._post("/events", event, answer=_Logged)

    async def end(self, window: UpdateWindow, *, checksum: str, step: int, weight_version: str) -> UpdateResult:
        request = EndWindowRequest(token=window.token, checksum=checksum, step=step, weight_version=weight_version)
        # An update that did not commit is an answer too (409 with its result), not a refusal.
        return await self._post("/update_weights/end", request, answer=UpdateResult)

    async def abort(self, window: UpdateWindow, *, reason: str) -> None:
        abort = AbortWindowRequest(token=window.token, reason=reason)
        await self._post("/update_weights/abort", abort, answer=UpdateResult)

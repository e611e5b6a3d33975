"""Forwarding inference requests to the server the router picks (adapter: the data path's HTTP).

A request the chosen server never received (connection refused or reset before an answer: the
server died or is restarting) is retried on another serving server, so a crash costs latency, not
a failed request. Anything the server answered is passed through as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
import httpx
from fastapi.responses import Response, StreamingResponse

from miles.ray.rollout.router import NoServerAvailableError, RouteLease, Router
from miles.server.metrics import ControllerMetrics

logger = logging.getLogger("miles.router")

# Retryable: the request provably never reached a server that could have acted on it.
_NOT_DELIVERED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)


@dataclass(frozen=True)
class RouteOptions:
    model_name: str
    session_id: str | None
    min_weight_version: str | None
    timeout_s: float


class Proxy:
    def __init__(self, *, router: Router, http: httpx.AsyncClient, metrics: ControllerMetrics, max_attempts: int) -> None:
        self._router = router
        self._http = http
        self._metrics = metrics
        self._max_attempts = max_attempts

    async def forward(self, path: str, payload: bytes, options: RouteOptions) -> Response:
        """Send the JSON ``payload`` to ``path`` on a routed server and return its answer unchanged."""
        started = time.perf_counter()
        excluded: set[str] = set()
        for attempt in range(self._max_attempts):
            lease = await self._lease(options, excluded, started)
            try:
                response = await self._http.post(
                    f"{lease.url}{path}",
                    content=payload,
                    headers={"content-type": "application/json"},
                    timeout=options.timeout_s,
                )
            except _NOT_DELIVERED as exc:
                logger.warning("%s unreachable (%s); retrying elsewhere (attempt %d)", lease.server_id, exc, attempt + 1)
                excluded.add(lease.server_id)
                continue
            finally:
                self._router.release(lease)
            self._metrics.request_done(options.model_name, ok=response.status_code < 400, started=started)
            return Response(
                content=response.content,
                status_code=response.status_code,
                media_type=response.headers.get("content-type", "application/json"),
                headers={"x-miles-server": lease.server_id},
            )
        self._metrics.request_done(options.model_name, ok=False, started=started)
        raise NoServerAvailableError(
            f"no server of {options.model_name!r} could be reached after {self._max_attempts} attempts",
            tried=sorted(excluded),
        )

    async def stream(self, path: str, payload: bytes, options: RouteOptions) -> StreamingResponse:
        """Stream a server's server-sent events through; retried only before the first byte."""
        started = time.perf_counter()
        excluded: set[str] = set()
        for _ in range(self._max_attempts):
            lease = await self._lease(options, excluded, started)
            request = self._http.build_request(
                "POST", f"{lease.url}{path}", content=payload, headers={"content-type": "application/json"},
                timeout=options.timeout_s,
            )
            try:
                upstream = await self._http.send(request, stream=True)
            except _NOT_DELIVERED:
                self._router.release(lease)
                excluded.add(lease.server_id)
                continue
            return StreamingResponse(
                self._relay(upstream, lease, options, started),
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type", "text/event-stream"),
                headers={"x-miles-server": lease.server_id},
            )
        raise NoServerAvailableError(f"no server of {options.model_name!r} could be reached", tried=sorted(excluded))

    async def _relay(
        self, upstream: httpx.Response, lease: RouteLease, options: RouteOptions, started: float
    ) -> AsyncIterator[bytes]:
        ok = upstream.status_code < 400
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            ok = False
            raise
        finally:
            await upstream.aclose()
            self._router.release(lease)
            self._metrics.request_done(options.model_name, ok=ok, started=started)

    async def _lease(self, options: RouteOptions, excluded: set[str], started: float) -> RouteLease:
        remaining = options.timeout_s - (time.perf_counter() - started)
        try:
            return await self._router.acquire(
                options.model_name,
                timeout_s=max(remaining, 0.0),
                session_id=options.session_id,
                min_weight_version=options.min_weight_version,
                exclude=frozenset(excluded),
            )
        except NoServerAvailableError:
            self._metrics.request_done(options.model_name, ok=False, started=started)
            raise

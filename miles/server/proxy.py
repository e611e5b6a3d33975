"""Forwarding inference requests to the server the router picks (adapter: the data path's HTTP).

A request the chosen server never received (connection refused or reset before an answer: the
server died or is restarting) is retried on another serving server, so a crash costs latency, not
a failed request. Anything the server answered is passed through as it is.

The data path uses aiohttp's client rather than httpx (which the control path uses): it sends a
request's headers and body in one write and costs ~0.35 ms less per routed request on this
machine, which is most of the routing budget (docs/PERFORMANCE.md, "Routing").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from fastapi.responses import Response, StreamingResponse

from miles.ray.rollout.router import NoServerAvailableError, RouteLease, Router
from miles.server.metrics import ControllerMetrics

logger = logging.getLogger("miles.router")

# Retryable: the request provably never reached a server that could have acted on it.
_NOT_DELIVERED = (aiohttp.ClientConnectionError,)
_JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class RouteOptions:
    model_name: str
    session_id: str | None
    min_weight_version: str | None
    timeout_s: float


def new_session() -> aiohttp.ClientSession:
    """A connection pool for loopback calls to our own servers (no proxies from the environment)."""
    connector = aiohttp.TCPConnector(limit=512, limit_per_host=256, keepalive_timeout=30)
    return aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False)


class Proxy:
    def __init__(
        self, *, router: Router, session: aiohttp.ClientSession, metrics: ControllerMetrics, max_attempts: int
    ) -> None:
        self._router = router
        self._session = session
        self._metrics = metrics
        self._max_attempts = max_attempts

    async def forward(self, path: str, payload: bytes, options: RouteOptions) -> Response:
        """Send the JSON ``payload`` to ``path`` on a routed server and return its answer unchanged."""
        started = time.perf_counter()
        excluded: set[str] = set()
        timeout = aiohttp.ClientTimeout(total=options.timeout_s)
        for attempt in range(self._max_attempts):
            lease = await self._lease(options, excluded, started)
            try:
                async with self._session.post(
                    f"{lease.url}{path}", data=payload, headers=_JSON, timeout=timeout
                ) as upstream:
                    content = await upstream.read()
                    status = upstream.status
                    media_type = upstream.headers.get("content-type", "application/json")
            except _NOT_DELIVERED as exc:
                # Generation has no side effects, so a request whose answer never arrived is safe
                # to run again elsewhere.
                logger.warning("%s unreachable (%s); retrying elsewhere (attempt %d)", lease.server_id, exc, attempt + 1)
                excluded.add(lease.server_id)
                continue
            except TimeoutError:
                self._metrics.request_done(options.model_name, ok=False, started=started)
                raise
            finally:
                self._router.release(lease)
            self._metrics.request_done(options.model_name, ok=status < 400, started=started)
            return Response(
                content=content,
                status_code=status,
                media_type=media_type,
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
        timeout = aiohttp.ClientTimeout(total=options.timeout_s)
        for _ in range(self._max_attempts):
            lease = await self._lease(options, excluded, started)
            try:
                upstream = await self._session.post(f"{lease.url}{path}", data=payload, headers=_JSON, timeout=timeout)
            except _NOT_DELIVERED:
                self._router.release(lease)
                excluded.add(lease.server_id)
                continue
            return StreamingResponse(
                self._relay(upstream, lease, options, started),
                status_code=upstream.status,
                media_type=upstream.headers.get("content-type", "text/event-stream"),
                headers={"x-miles-server": lease.server_id},
            )
        raise NoServerAvailableError(f"no server of {options.model_name!r} could be reached", tried=sorted(excluded))

    async def _relay(
        self, upstream: aiohttp.ClientResponse, lease: RouteLease, options: RouteOptions, started: float
    ) -> AsyncIterator[bytes]:
        ok = upstream.status < 400
        try:
            async for chunk in upstream.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.CancelledError):
            ok = False
            raise
        finally:
            upstream.release()
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

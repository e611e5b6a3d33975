"""Forwarding inference requests to the server the router picks (adapter: the data path's HTTP).

Which requests are retried where: docs/ARCHITECTURE.md, "Routing and retries". The data path
uses aiohttp's client rather than httpx: it sends a request's headers and body in one write and
costs ~0.35 ms less per routed request on this machine, most of the routing budget
(docs/PERFORMANCE.md, "Routing").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi.responses import Response, StreamingResponse

from miles.controller.router import Exclusion, NoServerAvailableError, RouteLease, Router
from miles.errors import ControllerBusyError
from miles.http.metrics import RequestMetrics, outcome_of
from miles.rollout.state import EngineApi
from miles.utils.http import MIB

logger = logging.getLogger("miles.router")

# Retryable: no whole answer arrived, because the connection failed or the server died while it
# sent its body (a payload cut short of its length). Generation has no side effects, so running
# the request again is safe either way.
_NOT_DELIVERED = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
_JSON = {"content-type": "application/json"}
# Answers that say the server failed or is full (429: its queue), not the request: worth a try
# elsewhere.
_TRY_ELSEWHERE = frozenset({429, 500, 502, 503, 504})
_COUNTS = b'"completion_tokens"'


@dataclass(frozen=True)
class RouteOptions:
    model_name: str
    session_id: str | None
    min_weight_version: str | None
    timeout_s: float
    # Only servers whose engines speak this API (the request was shaped for it); None: any.
    engine: EngineApi | None = None


def new_session() -> aiohttp.ClientSession:
    """A connection pool for loopback calls to our own servers (no proxies from the environment).
    Idle connections are kept 30 s, less than engines keep them (75 s): a pooled connection the
    server already closed would fail the next request sent on it."""
    connector = aiohttp.TCPConnector(limit=512, limit_per_host=256, keepalive_timeout=30)
    return aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False)


class HeldBodies:
    """The bytes of request bodies held while their requests are routed, within ``limit()``."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self.held = 0

    @contextmanager
    def hold(self, size: int, *, refusable: bool = True) -> Iterator[None]:
        """Count ``size`` bytes as held until the block ends; ControllerBusyError past the budget
        (one request alone always fits). ``refusable=False``: more bytes of a request already let
        in, never refused (retrying would not make them fit)."""
        limit = self._limit()
        if refusable and self.held and self.held + size > limit:
            raise ControllerBusyError(
                f"the controller holds {self.held / MIB:.1f} MiB of request bodies being routed and "
                f"this one adds {size / MIB:.1f} MiB; try again shortly, or raise max_held_request_mib "
                "(MILES_MAX_HELD_REQUEST_MIB)",
                max_held_request_mib=limit // MIB,
            )
        self.held += size
        try:
            yield
        finally:
            self.held -= size


@dataclass
class _Attempts:
    """The bookkeeping of one request's tries: its deadline, what it excluded, how many tries."""

    options: RouteOptions
    left: int
    started: float = field(default_factory=time.perf_counter)
    excluded: tuple[Exclusion, ...] = ()

    def remaining(self) -> float:
        return max(self.options.timeout_s - (time.perf_counter() - self.started), 0.0)

    def exclude(self, lease: RouteLease) -> None:
        self.excluded = (*self.excluded, Exclusion.of(lease))


@dataclass(kw_only=True)
class Proxy:
    router: Router
    session: aiohttp.ClientSession
    metrics: RequestMetrics
    max_attempts: int
    # (model_name, server_id): a request could not reach that server; probe it now.
    on_unreachable: Callable[[str, str], None]
    engine_secret: str | None = None

    def __post_init__(self) -> None:
        # Engines launched by the controller may require their secret for inference too (when the
        # controller's own API key is set): the proxy is the controller, so it presents it.
        # Servers someone else runs (attached) never see it (``_JSON`` alone): it would let them, or
        # anyone on the way to them, change the weights of the engines this controller launched.
        self._headers = {**_JSON, "authorization": f"Bearer {self.engine_secret}"} if self.engine_secret else _JSON

    async def lease(self, options: RouteOptions) -> RouteLease:
        """Claim the server the router picks for a request (waiting as ``forward`` does), to shape
        the request for it; ``forward`` or ``stream`` given it sends there first and releases it."""
        return await self._lease(_Attempts(options, left=self.max_attempts))

    def release(self, lease: RouteLease) -> None:
        """Give back a lease claimed with ``lease`` that will not be sent (the request was refused)."""
        self.router.release(lease)

    async def forward(
        self, path: str, payload: bytes, options: RouteOptions, *, lease: RouteLease | None = None
    ) -> Response:
        """Send ``payload`` to ``path`` on a routed server (``lease``'s first); its answer unchanged."""
        tries = _Attempts(options, left=self.max_attempts)
        lease = lease or await self._lease(tries)
        while True:
            tries.left -= 1
            try:
                async with self._post(lease, path, payload, tries) as upstream:
                    content = await upstream.read()
                    status = upstream.status
                    media_type = upstream.headers.get("content-type", "application/json")
                    retry_after = upstream.headers.get("retry-after")
            except BaseException as exc:
                self.router.release(lease)
                if isinstance(exc, _NOT_DELIVERED):
                    # Run again elsewhere, or on the restarted server.
                    lease = await self._after_unreachable(lease, tries, exc)
                    continue
                if isinstance(exc, TimeoutError):
                    self.metrics.request_done(
                        options.model_name, server=lease.server_id, outcome="timeout", started=tries.started
                    )
                raise
            self.router.release(lease)
            if status in _TRY_ELSEWHERE and tries.left > 0:
                if (other := self._elsewhere(lease, tries)) is not None:
                    logger.warning("%s answered %d; retrying on %s", lease.server_id, status, other.server_id)
                    lease = other
                    continue
            self.metrics.request_done(
                options.model_name,
                server=lease.server_id,
                outcome=outcome_of(status),
                started=tries.started,
                content=content,
            )
            headers = {"x-miles-server": lease.server_id}
            if retry_after is not None:
                headers["retry-after"] = retry_after
            return Response(content=content, status_code=status, media_type=media_type, headers=headers)

    async def stream(
        self, path: str, payload: bytes, options: RouteOptions, *, lease: RouteLease | None = None
    ) -> StreamingResponse:
        """Stream a server's server-sent events through (first ``lease``'s server's, when given).
        The first chunk is read before the response starts: a server that dies before sending
        anything costs a retry, not a broken stream."""
        tries = _Attempts(options, left=self.max_attempts)
        lease = lease or await self._lease(tries)
        while True:
            tries.left -= 1
            upstream: aiohttp.ClientResponse | None = None
            try:
                upstream = await self._post(lease, path, payload, tries)
                first = await _first_chunk(upstream)
                self.metrics.first_byte(options.model_name, started=tries.started)
            except BaseException as exc:
                if upstream is not None:
                    upstream.release()
                self.router.release(lease)
                if not isinstance(exc, _NOT_DELIVERED):
                    raise
                lease = await self._after_unreachable(lease, tries, exc)
                continue
            return StreamingResponse(
                self._relay(upstream, first, lease, tries),
                status_code=upstream.status,
                media_type=upstream.headers.get("content-type", "text/event-stream"),
                headers={"x-miles-server": lease.server_id},
            )

    def _post(self, lease: RouteLease, path: str, payload: bytes, tries: _Attempts) -> Any:
        return self.session.post(
            f"{lease.url}{path}",
            data=payload,
            headers=_JSON if lease.attached else self._headers,
            timeout=aiohttp.ClientTimeout(total=max(tries.remaining(), 0.01)),
        )

    async def _relay(
        self, upstream: aiohttp.ClientResponse, first: bytes, lease: RouteLease, tries: _Attempts
    ) -> AsyncIterator[bytes]:
        outcome = outcome_of(upstream.status)
        # Each streamed chunk repeats the counts so far: the last one says what the request made.
        last = first
        try:
            yield first
            async for chunk in upstream.content.iter_any():
                if _COUNTS in chunk:
                    last = chunk
                yield chunk
        except (aiohttp.ClientError, asyncio.CancelledError):
            outcome = "interrupted"
            raise
        finally:
            upstream.release()
            self.router.release(lease)
            self.metrics.request_done(
                tries.options.model_name,
                server=lease.server_id,
                outcome=outcome,
                started=tries.started,
                content=_last_event(last),
            )

    async def _after_unreachable(self, lease: RouteLease, tries: _Attempts, exc: BaseException) -> RouteLease:
        """Exclude the incarnation that failed, have it probed now, and wait for another lease."""
        logger.warning("%s unreachable (%s); retrying (%d tries left)", lease.server_id, exc, tries.left)
        tries.exclude(lease)
        self.on_unreachable(lease.model_name, lease.server_id)
        if tries.left <= 0:
            self.metrics.request_done(
                tries.options.model_name, server=lease.server_id, outcome="unreachable", started=tries.started
            )
            raise NoServerAvailableError(
                f"no server of {tries.options.model_name!r} could be reached after {self.max_attempts} attempts",
                tried=sorted({e.server_id for e in tries.excluded}),
            )
        return await self._lease(tries)

    def _elsewhere(self, failed: RouteLease, tries: _Attempts) -> RouteLease | None:
        """Another server that can take the request right now, excluding the one that failed."""
        options = tries.options
        other = self.router.try_acquire(
            options.model_name,
            session_id=None,
            min_weight_version=options.min_weight_version,
            exclude=(*tries.excluded, Exclusion.of(failed)),
            engine=options.engine,
        )
        if other is not None:
            tries.exclude(failed)
        return other

    async def _lease(self, tries: _Attempts) -> RouteLease:
        options = tries.options
        try:
            return await self.router.acquire(
                options.model_name,
                timeout_s=tries.remaining(),
                session_id=options.session_id,
                min_weight_version=options.min_weight_version,
                exclude=tries.excluded,
                engine=options.engine,
            )
        except (NoServerAvailableError, ControllerBusyError) as exc:
            outcome = "busy" if isinstance(exc, ControllerBusyError) else "unavailable"
            self.metrics.request_done(options.model_name, server="", outcome=outcome, started=tries.started)
            raise


async def _first_chunk(upstream: aiohttp.ClientResponse) -> bytes:
    """The stream's first bytes; a successful stream that ends before any was not delivered."""
    first = await upstream.content.readany()
    if not first and upstream.status < 400:
        raise aiohttp.ServerDisconnectedError("the stream ended before its first byte")
    return first


def _last_event(chunk: bytes) -> bytes:
    """The last server-sent event of ``chunk`` that carries the counts (not ``[DONE]``)."""
    return next((event for event in reversed(chunk.split(b"\n\n")) if _COUNTS in event), b"")

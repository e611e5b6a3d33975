"""The proxy against servers that die while they answer: a request whose answer never arrived
whole runs again on another server, never a 500 (edge fakes: raw HTTP on loopback)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from miles.config import RoutingPolicy
from miles.controller.router import NoServerAvailableError, Router
from miles.http.metrics import NO_REQUEST_METRICS
from miles.http.proxy import Proxy, RouteOptions, new_session
from miles.rollout.state import ServerSnapshot
from miles.testing import server_snapshot

Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def cut_short(writer: asyncio.StreamWriter) -> None:
    """Headers that promise a body, a part of it, then the connection closes (a crash mid-answer)."""
    writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 508\r\n\r\n{"text":')


async def whole(writer: asyncio.StreamWriter) -> None:
    body = json.dumps({"text": "whole"}).encode()
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body)


@asynccontextmanager
async def server(answer: Answer) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        await answer(writer)
        await writer.drain()
        writer.close()

    listening = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
    finally:
        listening.close()
        await listening.wait_closed()


def serving(server_id: str, url: str) -> ServerSnapshot:
    return server_snapshot(server_id, url=url, incarnation=1)


@asynccontextmanager
async def proxy_over(servers: list[ServerSnapshot], unreachable: list[str]) -> AsyncIterator[Proxy]:
    router = Router(servers=lambda _: servers, policy=lambda: RoutingPolicy.ROUND_ROBIN)
    session = new_session()
    try:
        yield Proxy(
            router=router,
            session=session,
            metrics=NO_REQUEST_METRICS,
            max_attempts=3,
            on_unreachable=lambda _model, server_id: unreachable.append(server_id),
        )
    finally:
        await session.close()


async def test_an_answer_cut_short_runs_again_on_another_server() -> None:
    unreachable: list[str] = []
    async with server(cut_short) as dying, server(whole) as alive:
        async with proxy_over([serving("dying", dying), serving("alive", alive)], unreachable) as proxy:
            options = RouteOptions(model_name="m", session_id=None, min_weight_version=None, timeout_s=10)
            for _ in range(4):  # in turn: the dying server is picked first at least once
                answer = await proxy.forward("/generate", b"{}", options)
                assert (answer.status_code, json.loads(answer.body)) == (200, {"text": "whole"})
                assert answer.headers["x-miles-server"] == "alive"
    assert "dying" in unreachable


async def test_answers_cut_short_everywhere_end_as_no_server_available() -> None:
    unreachable: list[str] = []
    async with server(cut_short) as dying:
        async with proxy_over([serving("dying", dying)], unreachable) as proxy:
            options = RouteOptions(model_name="m", session_id=None, min_weight_version=None, timeout_s=2)
            with pytest.raises((NoServerAvailableError, TimeoutError)):
                await proxy.forward("/generate", b"{}", options)
    assert unreachable and set(unreachable) == {"dying"}

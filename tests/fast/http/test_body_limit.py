"""BodyLimit and CheckFirst over real HTTP (uvicorn on loopback, one small app): a body that stops
arriving is refused with 408 once it has been idle for the limit, a whole body passes, and a
caller refused before its body is read gets its answer even if that body stalls."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from starlette.types import Scope

import miles.utils.http
from miles.errors import AuthenticationError
from miles.testing import app_on_loopback
from miles.utils.http import BodyLimit, CheckFirst, install_error_handlers

IDLE_S = 0.5


def needs_a_credential(scope: Scope) -> None:
    if scope["path"] == "/guarded" and not any(name == b"authorization" for name, _ in scope["headers"]):
        raise AuthenticationError("/guarded needs a credential")


@pytest.fixture
def port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(miles.utils.http, "BODY_IDLE_TIMEOUT_S", IDLE_S)
    app = FastAPI()
    install_error_handlers(app, logger=logging.getLogger("test"), not_found="no such endpoint")
    app.add_middleware(BodyLimit, max_bytes=1 << 20, setting="TEST_LIMIT")
    app.add_middleware(CheckFirst, check=needs_a_credential, key="test")

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    with app_on_loopback(app) as chosen:
        yield chosen


def answer(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10 * IDLE_S + 10) as sock:
        sock.sendall(request)
        return sock.makefile("rb").readline()


def test_a_body_that_stops_arriving_is_refused_with_408(port: int) -> None:
    started = time.monotonic()
    status = answer(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert status.split()[1] == b"408", status
    assert time.monotonic() - started < 10 * IDLE_S


def test_a_chunked_body_that_stops_arriving_is_refused_with_408(port: int) -> None:
    status = answer(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")
    assert status.split()[1] == b"408", status


def test_a_whole_body_passes(port: int) -> None:
    status = answer(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    assert status.split()[1] == b"200", status


def test_a_refused_caller_whose_body_stalls_gets_its_refusal_once_idle(port: int) -> None:
    started = time.monotonic()
    status = answer(port, b"POST /guarded HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert status.split()[1] == b"401", status
    assert time.monotonic() - started < 10 * IDLE_S

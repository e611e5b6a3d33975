"""What a pusher makes of the answers it gets, over real HTTP (uvicorn on loopback, one small app
standing in for an engine and a controller, answering in miles' error shape): a refusal that names
a ``Refusal`` is carried by the PublishError, an answer that is no answer of the API is a
PublishError naming who sent it, and a success is read as the protocol's response."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from miles.config import UpdatePauseMode
from miles.controller.results import UpdateResult, UpdateWindow, WindowServer
from miles.errors import AuthenticationError, ConflictError, PublishError, Refusal
from miles.http.windows import HttpWindows
from miles.protocol.sglang_weights import DestroyWeightsUpdateGroupRequest, UpdateWeightsResponse
from miles.testing import app_on_loopback
from miles.train import engine_calls
from miles.train.engine_calls import PushStats
from miles.train.windows import window_client
from miles.utils.audit_utils.event_logger import InferenceEngineWeightChecksumEvent
from miles.utils.http import install_error_handlers

GROUP = DestroyWeightsUpdateGroupRequest(group_name="g")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = FastAPI()
    install_error_handlers(app, logger=logging.getLogger("test"), not_found="no such endpoint")

    @app.post("/stages/update_weights_from_tensor")
    async def stages() -> UpdateWeightsResponse:
        return UpdateWeightsResponse(success=True, message="staged", timings={"stage": 0.5})

    @app.post("/full/update_weights_from_tensor")
    async def full() -> None:
        raise ConflictError("this engine cannot stage pushed weights now", refusal=Refusal.CANNOT_STAGE)

    @app.post("/proxy/update_weights_from_tensor")
    async def proxy() -> PlainTextResponse:
        return PlainTextResponse("<html>bad gateway</html>", status_code=502)

    @app.post("/controller/update_weights/start")
    async def start() -> None:
        raise AuthenticationError("/update_weights/start needs the admin token")

    @app.post("/proxy/update_weights/start")
    async def garbled() -> PlainTextResponse:
        return PlainTextResponse("<html>bad gateway</html>", status_code=502)

    with app_on_loopback(app) as port:
        yield f"http://127.0.0.1:{port}"


def window(url: str, *engines: str) -> UpdateWindow:
    return UpdateWindow(
        window_id="w",
        update_id="u",
        model_name="tiny",
        token=7,
        expires_at=None,
        ttl_s=10.0,
        pause_mode=UpdatePauseMode.DRAIN,
        servers=tuple(WindowServer(server_id=e, url=f"{url}/{e}", weight_version="1") for e in engines),
        credential="c" * 32,
    )


def post_tensor(url: str, *engines: str) -> PushStats:
    stats = PushStats(path="shm")

    async def call() -> None:
        async with httpx.AsyncClient(trust_env=False) as http:
            await engine_calls.post_all(
                http, window(url, *engines), path="/update_weights_from_tensor", body=lambda _: GROUP, stats=stats
            )

    asyncio.run(call())
    return stats


def test_an_answered_push_is_read_as_the_protocols_response(url: str) -> None:
    stats = post_tensor(url, "stages", "stages")
    assert stats.calls == 2 and stats.engine_timings == [{"stage": 0.5}, {"stage": 0.5}]


def test_a_refusal_that_names_itself_is_carried_by_the_publish_error(url: str) -> None:
    with pytest.raises(PublishError, match="full: this engine cannot stage") as refused:
        post_tensor(url, "stages", "full")
    assert refused.value.refusal is Refusal.CANNOT_STAGE


def test_an_answer_that_is_no_answer_of_the_api_names_the_engine(url: str) -> None:
    with pytest.raises(PublishError, match=r"proxy at http://127\.0\.0\.1:\d+/proxy answered 502") as refused:
        post_tensor(url, "proxy")
    assert refused.value.refusal is None


def test_the_controller_refusing_or_garbling_a_window_is_a_publish_error(url: str) -> None:
    async def open_at(base: str) -> None:
        await HttpWindows(base, admin_token=None).open(model_name=None, ttl_s=10.0, staged=True)

    with pytest.raises(PublishError, match="the controller refused /update_weights/start: .* needs the admin token"):
        asyncio.run(open_at(f"{url}/controller"))
    with pytest.raises(PublishError, match=r"the controller at http://127\.0\.0\.1:\d+/proxy answered .* 502"):
        asyncio.run(open_at(f"{url}/proxy"))


class Scripted:
    """A WindowClient of a test's own (every call refused)."""

    async def open(self, *, model_name: str | None, ttl_s: float, staged: bool) -> UpdateWindow:
        raise PublishError("scripted")

    async def renew(self, window: UpdateWindow) -> None:
        raise PublishError("scripted")

    async def publish(self, event: InferenceEngineWeightChecksumEvent) -> None:
        raise PublishError("scripted")

    async def end(self, window: UpdateWindow, *, checksum: str, step: int, weight_version: str) -> UpdateResult:
        raise PublishError("scripted")

    async def abort(self, window: UpdateWindow, *, reason: str) -> None:
        raise PublishError("scripted")


def test_each_kind_of_controller_gets_its_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_ADMIN_TOKEN", "a" * 32)
    over_http = window_client("http://127.0.0.1:1/")
    assert isinstance(over_http, HttpWindows) and over_http.url == "http://127.0.0.1:1"
    ready = Scripted()
    assert window_client(ready) is ready
    with pytest.raises(TypeError, match="cannot push through a dict"):
        window_client({})

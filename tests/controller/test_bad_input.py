"""Hostile and absurd input to every controller endpoint: a 4xx that says what was wrong, never a
5xx, a hang or a wedge; and the fleet serves exactly as before afterwards."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import pytest_asyncio

from miles.errors import InvalidRequestError
from miles.protocol.sglang import PauseMode
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.rollout.sft_rollout import SFTRollout
from miles.rollout.state import ServerState
from miles.testing import running_controller, wait_until
from miles.utils.audit_utils.event_logger.models import WeightUpdateStartedEvent

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = {"text": "hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


class PauseFaults(SFTRollout):
    """Fault at the edge: while ``fail`` is set, pausing a server raises an unexpected error."""

    fail: ClassVar[bool] = False

    async def pause(self, server_id: str, mode: PauseMode) -> int:
        if PauseFaults.fail:
            raise RuntimeError("injected: the pause call blew up")
        return await super().pause(server_id, mode)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(checkpoints: dict[str, Path]) -> AsyncIterator[tuple[AsyncInferenceController, httpx.AsyncClient]]:
    async with running_controller(
        PauseFaults, checkpoints["v1"], num_servers=1, request_timeout_s=120, max_request_mib=MAX_REQUEST_MIB
    ) as (
        controller,
        url,
    ):
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            yield controller, http


def raw(text: str) -> bytes:
    return text.encode()


BIG = 2**70
MAX_REQUEST_MIB = 1
OVERSIZED = b'{"text": "' + b"x" * (MAX_REQUEST_MIB << 20) + b'"}'
PUBLISHED_EVENT = {"type": "inference_engine_weight_checksum", "model_name": "tiny", "checksum": "c" * 32, "step": 7}
EDGE_CASES: list[tuple[str, str, bytes | None, int]] = [
    # (method, path, body, expected status) -- bodies are bytes so that JSON's edges (NaN,
    # Infinity, bad UTF-8, deep nesting) reach the server exactly as an attacker would send them.
    ("POST", "/generate", b"", 400),
    ("POST", "/generate", b"null", 400),
    ("POST", "/generate", b"[1, 2]", 400),
    ("POST", "/generate", b"\xff\xfe\x00", 400),
    ("POST", "/generate", b"[" * 100_000, 400),
    ("POST", "/generate", raw('{"text": "x", "sampling_params": {"temperature": Infinity}}'), 400),
    ("POST", "/generate", raw('{"text": "x", "sampling_params": {"temperature": NaN}}'), 400),
    ("POST", "/generate", raw('{"text": "x", "sampling_params": {"top_p": -Infinity}}'), 400),
    ("POST", "/generate", json.dumps({"text": "x", "sampling_params": {"sampling_seed": BIG}}).encode(), 400),
    ("POST", "/generate", json.dumps({"text": "x", "sampling_params": {"sampling_seed": -BIG}}).encode(), 400),
    ("POST", "/generate", json.dumps({"text": "x", "sampling_params": {"max_new_tokens": BIG}}).encode(), 400),
    (
        "POST",
        "/generate",
        json.dumps(
            {"text": "x", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 2, "stop_token_ids": [10**9]}}
        ).encode(),
        400,
    ),
    ("POST", "/generate", json.dumps({"text": "x", "sampling_params": {"stop_token_ids": [-1]}}).encode(), 400),
    ("POST", "/generate", json.dumps({"input_ids": [[]]}).encode(), 400),
    ("POST", "/generate", json.dumps({"input_ids": [10**9]}).encode(), 400),
    ("POST", "/generate", json.dumps({"text": "x" * 200_000}).encode(), 400),
    # Bodies larger than the controller reads (MILES_MAX_REQUEST_MIB), on every kind of route.
    ("POST", "/generate", OVERSIZED, 413),
    ("POST", "/v1/chat/completions", OVERSIZED, 413),
    ("POST", "/update_weights", OVERSIZED, 413),
    ("POST", "/events", OVERSIZED, 413),
    ("PATCH", "/config", OVERSIZED, 413),
    ("POST", "/generate", json.dumps({"text": "x", "model": 123}).encode(), 404),
    ("POST", "/generate", json.dumps({"text": "x", "min_weight_version": []}).encode(), 400),
    ("POST", "/generate", json.dumps({"text": "x", "min_weight_version": True}).encode(), 400),
    ("POST", "/generate", json.dumps({"text": "x", "sampling_params": {"n": 10**6}}).encode(), 400),
    ("POST", "/generate", json.dumps({"text": "x", "sampling_params": {"top_k": False}}).encode(), 400),
    ("POST", "/generate", json.dumps({"text": "x", "nonsense_field": 1}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "top_k": 0}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "top_k": -5}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "top_k": False}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "stop": ""}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "stop": [""]}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "seed": BIG}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": [[]]}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": []}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": True}).encode(), 400),
    ("POST", "/v1/completions", raw('{"prompt": "x", "temperature": Infinity}'), 400),
    ("POST", "/v1/chat/completions", json.dumps({"messages": []}).encode(), 400),
    (
        "POST",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "top_k": 0}).encode(),
        400,
    ),
    (
        "POST",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "seed": -BIG}).encode(),
        400,
    ),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
    ("POST", "/update_weights", json.dumps({"checkpoint": "/tmp/a\x00b"}).encode(), 400),
    ("POST", "/update_weights", json.dumps({"checkpoint": "/" + "x" * 5000}).encode(), 400),
    ("POST", "/update_weights", json.dumps({"checkpoint": "/tmp/" + "y" * 300}).encode(), 400),
    ("POST", "/update_weights", json.dumps({"checkpoint": ""}).encode(), 400),
    ("POST", "/update_weights", json.dumps({"checkpoint": 12}).encode(), 400),
    ("POST", "/update_weights", json.dumps({"checkpoint": "/nonexistent", "timeout_s": 1e12}).encode(), 400),
    ("POST", "/update_weights", raw('{"checkpoint": "/nonexistent", "timeout_s": Infinity}'), 400),
    ("POST", "/update_weights", json.dumps({"checkpoint": "/nonexistent", "weight_version": ""}).encode(), 400),
    ("POST", "/update_weights", json.dumps({"checkpoint": "/nonexistent", "strategy": "sideways"}).encode(), 400),
    ("POST", "/update_weights", json.dumps({"checkpoint": "/nonexistent"}).encode(), 409),
    ("POST", "/update_weights/start", json.dumps({"ttl_s": 1e12}).encode(), 400),
    ("POST", "/update_weights/start", json.dumps({"ttl_s": -1}).encode(), 400),
    ("POST", "/update_weights/start", raw('{"ttl_s": NaN}'), 400),
    ("POST", "/update_weights/start", json.dumps({"pause_mode": "vanish"}).encode(), 400),
    ("POST", "/update_weights/start", json.dumps({"model_name": "nope"}).encode(), 404),
    ("POST", "/update_weights/start", json.dumps({"ttl_s": "5"}).encode(), 400),
    ("POST", "/update_weights/start", json.dumps({"ttl_s": True}).encode(), 400),
    ("POST", "/update_weights/start", json.dumps({"staged": "yes"}).encode(), 400),
    ("POST", "/update_weights/start", json.dumps({"staged": 1}).encode(), 400),
    ("POST", "/update_weights/end", json.dumps({"token": "1", "checksum": "c", "step": 1}).encode(), 400),
    ("POST", "/update_weights/end", json.dumps({"token": True, "checksum": "c", "step": 1}).encode(), 400),
    ("POST", "/update_weights/end", json.dumps({"token": 1, "checksum": "", "step": 1}).encode(), 400),
    ("POST", "/update_weights/end", json.dumps({"token": 1, "checksum": "c", "step": -1}).encode(), 400),
    ("POST", "/update_weights/end", json.dumps({"token": 1, "checksum": "c", "step": BIG}).encode(), 400),
    ("POST", "/update_weights/end", json.dumps({"token": 10**6, "checksum": "c", "step": 1}).encode(), 409),
    ("POST", "/update_weights/abort", json.dumps({"token": BIG}).encode(), 409),
    ("POST", "/update_weights/abort", json.dumps({"token": None}).encode(), 400),
    ("POST", "/update_weights/renew", json.dumps({"token": BIG}).encode(), 409),
    ("POST", "/update_weights/renew", json.dumps({"token": "1"}).encode(), 400),
    ("POST", "/update_weights/renew", json.dumps({"token": 1, "ttl_s": -1}).encode(), 400),
    ("POST", "/update_weights/renew", json.dumps({"token": 1, "ttl_s": "5"}).encode(), 400),
    ("POST", "/update_weights/renew", json.dumps({"token": 1, "ttl_s": 1e300}).encode(), 400),
    ("POST", "/events", b"{}", 400),
    (
        "POST",
        "/events",
        json.dumps(
            {"type": "inference_engine_weight_checksum", "model_name": "tiny", "checksum": "", "step": 1}
        ).encode(),
        400,
    ),
    (
        "POST",
        "/events",
        json.dumps(
            {"type": "inference_engine_weight_checksum", "model_name": "tiny", "checksum": "c", "step": -1}
        ).encode(),
        400,
    ),
    ("POST", "/events", b"\xff", 400),
    ("GET", "/events?type=bogus", None, 400),
    ("GET", "/events?limit=0", None, 400),
    ("GET", "/events?limit=abc", None, 400),
    ("PATCH", "/config", raw('{"request_timeout_s": Infinity}'), 400),
    ("PATCH", "/config", raw('{"health_interval_s": Infinity}'), 400),
    ("PATCH", "/config", raw('{"lease_ttl_s": NaN}'), 400),
    ("PATCH", "/config", json.dumps({"health_interval_s": 1e-9}).encode(), 400),
    ("PATCH", "/config", json.dumps({"request_timeout_s": 1e-9}).encode(), 400),
    ("PATCH", "/config", json.dumps({"lock_timeout_s": 1e12}).encode(), 400),
    ("PATCH", "/config", json.dumps({"lease_ttl_s": 1e12}).encode(), 400),
    ("PATCH", "/config", json.dumps({"health_failure_threshold": 0}).encode(), 400),
    ("PATCH", "/config", json.dumps({"rolling_batch_size": 10**9}).encode(), 400),
    ("PATCH", "/config", json.dumps({"routing_policy": "random"}).encode(), 400),
    ("PATCH", "/config", json.dumps({"no_such_setting": 1}).encode(), 400),
    ("PATCH", "/config", json.dumps({"port": 1}).encode(), 409),
    ("PATCH", "/config", b"[]", 400),
    # A setting sent as another JSON type than its own is not coerced into it.
    ("PATCH", "/config", json.dumps({"max_waiting_requests": True}).encode(), 400),
    ("PATCH", "/config", json.dumps({"max_waiting_requests": "5"}).encode(), 400),
    ("PATCH", "/config", json.dumps({"require_published_checksum": "yes"}).encode(), 400),
    ("PATCH", "/config", json.dumps({"health_interval_s": "1"}).encode(), 400),
    # A version to wait for is a version label: refused at once, not waited on until the timeout.
    ("POST", "/generate", json.dumps({"text": "x", "min_weight_version": ""}).encode(), 400),
    ("POST", "/generate", json.dumps({"text": "x", "min_weight_version": "10\nFAKE"}).encode(), 400),
    ("POST", "/generate", json.dumps({"text": "x", "min_weight_version": "9" * 300}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "min_weight_version": "v" * 200_000}).encode(), 400),
    # ... and one no server could ever reach is refused at once too: a label that is no integer,
    # while the fleet serves integer versions, only matches itself.
    ("POST", "/generate", json.dumps({"text": "x", "min_weight_version": "abc"}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "min_weight_version": "rc-2"}).encode(), 400),
    # A reason is logged as one line.
    ("POST", "/update_weights/abort", json.dumps({"token": 1, "reason": "a\nFAKE LOG LINE"}).encode(), 400),
    # A posted checksum is training's, for a served model, in JSON's own types, stamped near now.
    *(
        ("POST", "/events", json.dumps(event).encode(), status)
        for event, status in (
            ({**PUBLISHED_EVENT, "step": True}, 400),
            ({**PUBLISHED_EVENT, "step": "114"}, 400),
            ({**PUBLISHED_EVENT, "step": 115.0}, 400),
            ({**PUBLISHED_EVENT, "model_name": "ghost"}, 404),
            ({**PUBLISHED_EVENT, "server_id": "tiny-0"}, 400),
            ({**PUBLISHED_EVENT, "event_id": "a\nb"}, 400),
            ({**PUBLISHED_EVENT, "event_id": "e" * 200}, 400),
            ({**PUBLISHED_EVENT, "timestamp": "0001-01-01T00:00:00Z"}, 400),
            ({**PUBLISHED_EVENT, "timestamp": "9999-12-31T00:00:00Z"}, 400),
            ({**PUBLISHED_EVENT, "source": {"component": "controller\nFAKE", "id": "vm:1"}}, 400),
        )
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"), EDGE_CASES, ids=[f"{m} {p} {i}" for i, (m, p, _, _) in enumerate(EDGE_CASES)]
)
async def test_edge_values_get_a_clear_4xx(fleet, method: str, path: str, body: bytes | None, status: int) -> None:
    controller, http = fleet
    before = controller.settings
    response = await http.request(method, path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text[:500]
    message = response.json()
    text = json.dumps(message)
    assert "error" in message or "message" in message, text[:300]
    assert len(text) < 20_000  # an error names the problem; it does not echo a huge input back
    assert controller.settings == before
    assert controller.health().lock.held is False


async def test_an_event_id_is_logged_once(fleet) -> None:
    controller, http = fleet
    event = {**PUBLISHED_EVENT, "event_id": "trainer-step-7", "step": 7}
    assert (await http.post("/events", json=event)).status_code == 200
    again = await http.post("/events", json={**event, "checksum": "d" * 32})
    assert again.status_code == 409 and "already logged" in again.text
    assert [e.checksum for e in controller.event_logger.events if e.event_id == "trainer-step-7"] == ["c" * 32]


async def test_a_stream_asked_for_as_the_engine_reads_it_is_relayed_as_a_stream(fleet) -> None:
    _, http = fleet
    for value in ("true", 1):
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "stream": value, "model": "tiny"}
        async with http.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"


async def test_an_oversized_body_announced_with_expect_100_continue_is_refused_unread(fleet) -> None:
    """The client waits to be told to send: it is told 413, never 100 Continue."""
    _, http = fleet
    reader, writer = await asyncio.open_connection(http.base_url.host, http.base_url.port)
    try:
        writer.write(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\nExpect: 100-continue\r\n\r\n"
        )
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout=10)
    finally:
        writer.close()
    assert status_line.split()[1] == b"413", status_line


async def test_a_chunked_body_is_refused_once_it_passes_the_limit(fleet) -> None:
    _, http = fleet

    async def chunks() -> AsyncIterator[bytes]:
        # No Content-Length: the controller counts what arrives.
        yield b'{"text": "'
        for _ in range(4 * MAX_REQUEST_MIB):
            yield b"x" * (1 << 20)

    response = await http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text[:300]
    assert "MILES_MAX_REQUEST_MIB" in response.json()["error"]["message"]


async def test_the_fleet_serves_as_before_after_the_hostile_input(fleet) -> None:
    controller, http = fleet
    answer = await http.post("/generate", json=GREEDY)
    assert answer.status_code == 200
    report = controller.health()
    assert report.ok and report.status == "ok"
    assert [s.state for s in report.servers] == ["serving"]


async def test_a_window_that_fails_after_touching_the_fleet_puts_it_back(fleet) -> None:
    controller, http = fleet
    reference = (await http.post("/generate", json=GREEDY)).json()["output_ids"]
    PauseFaults.fail = True
    try:
        failed = await http.post("/update_weights/start", json={})
    finally:
        PauseFaults.fail = False
    assert failed.status_code == 500  # a bug in a server type, reported as such, in the API's shape
    assert "internal error" in failed.json()["error"]["message"]
    report = controller.health()
    assert report.lock.held is False
    assert report.models["tiny"].accepting_requests is True
    assert [s.state for s in report.servers] == ["serving"]
    answer = await asyncio.wait_for(http.post("/generate", json=GREEDY), timeout=30)
    assert answer.json()["output_ids"] == reference


async def test_a_checkpoint_a_server_could_not_restart_from_is_refused(
    fleet, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Weights that verify, next to a config no engine can start from (or one of another model):
    loading them would make the checkpoint the servers' restart point, so the update is refused."""
    controller, http = fleet
    reference = (await http.post("/generate", json=GREEDY)).json()["output_ids"]
    before = controller.health()
    broken = {
        "garbage": ("{not json", "config.json that is not JSON"),
        "narrower": (
            json.dumps({**json.loads((checkpoints["v2"] / "config.json").read_text()), "hidden_size": 8}),
            "hidden_size is 8 there",
        ),
    }
    for name, (config, says) in broken.items():
        checkpoint = tmp_path / name
        shutil.copytree(checkpoints["v2"], checkpoint)
        (checkpoint / "config.json").write_text(config)
        answer = await http.post("/update_weights", json={"checkpoint": str(checkpoint), "weight_version": "900"})
        assert answer.status_code == 409
        assert answer.json()["status"] == "rejected"
        assert says in answer.json()["message"]
    after = controller.health()
    assert [(s.state, s.weight_version, s.verified_checkpoint) for s in after.servers] == [
        (s.state, s.weight_version, s.verified_checkpoint) for s in before.servers
    ]
    assert (await http.post("/generate", json=GREEDY)).json()["output_ids"] == reference


async def test_an_absurd_ttl_is_refused_before_anything_is_touched(fleet) -> None:
    controller, _ = fleet
    mark = len(controller.event_logger.events)
    for ttl in (1e12, float("inf"), float("nan"), 0.0, -5.0):
        with pytest.raises(InvalidRequestError, match="ttl_s"):
            await controller.start_update_weights(ttl_s=ttl)
    assert not any(isinstance(e, WeightUpdateStartedEvent) for e in list(controller.event_logger.events)[mark:])
    report = controller.health()
    assert report.lock.held is False and report.models["tiny"].accepting_requests is True
    assert controller.fleet.rollout(None).cell("tiny-0").state is ServerState.SERVING


async def test_a_shorter_health_interval_takes_effect_at_once(fleet, supervisor_rounds) -> None:
    import os
    import signal

    controller, http = fleet
    rollout = controller.fleet.rollout(None)
    assert (await http.patch("/config", json={"health_interval_s": 3600})).status_code == 200
    await supervisor_rounds(rollout, 1)  # after this round the supervisor sleeps for an hour
    assert (await http.patch("/config", json={"health_interval_s": 0.2})).status_code == 200
    cell = controller.fleet.rollout(None).cell("tiny-0")
    restarts = cell.restarts
    assert cell.pid is not None
    os.kill(cell.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (cell.restarts > restarts and cell.state is ServerState.SERVING):
        assert time.monotonic() < deadline, "the killed server was not noticed: the old interval still applies"
        await asyncio.sleep(0.05)


async def test_a_waiting_stream_ends_when_its_client_leaves(fleet) -> None:
    controller, http = fleet
    router = controller.router
    assert router is not None
    body = {**GREEDY, "stream": True, "min_weight_version": "999999"}

    async def open_and_leave() -> None:
        async with http.stream("POST", "/generate", json=body) as response:
            await response.aread()

    client = asyncio.create_task(open_and_leave())
    deadline = time.monotonic() + 10
    while router.waiting() < 1:
        assert time.monotonic() < deadline, "the request never waited"
        await asyncio.sleep(0.02)
    client.cancel()  # the client goes away
    await asyncio.gather(client, return_exceptions=True)
    deadline = time.monotonic() + 10
    while router.waiting() > 0:
        assert time.monotonic() < deadline, "the request kept waiting for a client that left"
        await asyncio.sleep(0.05)


async def test_requests_waiting_for_a_server_end_at_shutdown(checkpoints: dict[str, Path]) -> None:
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=1, request_timeout_s=600) as (
        controller,
        url,
    ):
        async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as http:
            body: dict[str, Any] = {**GREEDY, "min_weight_version": "999999"}
            waiting = [
                asyncio.create_task(http.post("/generate", json=body)),
                asyncio.create_task(http.post("/generate", json={**body, "stream": True})),
            ]
            router = controller.router
            assert router is not None
            await wait_until(lambda: router.waiting() >= 2, what="both requests to wait for a server")
            started = time.monotonic()
            controller.stop_routing()
            answers = await asyncio.wait_for(asyncio.gather(*waiting), timeout=30)
    assert time.monotonic() - started < 10
    assert [a.status_code for a in answers] == [503, 503]
    assert "shutting down" in answers[0].json()["error"]["message"]

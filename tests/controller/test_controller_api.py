"""The controller's HTTP API over a real fleet: routing, health, events, config, windows, errors."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.testing import running_controller, wait_until
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(checkpoints: dict[str, Path]) -> AsyncIterator[tuple[AsyncInferenceController, httpx.AsyncClient]]:
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (controller, url):
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            yield controller, http


def greedy(prompt: str = "hi", **extra: object) -> dict[str, object]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **extra}


async def test_health_reports_servers_lock_and_versions(fleet) -> None:
    _, http = fleet
    response = await http.get("/health")
    assert response.status_code == 200
    report = response.json()
    assert report["status"] == "ok" and report["ok"] is True
    assert report["models"]["tiny"]["serving"] == 2
    assert {s["server_id"] for s in report["servers"]} == {"tiny-0", "tiny-1"}
    for server in report["servers"]:
        assert server["state"] == "serving"
        assert server["checksum"] and server["weight_version"]
        assert server["url"].startswith("http://127.0.0.1:")
    assert report["lock"] == {
        "name": "InferenceController",
        "held": False,
        "holder": None,
        "held_since": None,
        "held_for_s": None,
        "token": None,
        "waiters": 0,
        "detached": False,
        "lease_expires_at": None,
    }


async def test_generate_and_openai_routes_spread_over_servers(fleet) -> None:
    _, http = fleet
    answers = await asyncio.gather(*(http.post("/generate", json=greedy()) for _ in range(8)))
    assert all(a.status_code == 200 for a in answers)
    assert {a.headers["x-miles-server"] for a in answers} == {"tiny-0", "tiny-1"}
    assert len({tuple(a.json()["output_ids"]) for a in answers}) == 1
    completion = await http.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}
    )
    assert completion.status_code == 200
    assert completion.json()["choices"][0]["text"] == answers[0].json()["text"]
    chat = await http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    )
    assert chat.status_code == 200
    models = (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


async def test_sessions_stick_to_one_server(fleet) -> None:
    _, http = fleet
    servers = set()
    for _ in range(6):
        answer = await http.post("/generate", json=greedy(session_id="conversation-7"))
        servers.add(answer.headers["x-miles-server"])
    assert len(servers) == 1


async def test_streaming_through_the_controller(fleet) -> None:
    _, http = fleet
    async with http.stream("POST", "/generate", json=greedy(stream=True)) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) == 5


PUBLISHED = {"type": "inference_engine_weight_checksum", "model_name": "tiny", "checksum": "c" * 32, "step": 1}


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/generate", {"text": "x", "bogus": 1}, 400, "unknown field 'bogus'"),
        ("/generate", {"text": "x", "model": "nope"}, 404, "no model 'nope'"),
        ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/update_weights", {"checkpoint": "/nonexistent"}, 409, "not a directory"),
        ("/update_weights", {"checkpoint": "/x", "strategy": "sideways"}, 400, "strategy"),
        ("/update_weights", {"checkpoint": "/x", "weight_version": "7\nforged"}, 400, "weight_version"),
        ("/update_weights/end", {"token": 999, "checksum": "c", "step": 1}, 409, "token"),
        ("/events", {"type": "nope"}, 400, "not a valid event"),
        (
            "/events",
            {"type": "lock_acquired", "lock_name": "x", "holder": "y", "token": 1, "waited_s": 0},
            400,
            "a lock_acquired event cannot be",
        ),
        ("/events", {**PUBLISHED, "role": "confirmed", "server_id": "tiny-0"}, 400, "role 'confirmed' cannot be"),
        ("/events", {**PUBLISHED, "checksum": "a\nb"}, 400, "checksum: String should match pattern"),
        ("/events", {**PUBLISHED, "model_name": "m" * 257}, 400, "model_name: String should have at most 256"),
        ("/events", {**PUBLISHED, "step": 2**63}, 400, "step: Input should be less than"),
    ],
)
async def test_bad_requests_get_a_clear_error(fleet, path: str, body: dict, status: int, needle: str) -> None:
    _, http = fleet
    response = await http.post(path, json=body)
    assert response.status_code == status, response.text
    text = response.text
    assert needle in text, text


async def test_min_weight_version_waits_for_the_update(fleet, checkpoints: dict[str, Path]) -> None:
    controller, http = fleet
    current = int(controller.health().models["tiny"].weight_version)
    target = str(current + 1)
    waiting = asyncio.create_task(http.post("/generate", json=greedy(min_weight_version=target)))
    router = controller.router
    assert router is not None
    await wait_until(lambda: router.waiting() >= 1, what="the request to wait for the version")
    assert not waiting.done()
    update = await http.post("/update_weights", json={"checkpoint": str(checkpoints["v2"]), "weight_version": target})
    assert update.status_code == 200, update.text
    answer = await waiting
    assert answer.status_code == 200
    assert answer.json()["meta_info"]["weight_version"] == target


async def test_a_checksum_published_over_http_gates_updates(fleet, checkpoints: dict[str, Path]) -> None:
    controller, http = fleet
    v3 = read_manifest(checkpoints["v3"])
    wrong = {"type": "inference_engine_weight_checksum", "model_name": "tiny", "checksum": "0" * 32, "step": v3.step}
    assert (await http.post("/events", json=wrong)).status_code == 200
    refused = await http.post("/update_weights", json={"checkpoint": str(checkpoints["v3"]), "weight_version": "100"})
    assert refused.status_code == 409
    assert refused.json()["status"] == "rejected"
    assert "checksum mismatch" in refused.json()["message"]
    right = {**wrong, "checksum": v3.checksum}
    assert (await http.post("/events", json=right)).status_code == 200
    accepted = await http.post("/update_weights", json={"checkpoint": str(checkpoints["v3"]), "weight_version": "100"})
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["checksum_source"] == "published"
    events = (await http.get("/events", params={"type": "weight_update_committed"})).json()["events"]
    assert events[-1]["weight_version"] == "100"


async def test_a_training_window_over_http(fleet, checkpoints: dict[str, Path]) -> None:
    controller, http = fleet
    v4 = read_manifest(checkpoints["v4"])
    window = (await http.post("/update_weights/start", json={"ttl_s": 30})).json()
    assert {s["server_id"] for s in window["servers"]} == {"tiny-0", "tiny-1"}
    async with httpx.AsyncClient(timeout=60, trust_env=False) as direct:
        for server in window["servers"]:
            pushed = await direct.post(
                f"{server['url']}/update_weights_from_disk",
                json={"model_path": str(checkpoints["v4"])},
                headers={"authorization": f"Bearer {window['credential']}"},
            )
            assert pushed.json()["success"] is True
    ended = await http.post(
        "/update_weights/end",
        json={"token": window["token"], "checksum": v4.checksum, "step": 101, "checkpoint": str(checkpoints["v4"])},
    )
    assert ended.status_code == 200, ended.text
    assert {s["weight_version"] for s in ended.json()["servers"]} == {"101"}
    again = await http.post("/update_weights/abort", json={"token": window["token"]})
    assert again.status_code == 409


async def test_a_window_whose_caller_left_while_it_waited_never_opens(fleet) -> None:
    """A caller that gives up on /update_weights/start while another window holds the lock gets no
    window: one opened for it would hold the fleet out of serving for its whole lease."""
    controller, http = fleet
    first = (await http.post("/update_weights/start", json={"ttl_s": 30})).json()
    with pytest.raises(httpx.ReadTimeout):
        await http.post("/update_weights/start", json={"ttl_s": 600}, timeout=1.0)
    await wait_until(lambda: controller.health().lock.waiters == 0, what="the abandoned start left the queue")
    ended = await http.post("/update_weights/abort", json={"token": first["token"]})
    assert ended.status_code == 200, ended.text
    await wait_until(lambda: not controller.health().lock.held, what="the lock free")
    health = (await http.get("/health")).json()
    assert all(s["state"] == "serving" for s in health["servers"]), health
    assert (await http.post("/generate", json=greedy())).status_code == 200
    # The next caller gets a window at once, with a newer token.
    second = (await http.post("/update_weights/start", json={"ttl_s": 30})).json()
    assert second["token"] > first["token"]
    assert (await http.post("/update_weights/abort", json={"token": second["token"]})).status_code == 200


async def test_a_window_lives_while_training_renews_its_lease_and_not_longer(fleet) -> None:
    controller, http = fleet
    window = (await http.post("/update_weights/start", json={"ttl_s": 1.0})).json()
    assert window["ttl_s"] == 1.0
    # Renewed every 0.3 s for three leases' worth: the window stays open, its expiry moves on.
    expiries = []
    for _ in range(10):
        renewed = await http.post("/update_weights/renew", json={"token": window["token"]})
        assert renewed.status_code == 200, renewed.text
        expiries.append(renewed.json()["expires_at"])
        await asyncio.sleep(0.3)
    assert controller.health().lock.held
    assert expiries == sorted(expiries) and len(set(expiries)) == len(expiries)
    # A renewal may set another lease; a bad one changes nothing.
    assert (await http.post("/update_weights/renew", json={"token": window["token"], "ttl_s": 0})).status_code == 400
    assert (await http.post("/update_weights/renew", json={"token": window["token"], "ttl_s": 0.5})).status_code == 200
    # Once training stops renewing, the window expires within its lease, and cannot be renewed.
    await wait_until(lambda: not controller.health().lock.held, what="the unrenewed window to expire", timeout=5)
    late = await http.post("/update_weights/renew", json={"token": window["token"]})
    assert late.status_code == 409, late.text
    health = (await http.get("/health")).json()
    assert all(s["state"] == "serving" for s in health["servers"]), health


async def test_config_changes_what_may_change_and_refuses_the_rest(fleet) -> None:
    controller, http = fleet
    view = (await http.get("/config")).json()
    assert "rolling_batch_size" in view["runtime_changeable"]
    assert "port" in view["fixed"]
    changed = await http.patch("/config", json={"rolling_batch_size": 2, "health_interval_s": 0.3})
    assert changed.status_code == 200
    assert controller.settings.rolling_batch_size == 2
    assert controller.fleet.rollout(None).spec.health.interval_s == 0.3
    refused = await http.patch("/config", json={"port": 1, "rolling_batch_size": 3})
    assert refused.status_code == 409
    assert "port" in refused.json()["error"]["message"]
    assert controller.settings.rolling_batch_size == 2  # nothing applied
    invalid = await http.patch("/config", json={"rolling_batch_size": 0})
    assert invalid.status_code == 400


async def test_metrics_count_requests_and_updates(fleet) -> None:
    _, http = fleet
    text = (await http.get("/metrics")).text
    assert re.search(r'miles_requests_total\{model="tiny",outcome="ok",server="tiny-[01]"\} [1-9]', text)
    assert 'miles_updates_total{model="tiny",path="disk",status="committed",strategy="barrier"}' in text
    assert 'miles_servers{model="tiny",state="serving"} 2.0' in text


async def test_a_server_dying_under_load_costs_no_request(fleet) -> None:
    import os
    import signal
    import time

    controller, http = fleet
    server = controller.fleet.rollout(None)
    restarts = server.cell("tiny-1").restarts
    stop = asyncio.Event()
    answers: list[int] = []

    async def user() -> None:
        while not stop.is_set():
            answers.append((await http.post("/generate", json=greedy())).status_code)

    users = [asyncio.create_task(user()) for _ in range(4)]
    await wait_until(lambda: len(answers) >= 8, what="traffic before the crash")
    os.kill(server.cell("tiny-1").pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not (server.cell("tiny-1").restarts > restarts and server.cell("tiny-1").state.value == "serving"):
        assert time.monotonic() < deadline, "the killed server never came back"
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.gather(*users)
    assert answers and set(answers) == {200}
    assert controller.health().ok


async def test_a_server_whose_queue_is_full_hands_its_requests_to_another(checkpoints: dict[str, Path]) -> None:
    spec = {"tiny": {"checkpoint": checkpoints["v1"], "num_servers": 2, "engine_args": ("--max-queued-requests", "1")}}
    async with (
        running_controller(spec) as (controller, url),
        httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http,
    ):
        full, other = controller.health().servers
        assert full.url is not None
        control = {"authorization": f"Bearer {controller.engine_secret}"}
        # Fill one server's queue: paused, it queues one sequence and answers 429 to the next.
        assert (await http.post(f"{full.url}/pause_generation", json={"mode": "in_place"}, headers=control)).is_success
        held = asyncio.create_task(http.post(f"{full.url}/generate", json=greedy()))
        try:
            await asyncio.wait_for(_queued(http, full.url, 1), timeout=60)
            refused = await http.post(f"{full.url}/generate", json=greedy())
            assert refused.status_code == 429 and refused.headers["retry-after"] == "0", refused.text
            assert refused.json()["error"]["type"] == "rate_limit_error"
            # Routed requests alternate between equal servers: those sent to the full one are
            # handed to the other instead of coming back refused.
            answers = [await http.post("/generate", json=greedy()) for _ in range(4)]
            assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
            assert {a.headers["x-miles-server"] for a in answers} == {other.server_id}
        finally:
            await http.post(f"{full.url}/continue_generation", json={}, headers=control)
            answer = await held
        assert answer.status_code == 200


async def test_the_controller_bounds_the_requests_and_bytes_it_holds(checkpoints: dict[str, Path]) -> None:
    """Requests that must wait (here: for a version not served yet) wait up to a count, and the
    bodies held while routing up to a byte budget; one more is refused with 429, nothing held is
    lost, and requests that need not wait still pass."""
    async with (
        running_controller(model_checkpoint=checkpoints["v1"], num_servers=1) as (controller, url),
        httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http,
    ):
        router = controller.router
        assert router is not None
        target = str(int(controller.health().models["tiny"].weight_version) + 1)
        changed = await http.patch("/config", json={"max_waiting_requests": 2, "max_held_request_mib": 1})
        assert changed.status_code == 200, changed.text
        # JSON allows whitespace after the object: bodies of 0.6 MiB whose prompt is two letters.
        padded = (json.dumps(greedy(min_weight_version=target)) + " " * 600_000).encode()
        first = asyncio.create_task(http.post("/generate", content=padded))
        await wait_until(lambda: router.waiting() == 1, what="the first request to wait")
        over_budget = await http.post("/generate", content=padded)
        assert over_budget.status_code == 429, over_budget.text
        assert over_budget.headers["retry-after"] == "1"
        assert over_budget.json()["error"]["type"] == "rate_limit_error"
        assert "MILES_MAX_HELD_REQUEST_MIB" in over_budget.text
        second = asyncio.create_task(http.post("/generate", json=greedy(min_weight_version=target)))
        await wait_until(lambda: router.waiting() == 2, what="the second request to wait")
        too_many = await http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "min_weight_version": target}
        )
        assert too_many.status_code == 429, too_many.text
        assert "MILES_MAX_WAITING_REQUESTS" in too_many.text
        # A request that needs no waiting, and fits the budget, is served meanwhile.
        assert (await http.post("/generate", json=greedy())).status_code == 200
        update = await http.post(
            "/update_weights", json={"checkpoint": str(checkpoints["v2"]), "weight_version": target}
        )
        assert update.status_code == 200, update.text
        for held in (await first, await second):
            assert held.status_code == 200, held.text
            assert held.json()["meta_info"]["weight_version"] == target
        assert router.waiting() == 0
        busy = (await http.get("/metrics")).text
        assert re.search(r'miles_requests_total\{model="tiny",outcome="busy",server=""\} 1\.0', busy), busy


async def _queued(http: httpx.AsyncClient, url: str, count: int) -> None:
    """Return once the engine at ``url`` has ``count`` sequences waiting."""
    # The engine's queue is state it reports, not an event it sends: polled.
    while (await http.get(f"{url}/get_server_info")).json()["internal_states"][0]["waiting_requests"] != count:  # noqa: ASYNC110
        await asyncio.sleep(0.02)

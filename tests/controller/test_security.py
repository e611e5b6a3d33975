"""Who may change the weights: the admin token, the API key, the engines' secret, window
credentials, checkpoint roots that bind every file, and a bind that refuses to go off loopback
unguarded. Every refusal is a 401/403 with a message and changes nothing."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from miles.errors import MilesError
from miles.http.runner import HttpServer
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.testing import running_controller, wait_until
from miles.utils.audit_utils.event_logger.models import SettingsChangedEvent
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN = "admin-" + "a" * 32
KEY = "key-" + "k" * 32
GREEDY = {"text": "hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def roots(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An allowed root holding copies of v1..v3, and a directory outside it."""
    allowed = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    for name in ("v1", "v2", "v3"):
        shutil.copytree(checkpoints[name], allowed / name)
    shutil.copytree(checkpoints["v4"], outside / "v4")
    linked = shutil.copytree(checkpoints["v4"], allowed / "linked")
    (linked / "model.safetensors").unlink()
    os.symlink(outside / "v4" / "model.safetensors", linked / "model.safetensors")
    # v2's weights outside the roots, and inside them through a link.
    outside_v2 = shutil.copytree(checkpoints["v2"], outside / "v2")
    linked_v2 = shutil.copytree(checkpoints["v2"], allowed / "linked-v2")
    (linked_v2 / "model.safetensors").unlink()
    os.symlink(outside_v2 / "model.safetensors", linked_v2 / "model.safetensors")
    return {"allowed": allowed, "outside": outside, "linked": linked, "outside_v2": outside_v2, "linked_v2": linked_v2}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def guarded(roots: dict[str, Path]) -> AsyncIterator[tuple[AsyncInferenceController, httpx.AsyncClient]]:
    async with running_controller(
        model_checkpoint=roots["allowed"] / "v1",
        num_servers=1,
        admin_token=ADMIN,
        api_key=KEY,
        allowed_checkpoint_roots=(roots["allowed"],),
    ) as (controller, url):
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            yield controller, http


ADMIN_CALLS = [
    ("POST", "/update_weights", {"checkpoint": "/nonexistent"}),
    ("POST", "/update_weights/start", {}),
    ("POST", "/update_weights/end", {"token": 1, "checksum": "c", "step": 1}),
    ("POST", "/update_weights/renew", {"token": 1}),
    ("POST", "/update_weights/abort", {"token": 1}),
    (
        "POST",
        "/events",
        {"type": "inference_engine_weight_checksum", "model_name": "tiny", "checksum": "0" * 32, "step": 9},
    ),
    ("PATCH", "/config", {"require_published_checksum": True}),
]
READ_CALLS = [
    ("POST", "/generate", GREEDY),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/status", None),
    ("GET", "/events", None),
    ("GET", "/config", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
async def test_changing_endpoints_need_the_admin_token(guarded, method: str, path: str, body: dict) -> None:
    controller, http = guarded
    events, settings = len(controller.event_logger.events), controller.settings
    for headers, status in ((None, 401), (bearer("wrong-" + "w" * 30), 403), (bearer(KEY), 403)):
        refused = await http.request(method, path, json=body, headers=headers)
        assert refused.status_code == status, refused.text
        message = refused.json()["error"]["message"]
        assert "admin token" in message and path in message
    assert len(controller.event_logger.events) == events
    assert controller.settings == settings
    assert not controller.health().lock.held
    allowed = await http.request(method, path, json=body, headers=bearer(ADMIN))
    assert allowed.status_code not in (401, 403), allowed.text
    if path == "/update_weights/start":
        await http.post("/update_weights/abort", json={"token": allowed.json()["token"]}, headers=bearer(ADMIN))
    if path == "/config":
        await http.patch("/config", json={"require_published_checksum": False}, headers=bearer(ADMIN))


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
async def test_a_caller_without_the_token_is_refused_before_its_body_is_read(
    guarded, method: str, path: str, body: dict
) -> None:
    """Not JSON, or 8 MiB of it: the answer is about the credential, not about the body."""
    _, http = guarded
    for content in (b"{", json.dumps({"padding": "x" * (8 << 20)}).encode()):
        for headers, status in ((None, 401), (bearer("wrong-" + "w" * 30), 403)):
            refused = await http.request(
                method, path, content=content, headers={"content-type": "application/json", **(headers or {})}
            )
            assert refused.status_code == status, refused.text[:300]
            assert "admin token" in refused.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path", "body"), READ_CALLS)
async def test_inference_and_reads_need_the_api_key(guarded, method: str, path: str, body: dict | None) -> None:
    _, http = guarded
    assert (await http.request(method, path, json=body)).status_code == 401
    assert (await http.request(method, path, json=body, headers=bearer("nope-" + "n" * 30))).status_code == 403
    for token in (KEY, ADMIN):
        answer = await http.request(method, path, json=body, headers=bearer(token))
        assert answer.status_code == 200, answer.text


async def test_health_stays_open_and_no_secret_is_shown(guarded) -> None:
    controller, http = guarded
    assert (await http.get("/health")).status_code == 200
    # The status page itself holds no data (its script asks /status, with the key): it stays open.
    page = await http.get("/")
    assert page.status_code == 200 and "tiny-0" not in page.text
    config = (await http.get("/config", headers=bearer(KEY))).text
    assert ADMIN not in config and KEY not in config and controller.engine_secret not in config


async def test_nothing_but_the_controller_changes_an_engines_weights(
    guarded,
    roots: dict[str, Path],
    supervisor_rounds,
) -> None:
    controller, _ = guarded
    cell = controller.fleet.rollout(None).cell("tiny-0")
    before = (cell.weight_version, cell.checksum)
    async with httpx.AsyncClient(base_url=cell.url or "", timeout=60, trust_env=False) as engine:
        load = {"model_path": str(roots["allowed"] / "v2")}
        for path, body in (
            ("/update_weights_from_disk", load),
            ("/update_weight_version", {"new_version": "66"}),
            ("/pause_generation", {"mode": "abort"}),
            ("/abort_request", {"abort_all": True}),
        ):
            assert (await engine.post(path, json=body)).status_code == 401
            assert (await engine.post(path, json=body, headers=bearer(KEY))).status_code == 403
        # The engine guards inference too: the controller's API key is set, so no path around it.
        assert (await engine.post("/generate", json=GREEDY)).status_code == 401
        # Even the controller's own secret cannot load from outside the roots, nor through a link.
        secret = bearer(controller.engine_secret)
        outside = await engine.post(
            "/update_weights_from_disk", json={"model_path": str(roots["outside"] / "v4")}, headers=secret
        )
        assert outside.status_code == 403, outside.text
        linked = await engine.post(
            "/update_weights_from_disk", json={"model_path": str(roots["linked"])}, headers=secret
        )
        assert linked.status_code == 403 and "model.safetensors" in linked.text
    await supervisor_rounds(controller.fleet.rollout(None), 2)  # a drift would have been noticed
    assert (cell.weight_version, cell.checksum) == before
    assert cell.state.value == "serving"


async def test_the_gate_refuses_checkpoint_files_linked_from_outside_the_roots(guarded, roots: dict[str, Path]) -> None:
    _, http = guarded
    too_long = roots["allowed"].joinpath(*["é" * 120] * 30)  # longer in bytes than the system can open
    for target, why in [
        (roots["linked"], "outside the allowed checkpoint roots"),
        (roots["outside"] / "v4", "outside the allowed checkpoint roots"),
        (too_long, "cannot be listed"),
    ]:
        refused = await http.post("/update_weights", json={"checkpoint": str(target)}, headers=bearer(ADMIN))
        assert refused.status_code == 409, refused.text
        assert refused.json()["status"] == "rejected"
        assert why in refused.json()["message"]


async def test_a_window_credential_works_only_while_its_window_is_open(
    guarded,
    roots: dict[str, Path],
    supervisor_rounds,
) -> None:
    controller, http = guarded
    v2 = read_manifest(roots["allowed"] / "v2")
    window = (await http.post("/update_weights/start", json={"ttl_s": 30}, headers=bearer(ADMIN))).json()
    credential = bearer(window["credential"])
    url = window["servers"][0]["url"]
    load = {"model_path": str(roots["allowed"] / "v2"), "weight_version": "200"}
    async with httpx.AsyncClient(timeout=60, trust_env=False) as engine:
        pushed = await engine.post(f"{url}/update_weights_from_disk", json=load, headers=credential)
        assert pushed.status_code == 200 and pushed.json()["success"], pushed.text
        ended = await http.post(
            "/update_weights/end",
            json={"token": window["token"], "checksum": v2.checksum, "step": 200},
            headers=bearer(ADMIN),
        )
        assert ended.status_code == 200, ended.text
        # The window is over: its credential no longer changes anything.
        again = await engine.post(
            f"{url}/update_weights_from_disk",
            json={**load, "model_path": str(roots["allowed"] / "v3")},
            headers=credential,
        )
        assert again.status_code == 403, again.text
        # A window whose lease expired cannot push either.
        short = (await http.post("/update_weights/start", json={"ttl_s": 0.3}, headers=bearer(ADMIN))).json()
        await wait_until(lambda: not controller.health().lock.held, what="the lease to expire")
        late = await engine.post(
            f"{url}/update_weights_from_disk",
            json={**load, "model_path": str(roots["allowed"] / "v3")},
            headers=bearer(short["credential"]),
        )
        assert late.status_code == 403, late.text
    cell = controller.fleet.rollout(None).cell("tiny-0")
    await supervisor_rounds(controller.fleet.rollout(None), 2)
    assert (cell.weight_version, cell.checksum) == ("200", v2.checksum)


async def test_a_staged_window_credential_cannot_change_what_its_servers_serve(
    guarded, roots: dict[str, Path], supervisor_rounds
) -> None:
    """The servers of a staged window stay in routing: its credential may stage weights for the
    commit to activate, and nothing else; what clients get never changes before the commit."""
    controller, http = guarded
    headers = {**bearer(KEY)}
    before = (await http.post("/generate", json=GREEDY, headers=headers)).json()
    window = (
        await http.post("/update_weights/start", json={"ttl_s": 30, "staged": True}, headers=bearer(ADMIN))
    ).json()
    assert window["staged"] is True, window
    credential = bearer(window["credential"])
    url = window["servers"][0]["url"]
    async with httpx.AsyncClient(timeout=60, trust_env=False) as engine:
        for path, body in (
            ("/update_weights_from_disk", {"model_path": str(roots["allowed"] / "v2"), "weight_version": "200"}),
            ("/update_weight_version", {"new_version": "forged"}),
            ("/activate_weights", {"expected_checksum": "0" * 32, "weight_version": "forged"}),
        ):
            refused = await engine.post(f"{url}{path}", json=body, headers=credential)
            assert refused.status_code == 403 and "is staged" in refused.text, (path, refused.text)
    during = (await http.post("/generate", json=GREEDY, headers=headers)).json()
    assert (during["text"], during["meta_info"]["weight_version"]) == (
        before["text"],
        before["meta_info"]["weight_version"],
    )
    aborted = await http.post(
        "/update_weights/abort", json={"token": window["token"], "reason": "test"}, headers=bearer(ADMIN)
    )
    assert aborted.status_code == 200, aborted.text
    rollout = controller.fleet.rollout(None)
    await supervisor_rounds(rollout, 2)
    cell = rollout.cell("tiny-0")
    assert cell.state.value == "serving"
    after = (await http.post("/generate", json=GREEDY, headers=headers)).json()
    assert after["text"] == before["text"]


async def test_a_windows_checkpoint_outside_the_roots_is_refused_and_never_a_restart_point(
    guarded, roots: dict[str, Path]
) -> None:
    """A window's ``checkpoint`` becomes its servers' restart point: it is held to the roots as a
    disk update's checkpoint is (links resolved), refused with a 400 that leaves the window open."""
    controller, http = guarded
    v2 = read_manifest(roots["allowed"] / "v2")
    window = (await http.post("/update_weights/start", json={"ttl_s": 30}, headers=bearer(ADMIN))).json()
    url = window["servers"][0]["url"]
    async with httpx.AsyncClient(timeout=60, trust_env=False) as engine:
        load = {"model_path": str(roots["allowed"] / "v2"), "weight_version": "300"}
        pushed = await engine.post(f"{url}/update_weights_from_disk", json=load, headers=bearer(window["credential"]))
        assert pushed.status_code == 200 and pushed.json()["success"], pushed.text
    end = {"token": window["token"], "checksum": v2.checksum, "step": 300}
    # Inside the roots but longer in bytes than any path the system can open: refused as well.
    too_long = roots["allowed"].joinpath(*["é" * 120] * 30)
    for escaping, why in [
        (roots["outside_v2"], "outside the allowed checkpoint roots"),
        (roots["linked_v2"], "outside the allowed checkpoint roots"),
        (too_long, "cannot be listed"),
    ]:
        refused = await http.post(
            "/update_weights/end", json={**end, "checkpoint": str(escaping)}, headers=bearer(ADMIN)
        )
        assert refused.status_code == 400, refused.text
        assert why in refused.json()["error"]["message"]
        assert controller.health().lock.held  # the window is still open
    ended = await http.post("/update_weights/end", json=end, headers=bearer(ADMIN))
    assert ended.status_code == 200 and ended.json()["status"] == "committed", ended.text
    verified = controller.fleet.rollout(None).cell("tiny-0").verified
    assert verified is not None and verified.checksum == v2.checksum
    # Its restart point is none of them (the weights are written out by an engine instead).
    assert verified.checkpoint not in (roots["outside_v2"], roots["linked_v2"])


async def test_changing_a_safety_setting_is_logged(guarded) -> None:
    controller, http = guarded
    mark = len(controller.event_logger.events)
    for value in (True, False):
        changed = await http.patch("/config", json={"require_published_checksum": value}, headers=bearer(ADMIN))
        assert changed.status_code == 200
    events = [e for e in list(controller.event_logger.events)[mark:] if isinstance(e, SettingsChangedEvent)]
    assert [(e.after, e.safety) for e in events] == [
        ({"require_published_checksum": True}, True),
        ({"require_published_checksum": False}, True),
    ]


async def test_an_unguarded_controller_refuses_to_listen_off_loopback(checkpoints: dict[str, Path]) -> None:
    controller = AsyncInferenceController(model_checkpoint=checkpoints["v1"], host="0.0.0.0", port=0)
    try:
        with pytest.raises(MilesError, match="MILES_ADMIN_TOKEN"):
            HttpServer(controller)
    finally:
        await controller.close()

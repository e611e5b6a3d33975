"""Credentials and fencing on a real engine process started with MILES_ENGINE_SECRET and MILES_API_KEY."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.protocol.auth import window_credential
from miles.testing import running_engine
from miles.weights.checkpoint import read_manifest

SECRET = "engine-secret-for-tests"
KEY = "api-key-for-tests"


@pytest.fixture(scope="module")
def engine_url(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {"MILES_ENGINE_SECRET": SECRET, "MILES_API_KEY": KEY}
    with running_engine(checkpoints["v1"], log_dir=tmp_path_factory.mktemp("logs"), env=env) as url:
        yield url


@pytest.fixture
def http(engine_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine_url, timeout=60, trust_env=False) as client:
        yield client


def bearer(credential: str, fence: int | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {credential}"}
    if fence is not None:
        headers["X-Miles-Fence"] = str(fence)
    return headers


def error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return str(response.json()["error"]["message"])


def fence_state(http: httpx.Client) -> dict[str, object]:
    info = http.get("/server_info", headers=bearer(KEY)).json()
    return {"fence": info["fence"], "window_open": info["window_open"]}


GREEDY = {"text": "1+1=", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def test_health_stays_open_and_inference_needs_the_api_key(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    missing = http.post("/generate", json=GREEDY)
    assert "MILES_API_KEY" in error(missing, 401) and missing.headers["www-authenticate"] == "Bearer"
    error(http.post("/generate", json=GREEDY, headers=bearer("wrong")), 403)
    for credential in (KEY, SECRET):
        assert http.post("/generate", json=GREEDY, headers=bearer(credential)).status_code == 200
    for path in (
        "/get_model_info",
        "/model_info",
        "/get_server_info",
        "/server_info",
        "/get_weight_version",
        "/v1/models",
    ):
        error(http.get(path), 401)
        assert http.get(path, headers=bearer(KEY)).status_code == 200, path
    error(http.get("/health_generate"), 401)
    error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}), 401)
    # The credential is checked before the body: a malformed body without one learns nothing.
    error(http.post("/generate", content=b"{not json", headers={"content-type": "application/json"}), 401)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/update_weights_from_disk", {"model_path": "/nowhere"}),
        ("POST", "/update_weight_version", {"new_version": "x"}),
        ("POST", "/pause_generation", {"mode": "abort"}),
        ("POST", "/continue_generation", {}),
        ("POST", "/abort_request", {"abort_all": True}),
        ("POST", "/export_weights", {"step": 1}),
        ("POST", "/weights_checker", {}),
        ("GET", "/flush_cache", None),
        ("POST", "/fence", {"token": 1000, "window_open": True}),
    ],
)
def test_control_endpoints_need_the_secret_and_refusals_change_nothing(
    http: httpx.Client, method: str, path: str, body: dict | None
) -> None:
    before = (http.get("/get_weight_version", headers=bearer(KEY)).json(), fence_state(http))
    message = error(http.request(method, path, json=body), 401)
    assert "MILES_ENGINE_SECRET" in message and "controller that launched the engine" in message
    error(http.request(method, path, json=body, headers=bearer(KEY)), 403)
    error(http.request(method, path, json=body, headers=bearer("wrong", fence=10**6)), 403)
    assert (http.get("/get_weight_version", headers=bearer(KEY)).json(), fence_state(http)) == before
    assert http.post("/generate", json=GREEDY, headers=bearer(KEY)).status_code == 200


def test_a_large_body_without_the_credential_gets_its_refusal_not_a_reset(http: httpx.Client) -> None:
    """The refusal comes before the body is read; the body is then read and dropped, so the client
    gets its answer instead of a connection reset, and the same connection serves the next call."""
    padding = b'{"model_path": "' + b"x" * (48 << 20) + b'"}'
    for _ in range(3):
        for path, headers in (("/update_weights_from_disk", {}), ("/generate", bearer("wrong"))):
            refused = http.post(path, content=padding, headers={"content-type": "application/json", **headers})
            assert refused.status_code in (401, 403), refused.text[:300]
            assert "MILES_" in refused.json()["error"]["message"]
        assert http.post("/generate", json=GREEDY, headers=bearer(KEY)).status_code == 200


def test_fencing_tokens_and_windows(http: httpx.Client, checkpoints: dict[str, Path]) -> None:
    start = int(fence_state(http)["fence"])  # type: ignore[arg-type]
    t = start + 5
    rename = {"new_version": "fenced"}
    assert http.post("/update_weight_version", json=rename, headers=bearer(SECRET, fence=t)).status_code == 200
    assert fence_state(http) == {"fence": t, "window_open": False}
    stale = error(
        http.post("/update_weight_version", json={"new_version": "old"}, headers=bearer(SECRET, fence=t - 2)), 409
    )
    assert stale == f"stale fencing token {t - 2}: this engine has seen {t}; a newer update owns it"
    assert http.get("/get_weight_version", headers=bearer(KEY)).json()["weight_version"] == "fenced"
    # Unfenced calls from the secret holder still pass; a malformed header is a 400.
    assert http.post("/update_weight_version", json={"new_version": "1"}, headers=bearer(SECRET)).status_code == 200
    error(http.post("/pause_generation", json={}, headers={**bearer(SECRET), "X-Miles-Fence": "soon"}), 400)
    # A call refused for its body does not move the fence.
    error(http.post("/update_weight_version", json={"bogus": 1}, headers=bearer(SECRET, fence=t + 100)), 400)
    assert fence_state(http)["fence"] == t

    # POST /fence opens window t+1; its credential then works on control endpoints, fenced at t+1.
    w = t + 1
    error(http.post("/fence", json={"token": t - 1, "window_open": True}, headers=bearer(SECRET)), 409)
    error(http.post("/fence", json={"token": w, "window_open": True, "extra": 1}, headers=bearer(SECRET)), 400)
    opened = http.post("/fence", json={"token": w, "window_open": True}, headers=bearer(SECRET))
    assert opened.json() == {"fence": w, "window_open": True}
    window = window_credential(SECRET, w)
    v2 = checkpoints["v2"]
    loaded = http.post("/update_weights_from_disk", json={"model_path": str(v2)}, headers=bearer(window))
    assert loaded.json()["success"] is True
    assert http.post("/weights_checker", json={}, headers=bearer(window)).json()["payload"]["checksum"] == (
        read_manifest(v2).checksum
    )
    error(http.post("/fence", json={"token": w + 1, "window_open": True}, headers=bearer(window)), 403)
    error(http.post("/generate", json=GREEDY, headers=bearer(window)), 403)
    error(http.post("/weights_checker", json={}, headers={**bearer(window), "X-Miles-Fence": str(w + 1)}), 400)
    forged = window.replace(f"mw1.{w}.", f"mw1.{w + 1}.")
    error(http.post("/weights_checker", json={}, headers=bearer(forged)), 403)

    # Closed, then superseded: the credential is refused, the weights stay.
    http.post("/fence", json={"token": w, "window_open": False}, headers=bearer(SECRET))
    closed = error(http.post("/update_weight_version", json=rename, headers=bearer(window)), 403)
    assert "closed or superseded" in closed
    http.post("/fence", json={"token": w + 1, "window_open": True}, headers=bearer(SECRET))
    error(http.post("/update_weight_version", json=rename, headers=bearer(window)), 403)
    newer = window_credential(SECRET, w + 1)
    v1 = checkpoints["v1"]
    assert http.post("/update_weights_from_disk", json={"model_path": str(v1)}, headers=bearer(newer)).json()["success"]
    # A fenced call from the controller with a newer token ends that window too.
    http.post("/continue_generation", json={}, headers=bearer(SECRET, fence=w + 2))
    assert fence_state(http) == {"fence": w + 2, "window_open": False}
    error(http.post("/update_weight_version", json=rename, headers=bearer(newer)), 403)
    assert http.get("/get_weight_version", headers=bearer(KEY)).json()["weight_version"] == "1"


@pytest.mark.parametrize(("name", "value"), [("MILES_ENGINE_SECRET", ""), ("MILES_API_KEY", "has space")])
def test_an_unusable_credential_stops_the_engine_at_start(
    checkpoints: dict[str, Path], tmp_path: Path, name: str, value: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "miles.engine", "--model-path", str(checkpoints["v1"]), "--port", "1"],
        env={**os.environ, name: value},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert name in result.stderr


def test_a_staged_window_credential_only_stages_and_activation_ends_it(
    http: httpx.Client, checkpoints: dict[str, Path]
) -> None:
    """A staged window's servers serve while it is open: its credential may stage weights and read
    their checksum, nothing that changes what is served; the controller's /activate_weights ends it."""
    w = int(fence_state(http)["fence"]) + 1  # type: ignore[arg-type]
    served = http.get("/get_weight_version", headers=bearer(KEY)).json()["weight_version"]
    opened = http.post("/fence", json={"token": w, "window_open": True, "staged": True}, headers=bearer(SECRET))
    assert opened.json() == {"fence": w, "window_open": True}
    window = bearer(window_credential(SECRET, w))
    live_changes = [
        ("/update_weights_from_disk", {"model_path": str(checkpoints["v3"])}),
        ("/update_weight_version", {"new_version": "forged"}),
        ("/activate_weights", {"expected_checksum": "0" * 32, "weight_version": "forged"}),
        ("/pause_generation", {}),
        ("/abort_request", {"abort_all": True}),
        ("/export_weights", {"step": 1}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["e30="], "load_format": "miles_shm"}),
        (
            "/update_weights_from_distributed",
            {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g", "activate": True},
        ),
    ]
    for path, body in live_changes:
        assert "is staged" in error(http.post(path, json=body, headers=window), 403), path
    # Staging calls pass the credential check (this one then fails on its made-up segment).
    staging = {"serialized_named_tensors": ["e30="], "load_format": "miles_shm", "activate": False}
    assert http.post("/update_weights_from_tensor", json=staging, headers=window).status_code == 400
    assert http.post("/weights_checker", json={}, headers=window).status_code == 200
    assert http.get("/get_weight_version", headers=bearer(KEY)).json()["weight_version"] == served

    # The controller's activation ends the window, whatever it finds staged (nothing, here).
    refused = http.post(
        "/activate_weights",
        json={"expected_checksum": "0" * 32, "weight_version": "9"},
        headers=bearer(SECRET, fence=w),
    )
    assert refused.status_code == 409, refused.text
    assert fence_state(http) == {"fence": w, "window_open": False}
    assert "closed or superseded" in error(http.post("/weights_checker", json={}, headers=window), 403)
    assert http.get("/get_weight_version", headers=bearer(KEY)).json()["weight_version"] == served

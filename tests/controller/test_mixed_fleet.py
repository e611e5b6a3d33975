"""One controller owning SFT and SGLang servers side by side: an embedded-engine policy it launches
and an SGLang judge someone else runs (attached), through the API, HTTP and the command line, with
per-model routing and one /health."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.inference_controller import InferenceController
from miles.models.presets import init_checkpoint
from miles.rollout.engine_process import EngineProcess, engine_command, free_port
from miles.testing import wait_serving
from miles.weights.checkpoint import read_manifest

SFT = "miles.rollout.sft_rollout.SFTRollout"
SGLANG = "miles.ray.rollout.sglang_rollout.SGLangRollout"


@pytest.fixture(scope="module")
def judge_checkpoints(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("judge")
    init_checkpoint(root / "b2", model_name="tiny-b", preset="tiny", seed=11, step=2)
    return {"b1": checkpoints["b1"], "b2": root / "b2"}


@pytest.fixture
def judge_url(judge_checkpoints: dict[str, Path], tmp_path: Path) -> Iterator[str]:
    """An SGLang-speaking server someone else runs (an embedded engine started here)."""
    port = free_port()
    process = EngineProcess(
        command=engine_command(judge_checkpoints["b1"], port=port, num_threads=1), log_path=tmp_path / "judge.log"
    )
    process.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()


@pytest.fixture
def shaped_judge_url(judge_checkpoints: dict[str, Path], tmp_path: Path) -> Iterator[str]:
    """The judge behind a proxy that answers as SGLang does and records what it is sent."""
    engine_port, proxy_port = free_port(), free_port()
    proxy = Path(__file__).parents[1] / "rollout" / "sglang_shaped_proxy.py"
    processes = [
        EngineProcess(
            command=engine_command(judge_checkpoints["b1"], port=engine_port, num_threads=1),
            log_path=tmp_path / "judge.log",
        ),
        EngineProcess(
            command=[sys.executable, str(proxy), "--upstream", f"http://127.0.0.1:{engine_port}"]
            + ["--port", str(proxy_port)],
            log_path=tmp_path / "proxy.log",
        ),
    ]
    try:
        for process in processes:
            process.start()
        yield f"http://127.0.0.1:{proxy_port}"
    finally:
        for process in processes:
            process.kill()


def fleet(checkpoints: dict[str, Path], judge_checkpoints: dict[str, Path], judge_url: str) -> dict[str, object]:
    return {
        "policy": {"cls": SFT, "checkpoint": str(checkpoints["v1"]), "num_servers": 1, "num_threads": 1},
        "judge": {"cls": SGLANG, "checkpoint": str(judge_checkpoints["b1"]), "urls": [judge_url]},
    }


def generate(url: str, model: str) -> dict:  # type: ignore[type-arg]
    body = {"text": "hi", "model": model, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    answer = httpx.post(f"{url}/generate", json=body, timeout=60, trust_env=False)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_mixed_fleet_through_the_api_and_http(
    checkpoints: dict[str, Path], judge_checkpoints: dict[str, Path], judge_url: str
) -> None:
    with InferenceController(
        fleet(checkpoints, judge_checkpoints, judge_url), port=0, health_interval_s=0.2
    ) as controller:
        assert controller.url is not None
        health = httpx.get(f"{controller.url}/health", timeout=10, trust_env=False).json()
        assert health["ok"] and set(health["models"]) == {"tiny", "tiny-b"}
        attached = {s["model_name"]: s["attached"] for s in health["servers"]}
        assert attached == {"tiny": False, "tiny-b": True}
        assert generate(controller.url, "tiny")["meta_info"]["weight_version"] == "1"
        assert generate(controller.url, "tiny-b")["meta_info"]["weight_version"] == "1"
        models = httpx.get(f"{controller.url}/v1/models", timeout=10, trust_env=False).json()
        assert {m["id"] for m in models["data"]} == {"tiny", "tiny-b"}

        # Each model updates on its own: the policy through the API, the judge over HTTP.
        policy = controller.update_rollout_weights(checkpoints["v2"], model_name="tiny")
        assert policy.status == "committed", policy
        answer = httpx.post(
            f"{controller.url}/update_weights",
            json={"checkpoint": str(judge_checkpoints["b2"]), "model_name": "tiny-b"},
            timeout=120,
            trust_env=False,
        )
        assert answer.status_code == 200, answer.text
        report = controller.health()
        checksums = {s.model_name: s.checksum for s in report.servers}
        assert checksums == {
            "tiny": read_manifest(checkpoints["v2"]).checksum,
            "tiny-b": read_manifest(judge_checkpoints["b2"]).checksum,
        }
        assert generate(controller.url, "tiny-b")["meta_info"]["weight_version"] == "2"
    # The controller never stops a server it did not start.
    assert httpx.get(f"{judge_url}/health", timeout=10, trust_env=False).status_code == 200


def test_a_launching_server_type_given_urls_is_refused_by_name(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(Exception, match="SFTRollout launches its own servers and cannot attach"):
        InferenceController({"m": {"cls": SFT, "checkpoint": str(checkpoints["v1"]), "urls": ["http://127.0.0.1:9"]}})


def test_one_server_attached_to_two_models_is_refused_by_name(
    checkpoints: dict[str, Path], judge_checkpoints: dict[str, Path]
) -> None:
    url = "http://127.0.0.1:9"
    with pytest.raises(Exception, match="attaches http://127.0.0.1:9, which another spec attaches too"):
        InferenceController(
            {
                "a": {"cls": SGLANG, "checkpoint": str(checkpoints["v1"]), "urls": [url]},
                "b": {"cls": SGLANG, "checkpoint": str(judge_checkpoints["b1"]), "urls": [f"{url}/"]},
            }
        )


def test_mixed_fleet_from_the_command_line(
    checkpoints: dict[str, Path], judge_checkpoints: dict[str, Path], judge_url: str, tmp_path: Path
) -> None:
    spec = tmp_path / "fleet.json"
    spec.write_text(json.dumps(fleet(checkpoints, judge_checkpoints, judge_url)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "serve", "--fleet", str(spec), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_serving(url, serve)
        miles = [sys.executable, "-m", "miles.cli"]
        update = subprocess.run(
            [*miles, "update", "--url", url, "--model", "tiny-b", "--checkpoint", str(judge_checkpoints["b2"])],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert update.returncode == 0, update.stdout + update.stderr
        wide = {**os.environ, "COLUMNS": "200"}
        table = subprocess.run([*miles, "health", "--url", url], capture_output=True, text=True, timeout=60, env=wide)
        assert "(attached)" in table.stdout, table.stdout  # the judge's row, and only it
        assert table.stdout.count("(attached)") == 1, table.stdout
        health = subprocess.run([*miles, "health", "--url", url, "--json"], capture_output=True, text=True, timeout=60)
        report = json.loads(health.stdout)
        versions = {s["model_name"]: (s["weight_version"], s["attached"]) for s in report["servers"]}
        assert versions == {"tiny": ("1", False), "tiny-b": ("2", True)}
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    assert httpx.get(f"{judge_url}/health", timeout=10, trust_env=False).status_code == 200


def test_serve_refuses_a_fleet_file_that_is_not_a_mapping(tmp_path: Path) -> None:
    spec = tmp_path / "fleet.json"
    spec.write_text("[1, 2]")
    # Wide enough that the error's box does not wrap the message, whatever the temp path's length.
    wide = {**os.environ, "COLUMNS": "400"}
    done = subprocess.run(
        [sys.executable, "-m", "miles.cli", "serve", "--fleet", str(spec)],
        capture_output=True,
        text=True,
        timeout=60,
        env=wide,
    )
    assert done.returncode != 0
    assert "must hold a JSON object of names to server specs" in done.stderr


def test_no_credential_of_the_controller_reaches_an_attached_server(
    checkpoints: dict[str, Path], judge_checkpoints: dict[str, Path], shaped_judge_url: str
) -> None:
    with InferenceController(
        fleet(checkpoints, judge_checkpoints, shaped_judge_url), port=0, health_interval_s=0.2
    ) as controller:
        assert controller.url is not None
        generate(controller.url, "tiny-b")
        generate(controller.url, "tiny")
        result = controller.update_rollout_weights(judge_checkpoints["b2"], model_name="tiny-b")
        assert result.status == "committed", result
        secret = controller.core.engine_secret
        seen = httpx.get(f"{shaped_judge_url}/_fake/authorizations", timeout=10, trust_env=False).json()
        assert not any(secret in header for header in seen), seen


def test_an_attached_server_that_stays_down_does_not_hold_up_the_other_models(
    checkpoints: dict[str, Path], judge_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    port = free_port()
    judge = EngineProcess(
        command=engine_command(judge_checkpoints["b1"], port=port, num_threads=1), log_path=tmp_path / "judge.log"
    )
    judge.start()
    url = f"http://127.0.0.1:{port}"
    try:
        with InferenceController(
            fleet(checkpoints, judge_checkpoints, url),
            port=0,
            health_interval_s=0.2,
            health_timeout_s=1.0,
            # A restart that waited the whole start-up time for the judge would hold the lock
            # longer than an update waits for it.
            startup_timeout_s=300,
            lock_timeout_s=60,
        ) as controller:
            judge.kill()  # its owner takes it down, and keeps it down
            deadline = time.monotonic() + 60
            while next(s for s in controller.health().servers if s.model_name == "tiny-b").state == "serving":
                assert time.monotonic() < deadline, "the supervisor never noticed the judge was gone"
                time.sleep(0.1)  # the supervisor's probes run on the controller's own loop thread
            # Each attempt to bring the judge back holds the lock for one probe timeout.
            result = controller.update_rollout_weights(checkpoints["v2"], model_name="tiny")
            assert result.status == "committed", result
            report = controller.health()
            assert report.models["tiny-b"].serving == 0 and report.status == "unavailable"
    finally:
        judge.kill()

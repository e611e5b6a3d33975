"""Prometheus metrics after real traffic and real updates: the controller's and an engine's /metrics,
and the status page's JSON while an update holds the lock.

A real controller over two embedded engines. The failed update uses the edge fake of the protocol
tests: a rollout whose last server loads other (valid) weights than it was asked to.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from miles.controller.results import UpdateStatus
from miles.protocol.sglang_weights import UpdateWeightsResponse
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.rollout.sft_rollout import SFTRollout
from miles.testing import running_controller
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.asyncio(loop_scope="module")


class MisloadingRollout(SFTRollout):
    """When asked to load a checkpoint in ``swap``, the last server loads the mapped one instead."""

    swap: ClassVar[dict[Path, Path]] = {}

    async def load(self, server_id: str, checkpoint: Path, **kwargs: Any) -> UpdateWeightsResponse:
        if server_id == self.server_ids[-1] and checkpoint in self.swap:
            checkpoint = self.swap[checkpoint]
            kwargs["expected_checksum"] = read_manifest(checkpoint).checksum
        return await super().load(server_id, checkpoint, **kwargs)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(checkpoints: dict[str, Path]) -> AsyncIterator[tuple[AsyncInferenceController, httpx.AsyncClient]]:
    MisloadingRollout.swap = {checkpoints["v4"]: checkpoints["v1"]}
    async with running_controller(MisloadingRollout, checkpoints["v1"], num_servers=2) as (controller, url):
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            yield controller, http


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(http: httpx.AsyncClient, url: str = "/metrics") -> Samples:
    response = await http.get(url)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over every sample whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def labelled(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(ls) for (n, ls) in samples if n == name]


def greedy(tokens: int = 4, **extra: object) -> dict[str, object]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": tokens, "temperature": 0}, **extra}


async def test_routed_requests_latency_tokens_and_outcomes(fleet) -> None:
    _, http = fleet
    before = await scrape(http)
    made = 0
    for _ in range(4):
        answer = await http.post("/generate", json=greedy())
        assert answer.status_code == 200
        made += answer.json()["meta_info"]["completion_tokens"]
    async with http.stream("POST", "/generate", json=greedy(5, stream=True)) as streamed:
        events = [line async for line in streamed.aiter_lines() if line.startswith("data: {")]
    made += json.loads(events[-1].removeprefix("data: "))["meta_info"]["completion_tokens"]
    completion = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
    made += completion.json()["usage"]["completion_tokens"]
    bad = await http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": -1}})
    assert bad.status_code == 400

    after = await scrape(http)

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew("miles_requests_total", model="tiny", outcome="ok") == 6
    assert grew("miles_requests_total", model="tiny", outcome="client_error") == 1
    assert {ls["server"] for ls in labelled(after, "miles_requests_total")} == {"tiny-0", "tiny-1"}
    assert grew("miles_request_seconds_count", model="tiny") == 7
    assert grew("miles_time_to_first_token_seconds_count", model="tiny") == 1
    assert grew("miles_generated_tokens_total", model="tiny") == made
    # No update yet: every answer ran on the newest weights there are.
    assert grew("miles_sample_staleness_versions_count", model="tiny") == 6
    assert grew("miles_sample_staleness_versions_bucket", model="tiny", le="0.0") == 6
    assert total(after, "miles_requests_waiting") == 0
    assert total(after, "miles_server_in_flight") == 0


async def test_updates_by_phase_blocked_time_bytes_and_failures(fleet, checkpoints: dict[str, Path]) -> None:
    controller, http = fleet
    committed = await http.post("/update_weights", json={"checkpoint": str(checkpoints["v2"])})
    assert committed.json()["status"] == "committed", committed.text
    rolling = await http.post("/update_weights", json={"checkpoint": str(checkpoints["v3"]), "strategy": "rolling"})
    assert rolling.json()["status"] == "committed", rolling.text
    failed = await controller.update_rollout_weights(checkpoints["v4"])
    assert failed.status is UpdateStatus.ROLLED_BACK, failed.message

    samples = await scrape(http)
    assert total(samples, "miles_updates_total", strategy="barrier", path="disk", status="committed") == 1
    assert total(samples, "miles_updates_total", strategy="rolling", path="disk", status="committed") == 1
    assert total(samples, "miles_updates_total", strategy="barrier", path="disk", status="rolled_back") == 1
    assert total(samples, "miles_update_seconds_count", model="tiny") == 3
    phases = {ls["phase"] for ls in labelled(samples, "miles_update_phase_seconds_count")}
    assert {"lock_wait", "validate", "pause", "load", "confirm", "commit", "rollback", "transaction"} <= phases
    # A barrier update holds requests; a rolling one never closes the gate.
    body = committed.json()
    assert body["serving_blocked_s"] > 0 and rolling.json()["serving_blocked_s"] == 0
    assert total(samples, "miles_update_serving_blocked_seconds_count", model="tiny") == 3
    assert total(samples, "miles_update_serving_blocked_seconds_bucket", model="tiny", le="0.0001") >= 1
    size = read_manifest(checkpoints["v2"]).num_bytes
    assert body["bytes_moved"] == 2 * size
    assert total(samples, "miles_update_bytes_sum", model="tiny") == 2 * size * 3
    # The failed update: one server mismatched, was quarantined, and both were rolled back.
    assert total(samples, "miles_checksum_mismatches_total", server="tiny-1") == 1
    assert total(samples, "miles_quarantines_total", server="tiny-1") == 1
    assert total(samples, "miles_rollbacks_total", model="tiny") == 2
    assert total(samples, "miles_lock_wait_seconds_count") >= 3
    assert total(samples, "miles_lock_hold_seconds_count") >= 3
    # Every server's weights, as /health reports them.
    health = (await http.get("/health")).json()
    info = {ls["server"]: ls for ls in labelled(samples, "miles_server_info")}
    for server in health["servers"]:
        shown = info[server["server_id"]]
        assert shown["weight_version"] == server["weight_version"] == "3"
        assert shown["checksum"] == server["checksum"] == read_manifest(checkpoints["v3"]).checksum
        assert shown["state"] == "serving" and shown["server_type"] == server["server_type"] != ""
        assert total(samples, "miles_server_restarts_total", server=server["server_id"]) == 0
    assert total(samples, "miles_servers", model="tiny", state="serving") == 2
    assert total(samples, "miles_fleet_ok") == 1


async def test_an_engine_serves_its_own_metrics_under_sglang_names(fleet, checkpoints: dict[str, Path]) -> None:
    controller, http = fleet
    server = controller.health().servers[0]
    async with httpx.AsyncClient(trust_env=False, timeout=30) as direct:
        await direct.post(f"{server.url}/generate", json=greedy(3))
        samples = await scrape(direct, f"{server.url}/metrics")
    assert total(samples, "sglang:num_requests_total", model_name="tiny") >= 1
    assert total(samples, "sglang:generation_tokens_total", model_name="tiny") >= 3
    assert total(samples, "sglang:prompt_tokens_total", model_name="tiny") >= 1
    assert total(samples, "sglang:e2e_request_latency_seconds_count", is_streaming="false") >= 1
    assert total(samples, "sglang:time_to_first_token_seconds_count", is_streaming="false") >= 1
    # Read at scrape time (the health probes' own generations may be running).
    for gauge in ("sglang:num_running_reqs", "sglang:num_queue_reqs"):
        assert (gauge, (("model_name", "tiny"),)) in samples
    assert total(samples, "sglang:weight_load_duration_seconds", source="disk") > 0
    assert total(samples, "miles_engine_weight_updates_total", source="disk", outcome="ok") >= 2
    (weights,) = labelled(samples, "miles_engine_weights_info")
    assert weights["weight_version"] == server.weight_version
    assert weights["checksum"] == server.checksum


async def test_status_and_metrics_stay_live_while_a_window_holds_the_lock(fleet) -> None:
    controller, http = fleet
    window = (await http.post("/update_weights/start", json={})).json()
    try:
        status = await asyncio.wait_for(http.get("/status"), timeout=5)
        assert status.status_code == 200
        lock = status.json()["health"]["lock"]
        assert lock["held"] and lock["detached"] and lock["token"] == window["token"]
        (running,) = [u for u in status.json()["updates"] if u["status"] == "running"]
        assert running["update_id"] == window["update_id"] and running["strategy"] == "window"
        samples = await asyncio.wait_for(scrape(http), timeout=5)
        assert total(samples, "miles_lock_held") == 1
        assert total(samples, "miles_servers", state="updating") == 2
    finally:
        aborted = await http.post("/update_weights/abort", json={"token": window["token"]})
    assert aborted.json()["status"] == "aborted"
    after = (await http.get("/status")).json()
    assert after["updates"][0]["update_id"] == window["update_id"]
    assert after["updates"][0]["status"] == "aborted" and "transfer" in after["updates"][0]["phases"]
    assert sum(after["requests"]["requests"]) > 0


async def test_metrics_can_be_turned_off(checkpoints: dict[str, Path]) -> None:
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=1, metrics_enabled=False) as (
        _,
        url,
    ):
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            assert (await http.post("/generate", json=greedy())).status_code == 200
            off = await http.get("/metrics")
            assert off.status_code == 404
            assert "MILES_METRICS_ENABLED" in off.json()["error"]["message"]

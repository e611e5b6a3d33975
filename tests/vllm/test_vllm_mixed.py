"""One model served at once by an embedded engine and a real vLLM server, under one controller: one
update transaction, one router, one ``/health`` for both (a MixedRollout).

Both start on the ``small`` checkpoint (vLLM's CPU attention refuses the ``tiny`` preset's head
size). Every update, from disk or pushed from memory, commits only once both servers confirmed the
published checksum; one that does not verify leaves both on their verified weights. Its own module,
with its own controller, before the package's (test_vllm_rollout.py): one vLLM server at a time.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from vllm_fleet import EAGER, corrupted, weights_of

from miles.controller.results import UpdateStatus
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.rollout.mixed import MixedRollout
from miles.rollout.state import ServerSnapshot, ServerState
from miles.rollout.vllm_rollout import PROJECT_VLLM_PYTHON, VLLM_PYTHON_ENV
from miles.testing import running_controller, wait_until
from miles.train.push import PushPublisher
from miles.utils.audit_utils.event_logger.models import InferenceEngineWeightChecksumEvent
from miles.weights.checkpoint import read_manifest

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        not (os.environ.get(VLLM_PYTHON_ENV) or PROJECT_VLLM_PYTHON.is_file()),
        reason="vLLM is not installed: `make vllm` builds it (make test does)",
    ),
]

MODEL = "small"
TYPES = {"small-embedded-0": "SFTRollout", "small-vllm-0": "VLLMRollout"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mixed(
    small: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[AsyncInferenceController, str]]:
    """``small`` on an embedded engine and on a vLLM server, one controller over both."""
    specs = {
        "small-embedded": {"cls": "SFTRollout", "checkpoint": small["s0"], "model_name": MODEL, "num_servers": 1},
        "small-vllm": {
            "cls": "VLLMRollout",
            "checkpoint": small["s0"],
            "model_name": MODEL,
            "num_servers": 1,
            "max_running_requests": 8,
            "engine_args": EAGER,
        },
    }
    state_dir = tmp_path_factory.mktemp("mixed-controller")
    async with running_controller(specs, state_dir=state_dir, startup_timeout_s=300) as (ctl, url):
        assert url is not None
        yield ctl, url


def servers(ctl: AsyncInferenceController) -> dict[str, ServerSnapshot]:
    return {s.server_id: s for s in ctl.fleet.rollout(MODEL).snapshot()}


def holding(ctl: AsyncInferenceController) -> dict[str, tuple[ServerState, str | None]]:
    return {sid: (s.state, s.checksum) for sid, s in servers(ctl).items()}


def publish(ctl: AsyncInferenceController, checksum: str, step: int) -> None:
    event = InferenceEngineWeightChecksumEvent(model_name=MODEL, checksum=checksum, step=step)
    ctl.event_logger.log(InferenceEngineWeightChecksumEvent, event, print_log=False)


async def test_one_model_is_served_by_both_kinds_of_server_and_health_lists_both(mixed, small) -> None:
    ctl, url = mixed
    assert isinstance(ctl.fleet.rollout(MODEL), MixedRollout)
    start = read_manifest(small["s0"]).checksum
    assert holding(ctl) == {sid: (ServerState.SERVING, start) for sid in TYPES}
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        health = (await http.get(f"{url}/health")).json()
        assert health["ok"] and health["models"][MODEL]["serving"] == 2
        listed = {s["server_id"]: (s["server_type"], s["engine"], s["checksum"]) for s in health["servers"]}
        assert listed == {
            "small-embedded-0": ("SFTRollout", "sglang", start),
            "small-vllm-0": ("VLLMRollout", "vllm", start),
        }
        # The router spreads requests over both (least outstanding, ties taken in turn).
        answered: dict[str, set[str]] = {"/v1/completions": set(), "/generate": set()}
        for _ in range(4):
            body = {"model": MODEL, "prompt": "mixed fleets", "max_tokens": 4, "temperature": 0}
            completion = await http.post(f"{url}/v1/completions", json=body)
            assert completion.status_code == 200, completion.text
            assert len(completion.json()["choices"]) == 1
            answered["/v1/completions"].add(completion.headers["x-miles-server"])
        sampling = {"temperature": 0, "max_new_tokens": 4}
        for _ in range(4):
            # SGLang's /generate: as it came to the embedded engine, translated for vLLM; the
            # answer is SGLang's either way, stamped with the answering server's version.
            body = {"model": MODEL, "text": "mixed", "sampling_params": sampling}
            native = await http.post(f"{url}/generate", json=body)
            assert native.status_code == 200, native.text
            meta = native.json()["meta_info"]
            assert meta["completion_tokens"] == len(native.json()["output_ids"]) == 4
            assert meta["weight_version"] == servers(ctl)[native.headers["x-miles-server"]].weight_version
            answered["/generate"].add(native.headers["x-miles-server"])
        assert answered == {"/v1/completions": set(TYPES), "/generate": set(TYPES)}
        # A streamed /generate goes to the server that streams SGLang's answer itself.
        body = {"model": MODEL, "text": "mixed", "sampling_params": sampling, "stream": True}
        streamed = await http.post(f"{url}/generate", json=body)
        assert streamed.status_code == 200 and streamed.headers["x-miles-server"] == "small-embedded-0"


@pytest.mark.parametrize("strategy", ["barrier", "rolling"])
async def test_a_disk_update_commits_once_both_confirm_the_published_checksum(mixed, small, strategy: str) -> None:
    ctl, _ = mixed
    for name in ("s1", "s0"):
        manifest = read_manifest(small[name])
        step = ctl.health().models[MODEL].weight_version
        step = int(step) + 1 if step and step.isdigit() else 10
        publish(ctl, manifest.checksum, step)
        result = await ctl.update_rollout_weights(
            small[name], model_name=MODEL, strategy=strategy, weight_version=str(step)
        )
        assert result.status is UpdateStatus.COMMITTED, result.message
        assert {o.server_id: o.confirmed_checksum for o in result.servers} == dict.fromkeys(TYPES, manifest.checksum)
        assert holding(ctl) == dict.fromkeys(TYPES, (ServerState.SERVING, manifest.checksum))


async def test_an_update_that_does_not_verify_leaves_both_on_verified_weights(mixed, small, tmp_path: Path) -> None:
    ctl, url = mixed
    before = holding(ctl)
    version = ctl.health().models[MODEL].weight_version
    assert version is not None
    # A checkpoint whose bytes are not its manifest's: both servers refuse it before loading.
    bad = await asyncio.to_thread(corrupted, small["s1"], tmp_path / "bad")
    refused = await ctl.update_rollout_weights(bad, model_name=MODEL, weight_version=str(int(version) + 1))
    assert refused.status is UpdateStatus.REJECTED and "digest_mismatch" in refused.message
    assert holding(ctl) == before
    # A window whose servers do not hold what training says it pushed (nothing was pushed): both
    # confirm what they hold, both mismatch, are quarantined and rolled back as one transaction.
    window = await ctl.start_update_weights(MODEL)
    assert {s.server_id: s.engine for s in window.servers} == {"small-embedded-0": "sglang", "small-vllm-0": "vllm"}
    wrong = read_manifest(small["s1"]).checksum
    result = await ctl.end_update_weights(window, checksum=wrong, step=int(version) + 2)
    assert result.status is UpdateStatus.ROLLED_BACK, result.message
    assert {o.server_id: o.matched for o in result.servers} == dict.fromkeys(TYPES, False)
    assert holding(ctl) == before
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        body = {"model": MODEL, "prompt": "still serving", "max_tokens": 2}
        assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200


async def test_a_push_window_commits_with_both_servers_verified(mixed, small) -> None:
    ctl, _ = mixed
    weights = await asyncio.to_thread(weights_of, small["s1"])
    version = ctl.health().models[MODEL].weight_version
    assert version is not None
    publisher = PushPublisher(ctl, model_name=MODEL, path="shm", bucket_bytes=1 << 20, timeout_s=60)
    try:
        # Staged by default; the vLLM server cannot stage, so the model's window opens unstaged.
        result = await publisher.push(weights, step=int(version) + 10)
    finally:
        await publisher.close()
    expected = read_manifest(small["s1"]).checksum
    assert result.checksum == expected
    assert holding(ctl) == dict.fromkeys(TYPES, (ServerState.SERVING, expected))
    assert {s.weight_version for s in servers(ctl).values()} == {result.weight_version}
    # Pushed weights lie on no disk: one server writes them out, and both reload from that copy.
    await wait_until(
        lambda: all(s.verified is not None and s.verified.checkpoint is not None for s in servers(ctl).values()),
        timeout=60,
        what="the pushed weights written out for both servers",
    )
    copies = {s.verified.checkpoint for s in servers(ctl).values() if s.verified is not None}
    assert len(copies) == 1
    (copy,) = copies
    assert copy is not None and read_manifest(copy).checksum == expected

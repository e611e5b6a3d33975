"""Closed-loop client load through the controller while weights change 20 times per strategy.

Zero requests may fail, every response must carry a version that was committed, and its tokens
must be exactly what that version's weights produce.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from miles.controller.results import UpdateStatus
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.testing import running_controller, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = ["a", "12+7=", "hello", "zz"]
UPDATES_PER_STRATEGY = 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(checkpoints: dict[str, Path]) -> AsyncIterator[tuple[AsyncInferenceController, str]]:
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (controller, url):
        assert url is not None
        yield controller, url


def body(prompt: str) -> dict[str, object]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


async def reference_outputs(http: httpx.AsyncClient) -> list[list[int]]:
    return [(await http.post("/generate", json=body(p))).json()["output_ids"] for p in PROMPTS]


@pytest.mark.parametrize("strategy", ["barrier", "rolling"])
async def test_updates_under_load_fail_no_request(fleet, checkpoints: dict[str, Path], strategy: str) -> None:
    controller, url = fleet
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False, limits=limits) as http:
        # Versions alternate between two sets of weights; remember what each set answers.
        base = int(controller.health().models["tiny"].weight_version or "1")
        weights_of: dict[str, str] = {}
        reference: dict[str, list[list[int]]] = {}
        for offset, name in ((1, "v2"), (2, "v3")):
            version = str(base + offset)
            result = await controller.update_rollout_weights(
                checkpoints[name], weight_version=version, strategy=strategy
            )
            assert result.status is UpdateStatus.COMMITTED, result.message
            weights_of[version] = name
            reference[name] = await reference_outputs(http)
        assert reference["v2"] != reference["v3"]
        committed = set(weights_of)

        stop = asyncio.Event()
        responses: list[tuple[int, int, dict]] = []

        async def client(worker: int) -> None:
            i = worker
            while not stop.is_set():
                index = i % len(PROMPTS)
                answer = await http.post("/generate", json=body(PROMPTS[index]))
                responses.append((index, answer.status_code, answer.json()))
                i += 1

        clients = [asyncio.create_task(client(w)) for w in range(4)]
        try:
            for n in range(UPDATES_PER_STRATEGY):
                version = str(base + 3 + n)
                name = "v2" if n % 2 == 0 else "v3"
                result = await controller.update_rollout_weights(
                    checkpoints[name], weight_version=version, strategy=strategy
                )
                assert result.status is UpdateStatus.COMMITTED, result.message
                weights_of[version] = name
                committed.add(version)
                # Let traffic through between updates: wait for a few more answers.
                seen = len(responses)
                await wait_until(lambda seen=seen: len(responses) >= seen + 4, what="four more answers", interval=0.01)
        finally:
            stop.set()
            await asyncio.gather(*clients)

    failed = [(status, answer) for _, status, answer in responses if status != 200]
    assert not failed, failed[:3]
    assert len(responses) >= 4 * UPDATES_PER_STRATEGY
    seen_versions = set()
    for index, _, answer in responses:
        meta = answer["meta_info"]
        assert meta["weight_version_start"] == meta["weight_version_end"]
        version = meta["weight_version"]
        assert version in committed, f"served uncommitted version {version}"
        seen_versions.add(version)
        assert answer["output_ids"] == reference[weights_of[version]][index]
    # The load really overlapped the updates: responses came from many versions.
    assert len(seen_versions) >= UPDATES_PER_STRATEGY // 2

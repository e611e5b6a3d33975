"""Partial rollout: an update in ``retract`` mode does not wait for running requests, and does not
cut them short either. They continue on the new weights from the tokens they already have, and
each answer says which version produced which tokens."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from miles.testing import running_controller

pytestmark = pytest.mark.asyncio

PROMPT = [11, 12, 13, 14]
TOKENS = 300


def greedy(ids: list[int], tokens: int) -> dict[str, object]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}


async def test_a_retract_update_continues_requests_on_the_new_weights(checkpoints: dict[str, Path]) -> None:
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=1) as (controller, url):
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
            before = (await http.post("/generate", json=greedy(PROMPT, TOKENS))).json()
            engine = controller.fleet.rollout(None).cell("tiny-0").url
            running = [asyncio.create_task(http.post("/generate", json=greedy(PROMPT, TOKENS))) for _ in range(2)]
            async with httpx.AsyncClient(timeout=10, trust_env=False) as direct:
                deadline = time.monotonic() + 30
                while (await direct.get(f"{engine}/get_server_info")).json()["internal_states"][0][
                    "running_requests"
                ] < 2:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.005)
            result = await controller.update_rollout_weights(
                checkpoints["v2"], weight_version="2", pause_mode="retract"
            )
            assert result.ok, result.message
            answers = [(await task).json() for task in running]
            for answer in answers:
                meta = answer["meta_info"]
                assert meta["finish_reason"]["type"] == "length"
                assert meta["interrupted"] is False
                assert len(answer["output_ids"]) == TOKENS
                spans = meta["weight_version_spans"]
                assert [s["weight_version"] for s in spans] == ["1", "2"], spans
                switch = spans[0]["end"]
                assert spans[0]["start"] == 0 and spans[1] == {"weight_version": "2", "start": switch, "end": TOKENS}
                assert 0 < switch < TOKENS
                assert (meta["weight_version_start"], meta["weight_version_end"]) == ("1", "2")
                # Before the switch: exactly v1's tokens. After: exactly what v2 continues with.
                prefix = answer["output_ids"][:switch]
                assert prefix == before["output_ids"][:switch]
                rest = (await http.post("/generate", json=greedy(PROMPT + prefix, TOKENS - switch))).json()
                assert answer["output_ids"][switch:] == rest["output_ids"]

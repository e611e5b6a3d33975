"""Who waits for the controller's lock, and who never does.

A real controller with two models (``tiny`` on two engines, ``tiny-b`` on one): an update waits for a
held lock; concurrent updates are serialized; health and routing keep answering during a window; a
restart waits for a window to end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from miles.controller.results import UpdateStatus
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.rollout.sft_rollout import SFTRollout
from miles.rollout.state import ServerState
from miles.testing import running_controller
from miles.utils.audit_utils.event_logger.models import WeightUpdateCommittedEvent, WeightUpdateStartedEvent

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(checkpoints: dict[str, Path]) -> AsyncIterator[tuple[AsyncInferenceController, str]]:
    specs = {
        "tiny": {"checkpoint": checkpoints["v1"], "num_servers": 2, "num_threads": 1},
        "tiny-b": {"checkpoint": checkpoints["b1"], "num_servers": 1, "num_threads": 1},
    }
    async with running_controller(specs) as (controller, url):
        assert url is not None
        yield controller, url


async def until(predicate, *, timeout: float = 30.0, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def greedy(model: str | None = None) -> dict[str, object]:
    body: dict[str, object] = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    if model:
        body["model"] = model
    return body


async def test_an_update_waits_for_a_held_lock(fleet, checkpoints: dict[str, Path]) -> None:
    controller, _ = fleet
    window = await controller.start_update_weights("tiny")
    update = asyncio.create_task(controller.update_rollout_weights(checkpoints["v2"], model_name="tiny"))
    await until(lambda: controller.health().lock.waiters == 1, what="the update to queue for the lock")
    assert not update.done()
    assert controller.health().lock.detached is True
    aborted = await controller.abort_update_weights(window)
    assert aborted.status is UpdateStatus.ABORTED
    result = await update
    assert result.status is UpdateStatus.COMMITTED, result.message
    assert result.timings["lock_wait"] > 0
    assert set(result.versions.values()) == {"2"}


async def test_concurrent_updates_are_serialized(fleet, checkpoints: dict[str, Path]) -> None:
    controller, _ = fleet
    first, second = await asyncio.gather(
        controller.update_rollout_weights(checkpoints["v3"], model_name="tiny"),
        controller.update_rollout_weights(checkpoints["v4"], model_name="tiny"),
    )
    statuses = sorted([first.status, second.status])
    # Both ran, one after the other: either order commits v4 last, or v3 arrives second and is
    # refused as older than what serves. Never interleaved.
    assert UpdateStatus.COMMITTED in statuses
    relevant = [
        e
        for e in controller.event_logger.events
        if isinstance(e, WeightUpdateStartedEvent | WeightUpdateCommittedEvent)
        and e.update_id in {first.update_id, second.update_id}
    ]
    ids = [e.update_id for e in relevant]
    assert ids == sorted(ids, key=ids.index)  # each update's events are contiguous
    assert [ids[0]] * ids.count(ids[0]) == ids[: ids.count(ids[0])]
    assert set(controller.health().models["tiny"].versions) == {"4"}


async def test_health_and_routing_keep_answering_during_a_window(fleet) -> None:
    controller, url = fleet
    window = await controller.start_update_weights("tiny")
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
        started = time.monotonic()
        health = await http.get("/health")
        assert time.monotonic() - started < 1.0
        assert health.status_code == 200
        assert health.json()["status"] == "updating"
        assert health.json()["lock"]["held"] is True
        # The other model serves as usual; requests for the model in the window wait for it.
        other = await http.post("/generate", json=greedy("tiny-b"))
        assert other.status_code == 200
        held = asyncio.create_task(http.post("/generate", json=greedy("tiny")))
        router = controller.router
        assert router is not None
        await until(lambda: router.waiting() >= 1, what="the request to wait at the closed gate")
        assert not held.done()
        assert (await http.get("/v1/models")).status_code == 200
        await controller.abort_update_weights(window)
        answered = await held
        assert answered.status_code == 200
        assert answered.json()["meta_info"]["weight_version"] == "4"


async def test_a_restart_waits_for_a_window_to_end(fleet) -> None:
    controller, _ = fleet
    b_server = controller.fleet.rollout("tiny-b")
    assert isinstance(b_server, SFTRollout)
    restarts = b_server.cell("tiny-b-0").restarts
    window = await controller.start_update_weights("tiny")
    pid = b_server.cell("tiny-b-0").pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await until(lambda: controller.health().lock.waiters >= 1, what="the restart to queue for the lock")
    # The supervisor keeps probing the other servers while its restart waits for the lock.
    a_server = controller.fleet.rollout("tiny")
    rounds = a_server.probe_rounds
    await until(lambda: a_server.probe_rounds >= rounds + 2, what="two more rounds of probes")
    assert b_server.cell("tiny-b-0").restarts == restarts, "restarted while a window held the lock"
    await controller.abort_update_weights(window)
    await until(
        lambda: (
            b_server.cell("tiny-b-0").restarts == restarts + 1
            and b_server.cell("tiny-b-0").state is ServerState.SERVING
        ),
        timeout=120,
        what="the restart after the window",
    )
    assert controller.health().ok

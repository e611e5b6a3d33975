"""Serving versions never go backwards, whatever the interleaving of updates and windows.

Updates race for the controller's lock; the one that runs decides "newer than what serves" with
the version it reads under the lock. An update overtaken by a newer one is rejected as not newer,
never committed on top of it, and a caller told ``committed`` finds its version serving.
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
from miles.utils.audit_utils.event_analyzer import analyze_events
from miles.utils.audit_utils.event_logger.models import WeightUpdateCommittedEvent

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(checkpoints: dict[str, Path]) -> AsyncIterator[tuple[AsyncInferenceController, httpx.AsyncClient]]:
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (controller, url):
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
            yield controller, http


def serving_versions(controller: AsyncInferenceController) -> set[str | None]:
    return {s.weight_version for s in controller.fleet.snapshots("tiny") if s.state.value == "serving"}


def committed_versions(controller: AsyncInferenceController, mark: int) -> list[str]:
    events = list(controller.event_logger.events)[mark:]
    return [e.weight_version for e in events if isinstance(e, WeightUpdateCommittedEvent)]


async def test_concurrent_updates_commit_in_increasing_order(fleet, checkpoints: dict[str, Path]) -> None:
    controller, http = fleet
    mark = len(controller.event_logger.events)

    async def update(version: int) -> httpx.Response:
        name = ("v2", "v3")[version % 2]
        return await http.post(
            "/update_weights", json={"checkpoint": str(checkpoints[name]), "weight_version": str(version)}
        )

    # The order the adversarial run saw them arrive in. A window holds the lock meanwhile, so all
    # seven queue, each behind older and newer ones, as they did behind slow updates there.
    order = [10, 14, 12, 11, 16, 15, 13]
    window = await controller.start_update_weights(ttl_s=60)
    tasks = []
    for version in order:
        tasks.append(asyncio.create_task(update(version)))
        await wait_until(
            lambda: controller.health().lock.waiters >= len(tasks), what=f"{version} to queue", interval=0.005
        )
    await controller.abort_update_weights(window)
    answers = dict(zip(order, await asyncio.gather(*tasks), strict=True))
    committed = committed_versions(controller, mark)
    assert [int(v) for v in committed] == sorted(int(v) for v in committed), committed
    for version, answer in answers.items():
        body = answer.json()
        if body["status"] == "committed":
            assert str(version) in committed
        else:
            assert answer.status_code == 409
            assert body["status"] == "rejected", body
            assert "not newer" in body["message"], body["message"]
            assert str(version) not in committed
    # The newest of them always commits (nothing can overtake it), and the fleet ends on it.
    assert answers[16].json()["status"] == "committed"
    assert serving_versions(controller) == {"16"}
    report = analyze_events(list(controller.event_logger.events))
    assert report.passed, report.findings


async def test_an_older_update_queued_behind_a_newer_one_is_rejected(fleet, checkpoints: dict[str, Path]) -> None:
    controller, _ = fleet
    # A window holds the lock, so both updates queue (FIFO): the newer first, then the older.
    window = await controller.start_update_weights(ttl_s=60)
    newer = asyncio.create_task(controller.update_rollout_weights(checkpoints["v2"], weight_version="31"))
    await wait_until(lambda: controller.health().lock.waiters >= 1, what="the newer update to queue", interval=0.01)
    older = asyncio.create_task(controller.update_rollout_weights(checkpoints["v3"], weight_version="30"))
    await wait_until(lambda: controller.health().lock.waiters >= 2, what="the older update to queue", interval=0.01)
    await controller.abort_update_weights(window)
    newer_result, older_result = await newer, await older
    assert newer_result.status is UpdateStatus.COMMITTED, newer_result.message
    assert older_result.status is UpdateStatus.REJECTED
    assert "not newer" in older_result.message
    assert serving_versions(controller) == {"31"}


async def test_a_window_cannot_commit_an_older_version(fleet, checkpoints: dict[str, Path]) -> None:
    controller, http = fleet
    current = int(next(iter(serving_versions(controller))) or 0)
    window = (await http.post("/update_weights/start", json={"ttl_s": 30})).json()
    ended = await http.post(
        "/update_weights/end", json={"token": window["token"], "checksum": "0" * 32, "step": current - 1}
    )
    assert ended.status_code == 409
    assert "not newer" in ended.json()["message"]
    assert serving_versions(controller) == {str(current)}
    assert controller.health().ok and controller.health().models["tiny"].accepting_requests


async def test_a_version_that_is_no_integer_is_no_way_back(fleet, checkpoints: dict[str, Path]) -> None:
    """Serving "abc" between two numbered versions does not let an older number commit after it:
    what a new version must beat is the newest number the fleet was updated to."""
    controller, http = fleet
    current = int(next(iter(serving_versions(controller))) or 0)
    labelled = await http.post("/update_weights", json={"checkpoint": str(checkpoints["v2"]), "weight_version": "abc"})
    assert labelled.status_code == 200 and labelled.json()["status"] == "committed", labelled.text
    for older in (str(current - 1), str(current)):
        refused = await http.post(
            "/update_weights", json={"checkpoint": str(checkpoints["v3"]), "weight_version": older}
        )
        assert refused.status_code == 409 and "not newer" in refused.json()["message"], refused.text
        assert serving_versions(controller) == {"abc"}
    newer = await http.post(
        "/update_weights", json={"checkpoint": str(checkpoints["v3"]), "weight_version": str(current + 1)}
    )
    assert newer.status_code == 200 and newer.json()["status"] == "committed", newer.text
    assert serving_versions(controller) == {str(current + 1)}


async def test_an_update_the_lock_is_not_granted_to_in_time_times_out_and_changes_nothing(
    fleet, checkpoints: dict[str, Path]
) -> None:
    controller, http = fleet

    def servers() -> dict[str, tuple[str, str | None, str | None]]:
        return {s.server_id: (s.state.value, s.weight_version, s.checksum) for s in controller.fleet.snapshots("tiny")}

    before = servers()
    mark = len(controller.event_logger.events)
    # Set first: a change of settings waits for the lock too.
    assert (await http.patch("/config", json={"lock_timeout_s": 0.2})).status_code == 200
    try:
        window = await controller.start_update_weights(ttl_s=60)  # holds the lock
        during = servers()
        try:
            answer = await http.post(
                "/update_weights", json={"checkpoint": str(checkpoints["v2"]), "weight_version": "99"}
            )
            reported = controller.last_update
        finally:
            await controller.abort_update_weights(window)
    finally:
        assert (await http.patch("/config", json={"lock_timeout_s": 600})).status_code == 200
    assert answer.status_code == 409
    body = answer.json()
    assert body["status"] == "timed_out", body
    assert body["message"].startswith("the lock was not granted within 0.2s"), body["message"]
    # Each server as it was when the update gave up, and the result is the one reported last.
    assert {s["server_id"]: (s["state"], s["weight_version"], s["checksum"]) for s in body["servers"]} == during
    assert reported is not None and reported.update_id == body["update_id"]
    assert "99" not in committed_versions(controller, mark)
    assert servers() == before


async def test_version_0_is_a_committed_version_like_any_other(checkpoints: dict[str, Path]) -> None:
    """The first numbered version a fleet commits may be 0 (after labels that are no number): it
    becomes what every later version must beat."""
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=1) as (controller, _):
        for label in ("abc", "0"):
            result = await controller.update_rollout_weights(checkpoints["v2"], weight_version=label)
            assert result.status is UpdateStatus.COMMITTED, result.message
        assert controller.fleet.rollout(None).committed_high == 0
        older = await controller.update_rollout_weights(checkpoints["v3"], weight_version="-1")
        assert older.status is UpdateStatus.REJECTED and "not newer" in older.message, older.message
        assert serving_versions(controller) == {"0"}

"""Crashes and tampering: requests survive the death of every server of their model, weights that
were pushed (on no disk) come back after a crash, and weights changed behind the controller's back
are noticed and undone."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from transformers import AutoModelForCausalLM

from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.rollout.state import ServerState
from miles.testing import running_controller
from miles.train.push import PushPublisher
from miles.utils.audit_utils.event_logger.models import ChecksumMismatchEvent
from miles.weights.checkpoint import MANIFEST_NAME, read_manifest
from miles.weights.checksum import saved_state_dict

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}


async def wait_until(predicate: Callable[[], bool], *, timeout: float = 60.0, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_running(url: str) -> None:
    """Until the engine at ``url`` has a request in its running batch."""
    async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            info = (await http.get(f"{url}/get_server_info")).json()
            if info["internal_states"][0]["running_requests"] >= 1:
                return
            await asyncio.sleep(0.005)
    raise AssertionError("the request never started running")


def kill(controller: AsyncInferenceController, server_id: str) -> None:
    pid = controller.fleet.rollout(None).cell(server_id).pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def single(checkpoints: dict[str, Path]) -> AsyncIterator[tuple[AsyncInferenceController, httpx.AsyncClient]]:
    # A long request timeout: a request that hung until it would fail this module's test timeout.
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=1, request_timeout_s=600) as (
        controller,
        url,
    ):
        async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as http:
            yield controller, http


async def test_a_request_outlives_the_crash_of_the_only_server(single) -> None:
    controller, http = single
    reference = (await http.post("/generate", json=LONG)).json()["output_ids"]
    cell = controller.fleet.rollout(None).cell("tiny-0")
    incarnation = cell.incarnation
    started = time.monotonic()
    pending = asyncio.create_task(http.post("/generate", json=LONG))
    await wait_running(cell.url)
    kill(controller, "tiny-0")
    answer = await asyncio.wait_for(pending, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["output_ids"] == reference
    assert cell.incarnation > incarnation
    # Retried on the restarted process as soon as it served, not after the request timeout.
    assert time.monotonic() - started < 60


async def test_a_stream_that_sent_nothing_outlives_the_crash(single) -> None:
    controller, http = single
    cell = controller.fleet.rollout(None).cell("tiny-0")
    await wait_until(lambda: cell.state is ServerState.SERVING, what="tiny-0 serving")
    # The only server is dead before the stream starts: the stream waits for its replacement.
    kill(controller, "tiny-0")
    async with http.stream("POST", "/generate", json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) == 401


async def test_pushed_weights_come_back_after_the_only_server_crashes(single, checkpoints: dict[str, Path]) -> None:
    controller, http = single
    server = controller.fleet.rollout(None)
    cell = server.cell("tiny-0")
    await wait_until(lambda: cell.state is ServerState.SERVING, what="tiny-0 serving")
    v3 = read_manifest(checkpoints["v3"])
    window = (await http.post("/update_weights/start", json={"ttl_s": 60})).json()
    async with httpx.AsyncClient(timeout=60, trust_env=False) as direct:
        pushed = await direct.post(
            f"{window['servers'][0]['url']}/update_weights_from_disk",
            json={"model_path": str(checkpoints["v3"])},
            headers={"authorization": f"Bearer {window['credential']}"},
        )
        assert pushed.json()["success"] is True
    # No checkpoint given: as far as the controller knows, these weights exist on no disk.
    ended = await http.post(
        "/update_weights/end", json={"token": window["token"], "checksum": v3.checksum, "step": 500}
    )
    assert ended.status_code == 200, ended.text

    def written_out() -> bool:
        report = controller.health().servers[0]
        return report.verified_checkpoint is not None

    await wait_until(written_out, what="the pushed weights to be written out")
    copy = Path(controller.health().servers[0].verified_checkpoint or "")
    assert copy.is_relative_to(controller.fleet.state_dir)
    assert read_manifest(copy).checksum == v3.checksum
    assert copy != checkpoints["v3"].resolve()
    restarts = cell.restarts
    kill(controller, "tiny-0")
    await wait_until(lambda: cell.restarts > restarts and cell.state is ServerState.SERVING, what="the restart")
    confirmed = await server.confirm("tiny-0")
    assert (confirmed.checksum, confirmed.weight_version) == (v3.checksum, "500")
    report = controller.health().servers[0]
    assert (report.weight_version, report.checksum, report.verified_weight_version) == ("500", v3.checksum, "500")


async def test_pushes_in_quick_succession_are_written_out_at_most_once_per_interval(
    single, checkpoints: dict[str, Path]
) -> None:
    controller, _ = single
    await controller.reconfigure({"write_out_interval_s": 3.0})
    publisher = PushPublisher(controller, path="shm")
    try:
        snapshots = controller.fleet.state_dir
        for step, name in ((601, "v2"), (602, "v4"), (603, "v1")):
            weights = saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoints[name]))
            result = await publisher.push(weights, step=step)
        checksum = result.checksum

        def holds_the_last() -> bool:
            written = controller.health().servers[0].verified_checkpoint
            return written is not None and read_manifest(Path(written)).checksum == checksum

        # Staged pushes: the newest weights are written out within the interval; the ones a newer
        # commit replaced before their turn never are (no engine wrote every step while serving).
        await wait_until(holds_the_last, what="the last pushed weights to be written out", timeout=30)
        assert controller.health().servers[0].verified_weight_version == "603"
        assert list(snapshots.rglob("*-603-*")) and not list(snapshots.rglob("*-602-*"))
    finally:
        await publisher.close()
        await controller.reconfigure({"write_out_interval_s": 2.0})


async def test_a_window_that_changes_weights_in_place_first_writes_out_the_ones_it_may_roll_back_to(
    single, checkpoints: dict[str, Path]
) -> None:
    controller, http = single
    # Long enough that the second commit's write-out would still wait its turn when the next
    # window opens.
    await controller.reconfigure({"write_out_interval_s": 600.0})
    try:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as direct:

            async def window(name: str) -> dict:
                opened = (await http.post("/update_weights/start", json={"ttl_s": 60})).json()
                pushed = await direct.post(
                    f"{opened['servers'][0]['url']}/update_weights_from_disk",
                    json={"model_path": str(checkpoints[name])},
                    headers={"authorization": f"Bearer {opened['credential']}"},
                )
                assert pushed.json()["success"] is True
                return opened

            for step, name in ((701, "v2"), (702, "v4")):
                opened = await window(name)
                ended = await http.post(
                    "/update_weights/end",
                    json={
                        "token": opened["token"],
                        "checksum": read_manifest(checkpoints[name]).checksum,
                        "step": step,
                    },
                )
                assert ended.json()["status"] == "committed", ended.text
            # This window overwrites the only server's weights, then is aborted: the server can
            # only go back to step 702's weights if they were written out when the window opened.
            opened = await window("v3")
            aborted = await http.post("/update_weights/abort", json={"token": opened["token"]})
            assert aborted.json()["status"] == "aborted", aborted.text
        report = controller.health().servers[0]
        assert report.state == "serving", report
        assert (report.weight_version, report.checksum) == ("702", read_manifest(checkpoints["v4"]).checksum)
    finally:
        await controller.reconfigure({"write_out_interval_s": 2.0})


async def test_older_write_outs_are_removed_once_no_server_can_go_back_to_them(
    single, checkpoints: dict[str, Path]
) -> None:
    # A write-out every few seconds of training must not fill the disk: once a newer copy is
    # recorded, the copies no server's verified weights name are removed, and the one kept restarts
    # the server.
    controller, _ = single
    cell = controller.fleet.rollout(None).cell("tiny-0")
    await controller.reconfigure({"write_out_interval_s": 0.0})
    publisher = PushPublisher(controller, path="shm")
    try:
        for step, name in ((801, "v2"), (802, "v4"), (803, "v1")):
            weights = saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoints[name]))
            checksum = (await publisher.push(weights, step=step)).checksum

            def written(checksum: str = checksum) -> bool:
                copy = controller.health().servers[0].verified_checkpoint
                return copy is not None and read_manifest(Path(copy)).checksum == checksum

            await wait_until(written, what=f"step {step}'s weights to be written out", timeout=30)
        kept = Path(controller.health().servers[0].verified_checkpoint or "")

        def only_kept() -> bool:
            # The older copies go once the newest is recorded, after it: renamed, then removed.
            try:
                copies = {p.parent for p in controller.fleet.state_dir.rglob(MANIFEST_NAME) if "snapshots" in p.parts}
                hidden = [p for p in kept.parent.iterdir() if p.name.startswith(".")]
            except FileNotFoundError:
                return False  # one was being removed as it was listed
            return copies == {kept} and not hidden

        await wait_until(only_kept, what="only the newest write-out left", timeout=30)
        restarts = cell.restarts
        kill(controller, "tiny-0")
        await wait_until(lambda: cell.restarts > restarts and cell.state is ServerState.SERVING, what="the restart")
        report = controller.health().servers[0]
        assert (report.weight_version, report.checksum) == ("803", checksum)
    finally:
        await publisher.close()
        await controller.reconfigure({"write_out_interval_s": 2.0})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(checkpoints: dict[str, Path]) -> AsyncIterator[tuple[AsyncInferenceController, httpx.AsyncClient]]:
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2, request_timeout_s=600) as (
        controller,
        url,
    ):
        async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as http:
            yield controller, http


async def test_requests_outlive_the_crash_of_every_server(pair) -> None:
    controller, http = pair
    reference = (await http.post("/generate", json=LONG)).json()["output_ids"]
    cells = [controller.fleet.rollout(None).cell(sid) for sid in ("tiny-0", "tiny-1")]
    pending = [asyncio.create_task(http.post("/generate", json=LONG)) for _ in range(4)]
    for cell in cells:
        await wait_running(cell.url)
    for cell in cells:
        kill(controller, cell.server_id)
    answers = await asyncio.wait_for(asyncio.gather(*pending), timeout=120)
    assert [a.status_code for a in answers] == [200] * 4
    assert all(a.json()["output_ids"] == reference for a in answers)


@pytest.mark.parametrize("same_label", [False, True], ids=["new-label", "same-label"])
async def test_weights_changed_behind_the_controller_are_quarantined_and_restored(
    pair,
    checkpoints: dict[str, Path],
    same_label: bool,
) -> None:
    controller, http = pair
    server = controller.fleet.rollout(None)
    cell = server.cell("tiny-1")
    await wait_until(lambda: cell.state is ServerState.SERVING, what="tiny-1 serving")
    verified = cell.verified
    assert verified is not None
    mark = len(controller.event_logger.events)
    label = verified.weight_version if same_label else "999"
    other = checkpoints["v4"]
    async with httpx.AsyncClient(timeout=60, trust_env=False) as direct:
        # Someone holding the engine's secret (leaked, or a bug) loads other weights straight
        # into the engine, bypassing the controller.
        tampered = await direct.post(
            f"{cell.url}/update_weights_from_disk",
            json={"model_path": str(other), "weight_version": label},
            headers={"authorization": f"Bearer {controller.engine_secret}"},
        )
        assert tampered.json()["success"] is True

    def reported() -> bool:
        events = list(controller.event_logger.events)[mark:]
        return any(isinstance(e, ChecksumMismatchEvent) and e.server_id == "tiny-1" for e in events)

    await wait_until(reported, what="the drift to be reported")
    event = next(e for e in list(controller.event_logger.events)[mark:] if isinstance(e, ChecksumMismatchEvent))
    assert event.update_id is None
    assert (event.expected, event.actual) == (verified.checksum, read_manifest(other).checksum)
    await wait_until(lambda: cell.state is ServerState.SERVING, what="tiny-1 restored")
    confirmed = await server.confirm("tiny-1")
    assert (confirmed.checksum, confirmed.weight_version) == (verified.checksum, verified.weight_version)
    states = [
        e.to_state
        for e in list(controller.event_logger.events)[mark:]
        if getattr(e, "server_id", None) == "tiny-1" and hasattr(e, "to_state")
    ]
    assert "quarantined" in states

"""What the controller does at the edges of a vLLM server's life, against a scripted fake vLLM
server (``vllm_fake.py``; the client, the rollout, the supervisor and the controller are real):

- the worker is asked its identity at most every 30 s and after each change of its weights,
  ``/health`` answering for it between (a vLLM worker busy-polls a core after every call);
- a busy worker's last identity stands while its server answers ``/health``, up to 120 s;
- a call into the worker of a server that lost its engine fails at once, not at its timeout.

The client's timings are injected (``WorkerCadence``, a clock the test moves), so nothing waits
30 s; under a controller, the cadence's defaults where the test can wait for them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from vllm_fake import FakeVLLM

from miles.controller.results import UpdateStatus
from miles.protocol.sglang_weights import UpdateWeightsFromDiskRequest
from miles.rollout.engine_client import EngineCallError, EngineClient
from miles.rollout.state import ServerState
from miles.rollout.vllm_client import VLLMClient, WorkerCadence
from miles.rollout.vllm_rollout import VLLMRollout
from miles.testing import running_controller, wait_until
from miles.weights.checkpoint import read_manifest

Rounds = Callable[..., Awaitable[None]]


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake(checkpoints: dict[str, Path]) -> Iterator[tuple[FakeVLLM, str]]:
    """A fake vLLM server holding ``v1``, and its URL."""
    server = FakeVLLM(holds=read_manifest(checkpoints["v1"]).checksum)
    with server.running() as url:
        yield server, url


@pytest_asyncio.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        yield client


Probed = tuple[FakeVLLM, VLLMClient, Clock]


@pytest.fixture
def probed(fake: tuple[FakeVLLM, str], http: httpx.AsyncClient) -> Probed:
    """The fake server, a client of it with the default cadence, and the clock the client reads."""
    server, url = fake
    clock = Clock()
    return server, VLLMClient(url, http=http, server_id="vllm-0", clock=clock), clock


async def test_the_worker_is_asked_its_identity_at_most_every_30_s_and_after_each_change_of_its_weights(
    probed: Probed, checkpoints: dict[str, Path]
) -> None:
    server, client, clock = probed
    for _ in range(5):
        identity = await client.weight_identity(timeout=5)
    assert identity.checksum == server.holds and identity.instance_id == server.instance_id
    # Asked once; /health answered for it the four times after.
    assert (server.calls["miles_identity"], server.calls["health"]) == (1, 4)
    clock.advance(29.9)
    await client.weight_identity(timeout=5)
    assert server.calls["miles_identity"] == 1
    clock.advance(0.1)
    await client.weight_identity(timeout=5)
    assert server.calls["miles_identity"] == 2
    # Its weights change: the next probe asks it, however recent the last answer.
    v2 = read_manifest(checkpoints["v2"]).checksum
    load = UpdateWeightsFromDiskRequest(model_path=str(checkpoints["v2"]), expected_checksum=v2, weight_version="2")
    assert (await client.update_weights_from_disk(load)).checksum == v2
    identity = await client.weight_identity(timeout=5)
    assert (server.calls["miles_identity"], identity.checksum, identity.weight_version) == (3, v2, "2")


async def test_a_busy_workers_last_identity_stands_while_its_server_answers_health_for_120_s(probed: Probed) -> None:
    server, client, clock = probed
    first = await client.weight_identity(timeout=5)
    server.busy()
    clock.advance(30)
    # Asked, unanswered within the probe's timeout: the last answer stands, for 120 s.
    assert await client.weight_identity(timeout=0.2) == first
    clock.advance(120)
    assert await client.weight_identity(timeout=0.2) == first
    assert server.calls["miles_identity"] == 3
    clock.advance(0.1)
    with pytest.raises(EngineCallError):
        await client.weight_identity(timeout=0.2)
    # Free again, it answers, and a later busy spell is given its own 120 s.
    server.free()
    assert await client.weight_identity(timeout=5) == first
    server.busy()
    clock.advance(30)
    assert await client.weight_identity(timeout=0.2) == first


async def test_a_busy_workers_last_identity_does_not_stand_once_its_server_fails_health(probed: Probed) -> None:
    server, client, clock = probed
    await client.weight_identity(timeout=5)
    server.lose_engine()
    clock.advance(30)
    with pytest.raises(EngineCallError):
        await client.weight_identity(timeout=0.2)


async def test_a_call_into_a_worker_whose_server_lost_its_engine_fails_at_once_not_at_its_timeout(
    fake: tuple[FakeVLLM, str], http: httpx.AsyncClient
) -> None:
    server, url = fake
    client = VLLMClient(url, http=http, server_id="vllm-0", cadence=WorkerCadence(watch_s=0.05))
    # A busy worker on a server that answers /health is waited for, watch after watch.
    server.busy()
    call = asyncio.create_task(client.weights_checksum(timeout=60))
    watched = server.calls["health"]
    await wait_until(lambda: server.calls["health"] >= watched + 5, what="five watches of the call")
    assert not call.done()
    server.free()
    assert (await call).checksum == server.holds
    # Its server loses its engine: the call fails within two watches, not after its 60 s.
    server.lose_engine()
    started = time.monotonic()
    with pytest.raises(EngineCallError, match="engine died"):
        await client.weights_checksum(timeout=60)
    assert time.monotonic() - started < 5


async def test_under_a_controller_the_worker_is_asked_once_while_health_answers_and_again_after_an_update(
    fake: tuple[FakeVLLM, str], checkpoints: dict[str, Path], supervisor_rounds: Rounds
) -> None:
    server, url = fake
    spec = {"cls": "VLLMRollout", "checkpoint": checkpoints["v1"], "urls": [url]}
    async with running_controller({"tiny": spec}, http=False, health_interval_s=0.05) as (ctl, _):
        rollout = ctl.fleet.rollout("tiny")
        await supervisor_rounds(rollout, 2)
        asked, health = server.calls["miles_identity"], server.calls["health"]
        await supervisor_rounds(rollout, 20)
        assert server.calls["miles_identity"] == asked and server.calls["health"] >= health + 20
        result = await ctl.update_rollout_weights(checkpoints["v2"], model_name="tiny")
        assert result.status is UpdateStatus.COMMITTED, result.message
        await supervisor_rounds(rollout, 2)
        assert server.calls["miles_identity"] == asked + 1
        await supervisor_rounds(rollout, 20)
        assert server.calls["miles_identity"] == asked + 1
        assert rollout.snapshot()[0].checksum == read_manifest(checkpoints["v2"]).checksum


def vllm_rollout_with(cadence: WorkerCadence) -> type[VLLMRollout]:
    """VLLMRollout whose clients ask and watch their workers at ``cadence``."""

    class Rollout(VLLMRollout):
        def new_client(self, url: str, *, server_id: str, http: httpx.AsyncClient, secret: str | None) -> EngineClient:
            return VLLMClient(url, http=http, server_id=server_id, cadence=cadence)

    return Rollout


async def test_under_a_controller_a_busy_worker_stays_serving_until_its_server_fails_health(
    fake: tuple[FakeVLLM, str], checkpoints: dict[str, Path], supervisor_rounds: Rounds
) -> None:
    server, url = fake
    # Asked at every probe, so that the busy worker is asked.
    spec = {"cls": vllm_rollout_with(WorkerCadence(identity_every_s=0)), "checkpoint": checkpoints["v1"], "urls": [url]}
    settings = {"health_interval_s": 0.05, "health_timeout_s": 0.2, "health_failure_threshold": 2}
    async with running_controller({"tiny": spec}, http=False, **settings) as (ctl, _):
        rollout = ctl.fleet.rollout("tiny")
        await supervisor_rounds(rollout, 2)
        server.busy()
        asked = server.calls["miles_identity"]
        await supervisor_rounds(rollout, 10)
        # Asked at every probe, answering none: serving on, from its last answer.
        assert server.calls["miles_identity"] >= asked + 10
        snap = rollout.snapshot()[0]
        assert (snap.state, snap.restarts, snap.consecutive_failures) == (ServerState.SERVING, 0, 0)
        server.lose_engine()
        await wait_until(
            lambda: rollout.snapshot()[0].state is not ServerState.SERVING,
            timeout=10,
            what="the server taken out once its /health fails",
        )


async def test_under_a_controller_an_update_into_a_worker_whose_server_lost_its_engine_fails_in_seconds(
    fake: tuple[FakeVLLM, str], checkpoints: dict[str, Path]
) -> None:
    server, url = fake
    spec = {"cls": vllm_rollout_with(WorkerCadence(watch_s=0.2)), "checkpoint": checkpoints["v1"], "urls": [url]}
    async with running_controller({"tiny": spec}, http=False, update_timeout_s=300) as (ctl, _):
        server.lose_engine()
        started = time.monotonic()
        result = await ctl.update_rollout_weights(checkpoints["v2"], model_name="tiny")
        # Its load waited on a worker that will never answer: it failed after two watches of
        # /health, not after the update's 300 s.
        assert result.status is not UpdateStatus.COMMITTED
        assert "engine died" in result.message, result.message
        assert time.monotonic() - started < 10

"""Nodes that die: a node lost while serving, and one lost in the middle of an update.

The lost server is re-created on a node with free resources, loads the last verified weights,
confirms their checksum and only then gets requests; requests in flight on the dead node are
retried elsewhere when they had produced nothing yet; nothing else fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.controller.core import AsyncInferenceController
from miles.controller.results import UpdateStatus
from miles.ray.cluster import LocalCluster, NodeSpec, connect
from miles.rollout.state import ServerState
from miles.testing import running_controller, wait_until
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three GPU workers for two engines: a lost node's server has somewhere to go."""
    cluster = LocalCluster([NodeSpec(num_cpus=1, num_gpus=1) for _ in range(3)])
    try:
        cluster.start()
        connect(cluster.address)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def three_workers(cluster: LocalCluster) -> LocalCluster:
    """The cluster with three GPU workers again (an earlier test may have lost one)."""
    while len(cluster.worker_nodes) < 3:
        cluster.add_node(NodeSpec(num_cpus=1, num_gpus=1))
    return cluster


def node_of(cluster: LocalCluster, node_id: str) -> object:
    (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
    return node


class Traffic:
    """Clients sending requests through the controller until stopped; every outcome counted."""

    def __init__(self, url: str, clients: int = 3, max_new_tokens: int = 8) -> None:
        self.url, self.clients, self.max_new_tokens = url, clients, max_new_tokens
        self.outcomes: Counter[int] = Counter()
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _client(self) -> None:
        body = {"text": "abc", "sampling_params": {"max_new_tokens": self.max_new_tokens}}
        async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
            while not self._stop.is_set():
                answer = await http.post(f"{self.url}/generate", json=body)
                self.outcomes[answer.status_code] += 1
                if answer.status_code != 200:
                    self.errors.append(answer.text)

    def __enter__(self) -> Traffic:
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.clients)]
        return self

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()

    @property
    def served(self) -> int:
        return self.outcomes[200]


def settings() -> dict[str, object]:
    return {
        "runtime": "ray",
        "num_cpus_per_engine": 0.1,
        "num_gpus_per_engine": 1,
        "placement_strategy": "SPREAD",
        "startup_timeout_s": 120.0,
        "health_interval_s": 0.5,
    }


async def recovered(ctl: AsyncInferenceController, server_id: str, *, restarts: int, lost_node: str) -> None:
    def back() -> bool:
        server = next(s for s in ctl.health().servers if s.server_id == server_id)
        return server.state is ServerState.SERVING and server.restarts > restarts and server.node_id != lost_node

    await wait_until(back, what=f"{server_id} to serve again on another node", timeout=120)


def assert_serving_verified(ctl: AsyncInferenceController) -> None:
    for server in ctl.health().servers:
        assert server.state is ServerState.SERVING, server
        verified = read_manifest(Path(server.verified_checkpoint)) if server.verified_checkpoint else None
        assert verified is None or server.checksum == verified.checksum, server


async def test_a_node_lost_while_serving_is_replaced_and_no_request_is_lost(
    three_workers: LocalCluster, checkpoints: dict[str, Path]
) -> None:
    cluster = three_workers
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2, **settings()) as (ctl, url):
        assert url is not None
        victim = ctl.health().servers[0]
        with Traffic(url) as traffic:
            await wait_until(lambda: traffic.served >= 6, what="traffic to flow")
            cluster.remove_node(node_of(cluster, victim.node_id))
            await recovered(ctl, victim.server_id, restarts=victim.restarts, lost_node=victim.node_id)
            served = traffic.served
            await wait_until(lambda: traffic.served >= served + 6, what="traffic after the recovery")
            await traffic.stop()
        # Requests in flight on the lost node had produced nothing yet: retried elsewhere.
        assert dict(traffic.outcomes) == {200: traffic.served}, traffic.errors[:3]
        replaced = next(s for s in ctl.health().servers if s.server_id == victim.server_id)
        assert replaced.checksum == read_manifest(checkpoints["v1"]).checksum
        assert_serving_verified(ctl)


async def test_a_node_lost_in_the_middle_of_an_update_is_recovered(
    three_workers: LocalCluster, checkpoints: dict[str, Path]
) -> None:
    cluster = three_workers
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2, **settings()) as (ctl, url):
        assert url is not None
        victim = ctl.health().servers[1]
        # Long generations keep the update draining while the node goes away.
        with Traffic(url, clients=2, max_new_tokens=64) as traffic:
            await wait_until(lambda: traffic.served >= 2, what="traffic to flow")
            update = asyncio.create_task(ctl.update_rollout_weights(checkpoints["v2"], pause_mode="drain"))
            await wait_until(lambda: ctl.health().lock.held, what="the update to take the lock", interval=0)
            cluster.remove_node(node_of(cluster, victim.node_id))
            result = await asyncio.wait_for(update, timeout=120)
            await recovered(ctl, victim.server_id, restarts=victim.restarts, lost_node=victim.node_id)
            # Whatever the update could do, no server serves weights it was not verified on.
            if result.status is not UpdateStatus.COMMITTED:
                retry = await ctl.update_rollout_weights(checkpoints["v2"])
                assert retry.status is UpdateStatus.COMMITTED, retry.message
            await traffic.stop()
        assert dict(traffic.outcomes) == {200: traffic.served}, traffic.errors[:3]
        v2 = read_manifest(checkpoints["v2"]).checksum
        assert all(s.checksum == v2 and s.state is ServerState.SERVING for s in ctl.health().servers)


def launcher_of(pid: int) -> int:
    """The process that launched engine ``pid``: its parent, or its forkserver's parent."""
    parent = int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])
    if b"miles.engine.forkserver" in Path(f"/proc/{parent}/cmdline").read_bytes():
        return launcher_of(parent)
    return parent


async def test_an_engine_actor_killed_outright_is_replaced(
    three_workers: LocalCluster, checkpoints: dict[str, Path]
) -> None:
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=1, **settings()) as (ctl, url):
        assert url is not None
        (before,) = ctl.health().servers
        assert before.pid is not None
        # Kill -9 the actor's worker process, as an OOM killer would. It launched the engine,
        # which its forkserver forked: the engine's grandparent (its parent without a forkserver).
        os.kill(launcher_of(before.pid), signal.SIGKILL)

        def replaced() -> bool:
            (server,) = ctl.health().servers
            return server.state is ServerState.SERVING and server.restarts > before.restarts

        await wait_until(replaced, what="the server to be replaced", timeout=120)
        (after,) = ctl.health().servers
        assert after.pid != before.pid and after.checksum == read_manifest(checkpoints["v1"]).checksum
        async with httpx.AsyncClient(trust_env=False) as http:
            answer = await http.post(f"{url}/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 2}})
        assert answer.status_code == 200

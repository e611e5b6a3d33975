"""The Ray runtime on a real local cluster: placement, device ids, updates across nodes, shipping
checkpoints to nodes without a shared filesystem, placement that cannot be satisfied, and the
named controller reached from another driver, and pushed to through its handle."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import ray
from transformers import AutoModelForCausalLM

from miles.controller.results import UpdateStatus
from miles.errors import MilesError
from miles.ray.cluster import LocalCluster
from miles.ray.controller import serve_controller, stop_controller
from miles.rollout.state import ServerState
from miles.testing import running_controller
from miles.train.push import PushPublisher
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import saved_state_dict

pytestmark = pytest.mark.timeout(300)

ENGINE_CPUS = 0.1  # what each engine asks of a node: two cores would run out of whole CPUs


def ray_settings(**overrides: object) -> dict[str, object]:
    return {"runtime": "ray", "num_cpus_per_engine": ENGINE_CPUS, "startup_timeout_s": 120.0, **overrides}


def gpu_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")}


async def test_engines_spread_over_nodes_on_the_gpus_ray_assigned_and_update_together(
    ray_cluster: LocalCluster, checkpoints: dict[str, Path]
) -> None:
    settings = ray_settings(num_gpus_per_engine=1, placement_strategy="SPREAD")
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=4, **settings) as (ctl, url):
        servers = ctl.health().servers
        # Spread over both GPU nodes, one GPU each: no two engines share a (node, GPU).
        assert {s.node_id for s in servers} == gpu_nodes()
        assert sorted((s.node_id, tuple(s.gpu_ids)) for s in servers) == sorted(
            {(s.node_id, tuple(s.gpu_ids)) for s in servers}
        )
        assert all(len(s.gpu_ids) == 1 and s.node_address == "127.0.0.1" for s in servers)
        # Each engine reports the node and GPUs Ray gave its bundle, and the device it would use:
        # the first of them with CUDA, the CPU on this machine.
        auth = {"authorization": f"Bearer {ctl.engine_secret}"}
        async with httpx.AsyncClient(trust_env=False, headers=auth) as http:
            for server in servers:
                info = (await http.get(f"{server.url}/get_server_info")).json()
                assert (info["node_id"], info["gpu_ids"], info["base_gpu_id"]) == (
                    server.node_id,
                    server.gpu_ids,
                    server.gpu_ids[0],
                )
                assert info["device"] == server.device == "cpu"

            result = await ctl.update_rollout_weights(checkpoints["v2"])
            assert result.status is UpdateStatus.COMMITTED, result.message
            v2 = read_manifest(checkpoints["v2"])
            after = ctl.health().servers
            assert all(s.state is ServerState.SERVING and s.checksum == v2.checksum for s in after)
            assert {s.node_id for s in after} == gpu_nodes()
            # Every engine, asked directly, holds the published weights.
            for server in after:
                held = (await http.get(f"{server.url}/get_weight_version")).json()
                assert (held["weight_version"], held["checksum"]) == (v2.weight_version, v2.checksum)
            # Requests routed by the controller are served by engines on other nodes.
            answers = [
                await http.post(f"{url}/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 2}})
                for _ in range(4)
            ]
            assert all(a.status_code == 200 and a.json()["meta_info"]["weight_version"] == "2" for a in answers)


async def test_fractional_gpus_share_a_device_when_the_spec_asks(
    ray_cluster: LocalCluster, checkpoints: dict[str, Path]
) -> None:
    settings = ray_settings(num_gpus_per_engine=0.5, placement_strategy="PACK")
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2, http=False, **settings) as (
        ctl,
        _,
    ):
        servers = ctl.health().servers
        assert len({(s.node_id, tuple(s.gpu_ids)) for s in servers}) == 1, servers


async def test_a_placement_the_cluster_cannot_give_fails_fast_naming_what_is_missing(
    ray_cluster: LocalCluster, checkpoints: dict[str, Path]
) -> None:
    settings = ray_settings(num_gpus_per_engine=3, startup_timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(MilesError, match=r"no node has GPU 3 \(the largest has 2\)"):
        async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=1, http=False, **settings):
            pass
    assert time.monotonic() - started < 30
    # Nothing is left reserved.
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


async def test_engines_without_a_shared_filesystem_load_shipped_verified_copies(
    ray_cluster: LocalCluster, checkpoints: dict[str, Path]
) -> None:
    settings = ray_settings(num_gpus_per_engine=1, checkpoint_transfer="ship")
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=1, http=False, **settings) as (
        ctl,
        _,
    ):
        (server,) = ctl.health().servers
        auth = {"authorization": f"Bearer {ctl.engine_secret}"}
        async with httpx.AsyncClient(trust_env=False, headers=auth) as http:
            info = (await http.get(f"{server.url}/get_server_info")).json()
            # The engine started from a copy shipped into its node's own directory...
            assert Path(info["model_path"]) != checkpoints["v1"] and "shipped" in info["model_path"]
            # ...and may read nothing outside it: the controller's path is refused.
            refused = await http.post(
                f"{server.url}/update_weights_from_disk", json={"model_path": str(checkpoints["v2"])}
            )
            assert refused.status_code in (400, 403) and not refused.json().get("success", False)

            result = await ctl.update_rollout_weights(checkpoints["v2"])
            assert result.status is UpdateStatus.COMMITTED, result.message
            info = (await http.get(f"{server.url}/get_server_info")).json()
            assert "shipped" in info["model_path"] and info["checksum"] == read_manifest(checkpoints["v2"]).checksum


DRIVER = textwrap.dedent(
    """
    import sys, ray
    from miles.ray.controller import get_controller

    controller = get_controller(address=sys.argv[1])
    before = ray.get(controller.health.remote())
    result = ray.get(controller.update_rollout_weights.remote(sys.argv[2]))
    after = ray.get(controller.health.remote())
    print(before.models['tiny'].weight_version, result.status.value, after.models['tiny'].weight_version)
    """
)


def test_training_in_another_driver_reaches_the_named_controller(
    ray_cluster: LocalCluster, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    controller = serve_controller(
        model_checkpoint=checkpoints["v1"],
        num_servers=1,
        port=0,
        num_cpus_per_engine=ENGINE_CPUS,
        ray_address=ray_cluster.address,
    )
    try:
        url = ray.get(controller.url.remote())
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        done = subprocess.run(
            [sys.executable, str(script), ray_cluster.address, str(checkpoints["v2"])],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split()[-3:] == ["1", "committed", "2"]
        # The HTTP API runs on the controller's node too.
        health = httpx.get(f"{url}/health", trust_env=False).json()
        assert health["models"]["tiny"]["weight_version"] == "2"
    finally:
        stop_controller(controller)


def test_training_pushes_through_the_named_controllers_handle(
    ray_cluster: LocalCluster, checkpoints: dict[str, Path]
) -> None:
    """``PushPublisher`` given the actor handle: the window is opened, renewed, published to and
    ended through the actor, the weights go straight to the engines."""
    controller = serve_controller(
        model_checkpoint=checkpoints["v1"],
        num_servers=1,
        port=0,
        num_cpus_per_engine=ENGINE_CPUS,
        ray_address=ray_cluster.address,
    )
    try:
        weights = saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoints["v2"]))
        result = asyncio.run(PushPublisher(controller, path="shm", timeout_s=60).push(weights, step=7))
        assert result.checksum == read_manifest(checkpoints["v2"]).checksum
        health = ray.get(controller.health.remote())
        assert health.models["tiny"].weight_version == "7"
    finally:
        stop_controller(controller)

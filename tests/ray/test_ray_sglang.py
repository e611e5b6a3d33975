"""SGLangRollout on Ray: SGLang servers launched by actors on placement-group bundles, each given
its bundle's first GPU as SGLang's --base-gpu-id, checked by the runtime against what the server
reports. SGLang cannot run here: the test suite's stand-in for ``sglang.launch_server`` (it takes
SGLang's flags and runs the embedded engine) is the launcher."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray

from miles.controller.results import UpdateStatus
from miles.ray.cluster import LocalCluster
from miles.rollout.state import ServerState
from miles.testing import running_controller
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.timeout(300)

STANDIN = [sys.executable, str(Path(__file__).parents[1] / "rollout" / "sglang_standin.py")]


async def test_sglang_servers_on_bundles_get_their_gpus_and_update(
    ray_cluster: LocalCluster, checkpoints: dict[str, Path]
) -> None:
    fleet = {
        "policy": {
            "cls": "miles.rollout.sglang_rollout.SGLangRollout",
            "checkpoint": str(checkpoints["v1"]),
            "num_servers": 2,
            "sglang": {"launcher": STANDIN},
        }
    }
    settings = {
        "runtime": "ray",
        "num_cpus_per_engine": 0.1,
        "num_gpus_per_engine": 1,
        "placement_strategy": "SPREAD",
        "startup_timeout_s": 120.0,
    }
    async with running_controller(fleet, None, **settings) as (controller, _):
        servers = controller.health().servers
        gpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")}
        assert {s.node_id for s in servers} == gpu_nodes
        assert all(len(s.gpu_ids) == 1 and not s.attached for s in servers)
        for server in servers:
            info = await controller.fleet.rollout(None).client(server.server_id).server_info()
            assert info["base_gpu_id"] == server.gpu_ids[0]
        result = await controller.update_rollout_weights(checkpoints["v2"])
        assert result.status is UpdateStatus.COMMITTED, result.message
        v2 = read_manifest(checkpoints["v2"]).checksum
        assert all(s.state is ServerState.SERVING and s.checksum == v2 for s in controller.health().servers)

"""Joining a Ray cluster, and a cluster of several nodes on this machine (the demo's and the tests').

``connect`` is how every miles component reaches Ray. ``LocalCluster`` starts a head and worker
nodes on loopback, with logical CPUs and GPUs, in a temporary directory it removes when it stops.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import ray
from ray._private import ray_constants

NAMESPACE = "miles"
logger = logging.getLogger("miles.ray")

# Ray 2.60 binds every node to 127.0.0.1 with this set to 0 (and to the machine's routable
# address otherwise); a cluster on one machine has no reason to listen anywhere else.
_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# How fast a lost node is declared dead (Ray's defaults take ~30 s).
_NODE_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 4}


def connect(address: str | None = None, *, namespace: str = NAMESPACE) -> bool:
    """Join a Ray cluster unless already connected; True when it started a new one (its resources ours to
    share). ``address``: "auto", a head's "HOST:PORT", or None (a new one on loopback, ending with us)."""
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"namespace": namespace, "log_to_driver": False}
    if address is None:
        # A new cluster of this process alone: on loopback (see LocalCluster.start for why both).
        os.environ.update(_LOOPBACK_ENV)
        ray_constants.ENABLE_RAY_CLUSTER = False
        options |= {"include_dashboard": False, "_node_ip_address": "127.0.0.1"}
    else:
        options["address"] = address
        if address.removeprefix("ray://").rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
            # A cluster on this machine's loopback: the driver must not bind anywhere else.
            options["_node_ip_address"] = "127.0.0.1"
    ray.init(**options)
    logger.info("connected to the Ray cluster at %s", ray.get_runtime_context().gcs_address)
    return address is None


@dataclass(frozen=True)
class NodeSpec:
    """One node of a local cluster: logical resources only (Ray schedules by them)."""

    num_cpus: float = 1.0
    num_gpus: int = 0


class LocalCluster:
    """A head node and worker nodes on this machine, on loopback (``start`` / ``stop``)."""

    # The temp dirs of the clusters this process stopped. Ray's driver makes an earlier cluster's
    # session directory again (empty) when this process starts the next one, after a node of the
    # earlier one was lost outright: each stop removes them all again.
    _stopped: ClassVar[list[Path]] = []

    def __init__(
        self, workers: Sequence[NodeSpec] = (NodeSpec(), NodeSpec()), *, head: NodeSpec = NodeSpec(num_cpus=1.0)
    ) -> None:
        self.workers = list(workers)
        self.head = head
        self._cluster: Any = None
        self._temp_dir: Path | None = None
        self._environ: dict[str, str | None] = {}
        self._cluster_mode: bool | None = None
        self.worker_nodes: list[Any] = []

    @property
    def address(self) -> str:
        assert self._cluster is not None, "the cluster is not started"
        return str(self._cluster.address)

    def start(self) -> LocalCluster:
        from ray.cluster_utils import Cluster

        # Short: Ray's socket paths live under it and must stay within the OS's 107 bytes.
        self._temp_dir = Path(tempfile.mkdtemp(prefix="miles-ray-", dir="/tmp"))
        # Ray writes under RAY_TMPDIR (not /tmp/ray) and binds loopback; token authentication is
        # off for a cluster only this machine's loopback can reach.
        for key, value in {**_LOOPBACK_ENV, "RAY_TMPDIR": str(self._temp_dir), "RAY_AUTH_MODE": "disabled"}.items():
            self._environ.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        # The nodes' processes read the variable when they start; this process read it when it
        # imported Ray, and Ray consults the value it read then.
        self._cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False
        try:
            head = {
                "node_ip_address": "127.0.0.1",
                "num_cpus": self.head.num_cpus,
                "num_gpus": self.head.num_gpus,
                "include_dashboard": False,
                "_system_config": _NODE_HEALTH,
            }
            self._cluster = Cluster(initialize_head=True, head_node_args=head)
            self.worker_nodes = [self._add(w) for w in self.workers]
            self._cluster.wait_for_nodes()
        except BaseException:
            self.stop()
            raise
        return self

    def _add(self, spec: NodeSpec) -> Any:
        return self._cluster.add_node(node_ip_address="127.0.0.1", num_cpus=spec.num_cpus, num_gpus=spec.num_gpus)

    def add_node(self, spec: NodeSpec) -> Any:
        node = self._add(spec)
        self._cluster.wait_for_nodes()
        self.worker_nodes.append(node)
        return node

    def remove_node(self, node: Any) -> None:
        """Lose a node at once, as when a machine dies (its raylet and workers are killed)."""
        self.worker_nodes.remove(node)
        self._cluster.remove_node(node, allow_graceful=False)

    def stop(self) -> None:
        """Disconnect this process and stop every node; restores the environment; idempotent."""
        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
        for key, value in self._environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._environ.clear()
        if self._cluster_mode is not None:
            ray_constants.ENABLE_RAY_CLUSTER = self._cluster_mode
            self._cluster_mode = None
        if self._temp_dir is not None:
            LocalCluster._stopped.append(self._temp_dir)
            self._temp_dir = None
        for directory in LocalCluster._stopped:
            shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def local_cluster(workers: Sequence[NodeSpec] = (NodeSpec(), NodeSpec()), **options: Any) -> Iterator[LocalCluster]:
    """A started ``LocalCluster``, stopped on exit even when the body fails."""
    cluster = LocalCluster(workers, **options)
    try:
        yield cluster.start()
    finally:
        cluster.stop()

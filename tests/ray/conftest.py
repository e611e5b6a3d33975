"""A Ray cluster of several nodes on this machine, on loopback, for the Ray runtime's tests.

Each node is declared with CPUs and logical GPUs (Ray schedules by them; the engines run on the
CPU). Actors ask for fractions of a CPU: two cores would run out of whole ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from miles.ray.cluster import LocalCluster, NodeSpec, connect


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalCluster]:
    """A head without GPUs and two workers with two logical GPUs each; this process connected."""
    cluster = LocalCluster([NodeSpec(num_cpus=1, num_gpus=2), NodeSpec(num_cpus=1, num_gpus=2)])
    try:
        cluster.start()
        connect(cluster.address)
        yield cluster
    finally:
        cluster.stop()

"""Whether a rollout's placement group fits the cluster, decided before waiting on it (pure
arithmetic over a cluster's resources, from tables; no cluster started)."""

from __future__ import annotations

import pytest

from miles.ray.placement import ClusterView, Fit, engine_cpu_share, judge, largest_fitting, placeable

# One node of two CPUs, 0.1 of them held by the controller's actor (what `miles serve --ray`
# starts on a two-core machine).
TWO_CORES = ClusterView(capacity=({"CPU": 1.9},), free={"CPU": 1.9}, held={"CPU": 0.1})
# A head without GPUs and two workers of one CPU and two GPUs each (the Ray tests' cluster).
THREE_NODES = ClusterView(
    capacity=({"CPU": 1.0, "GPU": 0.0}, {"CPU": 1.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 2.0}),
    free={"CPU": 3.0, "GPU": 4.0},
)


@pytest.mark.parametrize(
    ("bundle", "capacity", "expected"),
    [
        ({"CPU": 0.95}, ({"CPU": 1.9},), 2),
        ({"CPU": 1.0}, ({"CPU": 1.9},), 1),
        # Fixed point, as Ray counts: three bundles of 0.1 fill 0.3 exactly.
        ({"CPU": 0.1}, ({"CPU": 0.3},), 3),
        # A bundle never spans nodes: 0.6 fits once on each one-CPU node, not three times in 2.
        ({"CPU": 0.6}, ({"CPU": 1.0}, {"CPU": 1.0}), 2),
        ({"CPU": 0.1, "GPU": 1.0}, THREE_NODES.capacity, 4),
        ({"CPU": 0.1, "GPU": 3.0}, THREE_NODES.capacity, 0),
    ],
)
def test_placeable_counts_whole_bundles_per_node(
    bundle: dict[str, float], capacity: tuple[dict[str, float], ...], expected: int
) -> None:
    assert placeable(bundle, capacity) == expected


def test_what_the_machine_cannot_hold_is_impossible_with_the_flag_and_a_share_that_fits() -> None:
    verdict = judge({"CPU": 8.0}, count=2, view=TWO_CORES)
    assert verdict.fit is Fit.IMPOSSIBLE
    assert verdict.message == (
        "2 engines need 8 CPUs each (16 in all), the cluster has 1.9 CPUs free (2 in all, 0.1 held by this "
        "controller): lower --cpus-per-engine (num_cpus_per_engine; 0.95 would fit) or add nodes"
    )
    # One CPU each is the old default that waited 180 s on two cores: the controller's own share
    # is never released while it waits, so this too is refused at once.
    assert judge({"CPU": 1.0}, count=2, view=TWO_CORES).fit is Fit.IMPOSSIBLE
    assert judge({"CPU": 0.95}, count=2, view=TWO_CORES).fit is Fit.FITS


def test_a_bundle_larger_than_any_node_names_the_largest() -> None:
    verdict = judge({"CPU": 0.1, "GPU": 3.0}, count=1, view=THREE_NODES)
    assert verdict.fit is Fit.IMPOSSIBLE
    assert "no node has GPU 3 (the largest has 2)" in verdict.message
    assert "lower --gpus-per-engine (num_gpus_per_engine; 2 would fit) or add nodes" in verdict.message
    assert "CPU" not in verdict.message  # the CPUs are not what is missing


def test_enough_in_all_but_held_by_others_now_is_worth_the_bounded_wait() -> None:
    busy = ClusterView(capacity=({"CPU": 4.0},), free={"CPU": 0.5})
    verdict = judge({"CPU": 1.0}, count=2, view=busy)
    assert verdict.fit is Fit.SHORT_NOW
    assert verdict.message == "2 engines need 1 CPU each (2 in all), the cluster has 0.5 CPUs free (4 in all)"


def test_the_largest_fitting_share_respects_nodes_and_rounds_down() -> None:
    assert largest_fitting({"CPU": 8.0}, "CPU", count=2, capacity=TWO_CORES.capacity) == 0.95
    assert largest_fitting({"CPU": 1.0}, "CPU", count=3, capacity=({"CPU": 1.0}, {"CPU": 1.0})) == 0.5
    assert largest_fitting({"CPU": 1.0}, "CPU", count=3, capacity=({"CPU": 2.0},)) == 0.66
    assert largest_fitting({"CPU": 0.1, "GPU": 1.0}, "CPU", count=9, capacity=THREE_NODES.capacity) == 0.0


@pytest.mark.parametrize(
    ("cpus", "engines", "reserved", "expected"),
    [
        (2.0, 2, 0.1, 0.95),  # `miles serve --ray --servers 2` on two cores
        (2.0, 1, 0.1, 1.0),  # at most one each
        (16.0, 4, 0.1, 1.0),
        (2.0, 3, 0.1, 0.63),
        (2.0, 4, 1.1, 0.22),  # another model's engines asked for one CPU of their own
        (2.0, 64, 0.1, 0.02),
        (1.0, 400, 0.1, 0.01),  # too many to share: the smallest step, which judge then refuses
    ],
)
def test_the_default_share_splits_the_clusters_cpus_between_the_engines(
    cpus: float, engines: int, reserved: float, expected: float
) -> None:
    share = engine_cpu_share(cpus=cpus, engines=engines, reserved=reserved)
    assert share == expected
    left = cpus - reserved
    fit = judge({"CPU": share}, count=engines, view=ClusterView(({"CPU": left},), {"CPU": left})).fit
    assert fit is (Fit.FITS if share * engines <= left else Fit.IMPOSSIBLE)

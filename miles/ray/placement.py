"""Whether a rollout's placement group can be placed, decided from the cluster's resources before waiting.

A placement group Ray cannot place stays pending for ever. ``judge`` compares what the bundles ask
for with what the nodes have, less what this process holds: ``IMPOSSIBLE`` fails at once, naming
the setting to lower and a value that would fit; ``SHORT_NOW`` is worth the bounded wait. The
arithmetic is pure; ``cluster_view`` is the one function that asks Ray.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import ray

from miles.config import DEFAULT_CPUS_PER_ENGINE

# Ray counts resources in fixed point, in units of 1/10000 (a bundle of CPU 0.95 is 9500 units):
# comparing in those units keeps 0.1 + 0.2 from missing 0.3.
_RAY_UNITS = 10_000
# What a too-large request is lowered with, per resource: the command's flag and the setting.
_KNOBS = {"CPU": ("--cpus-per-engine", "num_cpus_per_engine"), "GPU": ("--gpus-per-engine", "num_gpus_per_engine")}
# A suggested or default share is rounded down to this (0.95 CPUs, not 0.9499).
_SHARE_STEP = 0.01
# How many copies of a bundle that asks for nothing fit: any number.
_UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class ClusterView:
    """What the cluster's alive nodes have: ``capacity`` per node less what this process holds
    there (``held``: nothing for a driver, its share for the controller's actor), ``free`` now."""

    capacity: tuple[Mapping[str, float], ...]
    free: Mapping[str, float]
    held: Mapping[str, float] = field(default_factory=dict)


class Fit(StrEnum):
    """How a placement group stands against the cluster, decided before waiting on it."""

    FITS = "fits"  # free now
    SHORT_NOW = "short_now"  # the nodes could hold it, but some of it is held by others now
    IMPOSSIBLE = "impossible"  # no waiting helps: lower the request or add nodes


@dataclass(frozen=True)
class Verdict:
    """``judge``'s answer: whether the bundles fit, and in words what is missing (empty if nothing)."""

    fit: Fit
    message: str = ""


def _units(amount: float) -> int:
    return round(amount * _RAY_UNITS)


def placeable(bundle: Mapping[str, float], capacity: tuple[Mapping[str, float], ...]) -> int:
    """How many copies of ``bundle`` the nodes can hold together (a bundle never spans nodes)."""
    asked = {r: _units(a) for r, a in bundle.items() if _units(a) > 0}
    if not asked:
        return _UNBOUNDED
    return sum(min(_units(node.get(r, 0.0)) // a for r, a in asked.items()) for node in capacity)


def largest_fitting(
    bundle: Mapping[str, float], resource: str, *, count: int, capacity: tuple[Mapping[str, float], ...]
) -> float:
    """The most of ``resource`` each of ``count`` bundles may ask for and still fit, rounded down to 0.01 (0: none)."""
    candidates = sorted(
        {node.get(resource, 0.0) / k for node in capacity for k in range(1, count + 1)} - {0.0}, reverse=True
    )
    for candidate in candidates:
        share = math.floor(round(candidate / _SHARE_STEP, 6)) * _SHARE_STEP
        if share > 0 and placeable({**bundle, resource: share}, capacity) >= count:
            return round(share, 2)
    return 0.0


def judge(bundle: Mapping[str, float], *, count: int, view: ClusterView) -> Verdict:
    """Whether ``count`` bundles of ``bundle`` can be placed on the cluster ``view`` shows."""
    if placeable(bundle, view.capacity) < count:
        return Verdict(Fit.IMPOSSIBLE, _impossible(bundle, count=count, view=view))
    short = [r for r, a in bundle.items() if _units(view.free.get(r, 0.0)) < _units(a) * count]
    if short:
        return Verdict(Fit.SHORT_NOW, "; ".join(_need(bundle, r, count=count, view=view) for r in short))
    return Verdict(Fit.FITS)


def _amount(value: float, resource: str) -> str:
    return f"{value:g} {resource}{'' if value == 1 else 's'}"


def _need(bundle: Mapping[str, float], resource: str, *, count: int, view: ClusterView) -> str:
    """What ``count`` bundles ask of ``resource`` against what the cluster has, in words."""
    amount = bundle[resource]
    held = view.held.get(resource, 0.0)
    everything = sum(node.get(resource, 0.0) for node in view.capacity) + held
    held_note = f", {held:g} held by this controller" if held else ""
    asked = (
        f"1 engine needs {_amount(amount, resource)}"
        if count == 1
        else f"{count} engines need {_amount(amount, resource)} each ({amount * count:g} in all)"
    )
    free = _amount(view.free.get(resource, 0.0), resource)
    return f"{asked}, the cluster has {free} free ({everything:g} in all{held_note})"


def _impossible(bundle: Mapping[str, float], *, count: int, view: ClusterView) -> str:
    problems = []
    for resource, amount in bundle.items():
        if placeable({resource: amount}, view.capacity) >= count:
            continue
        largest = max((node.get(resource, 0.0) for node in view.capacity), default=0.0)
        why = _need(bundle, resource, count=count, view=view)
        if _units(largest) < _units(amount) and len(view.capacity) > 1:
            why += f"; no node has {resource} {amount:g} (the largest has {largest:g})"
        flag, setting = _KNOBS.get(resource, (f"the {resource} per engine", f"the {resource} per engine"))
        fitting = largest_fitting(bundle, resource, count=count, capacity=view.capacity)
        lower = f"lower {flag} ({setting}; {fitting:g} would fit)" if fitting else f"lower {flag} ({setting})"
        problems.append(f"{why}: {lower} or add nodes")
    if not problems:
        # Each resource fits on its own, not together (CPUs on one node, GPUs on another).
        problems.append(
            f"no node holds a whole engine's {dict(bundle)} for {count} engine(s) "
            f"(nodes have {[dict(n) for n in view.capacity]}): lower what each engine asks for or add nodes"
        )
    return "; ".join(problems)


def engine_cpu_share(*, cpus: float, engines: int, reserved: float = 0.0) -> float:
    """An equal share of ``cpus`` less ``reserved`` for each of ``engines``, at most
    ``DEFAULT_CPUS_PER_ENGINE``, rounded down to (and at least) 0.01 (``judge`` refuses too small)."""
    if engines < 1:
        return DEFAULT_CPUS_PER_ENGINE
    stepped = math.floor(round((cpus - reserved) / engines / _SHARE_STEP, 6)) * _SHARE_STEP
    return round(min(DEFAULT_CPUS_PER_ENGINE, max(_SHARE_STEP, stepped)), 2)


def cluster_view(resources: tuple[str, ...]) -> ClusterView:
    """The cluster's alive nodes and free ``resources`` now, less what this process holds (blocking)."""
    context = ray.get_runtime_context()
    held: dict[str, float] = {}
    own_node = None
    # Only a worker (an actor, such as the controller's) holds resources; a driver holds none.
    if context.worker.mode == ray.WORKER_MODE:
        held = {r: float(a) for r, a in context.get_assigned_resources().items() if r in resources}
        own_node = context.get_node_id()
    capacity = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = {r: float(node.get("Resources", {}).get(r, 0.0)) for r in resources}
        if node.get("NodeID") == own_node:
            have = {r: max(0.0, a - held.get(r, 0.0)) for r, a in have.items()}
        capacity.append(have)
    available = ray.available_resources()
    return ClusterView(capacity=tuple(capacity), free={r: float(available.get(r, 0.0)) for r in resources}, held=held)

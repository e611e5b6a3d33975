"""Prometheus metrics of one controller (its own registry, so several controllers can coexist).

What feeds it: docs/ARCHITECTURE.md, "Observing it"; names: ``miles.protocol.metrics``; meanings:
docs/METRICS.md.
"""

from __future__ import annotations

import collections
import functools
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from miles.controller.health import FleetHealth
from miles.controller.results import ServerStep, UpdateMode, UpdateResult, UpdateStatus
from miles.protocol import metrics as names
from miles.rollout.state import ServerState
from miles.utils.audit_utils.event_logger.models import (
    ChecksumMismatchEvent,
    Event,
    LockAcquiredEvent,
    LockReleasedEvent,
    ServerStateChangedEvent,
)

# Read from the answer's bytes rather than by parsing it: a routed answer is passed through as it
# came, and a search costs microseconds where a parse of a long answer costs more. SGLang's
# ``meta_info`` and the OpenAI ``usage`` both name completion_tokens; a batch answer has several.
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_VERSION_START = re.compile(rb'"weight_version_start":\s*"([^"]{0,256})"')


class RequestMetrics:
    """What the proxy records per routed request; this base records nothing (``NO_REQUEST_METRICS``,
    with metrics off: what benchmarks/controller.py compares against)."""

    def first_byte(self, model: str, *, started: float) -> None:
        return None

    def request_done(
        self, model: str, *, server: str, outcome: str, started: float, content: bytes | None = None
    ) -> None:
        return None


NO_REQUEST_METRICS = RequestMetrics()


def outcome_of(status: int) -> str:
    """The ``outcome`` label of an answered request: ok, client_error or server_error."""
    if status < 400:
        return "ok"
    return "client_error" if status < 500 else "server_error"


class RequestHistory:
    """Routed requests per second over the last ``seconds`` (count, failed, latency): a ring of
    one slot per second, so recording costs a few integer operations."""

    def __init__(self, seconds: int = 300) -> None:
        self._size = seconds
        self._second = [-1] * seconds
        self._count = [0] * seconds
        self._failed = [0] * seconds
        self._latency = [0.0] * seconds

    def record(self, latency_s: float, *, ok: bool, now: float | None = None) -> None:
        second = int(time.time() if now is None else now)
        slot = second % self._size
        if self._second[slot] != second:
            self._second[slot], self._count[slot], self._failed[slot], self._latency[slot] = second, 0, 0, 0.0
        self._count[slot] += 1
        self._failed[slot] += 0 if ok else 1
        self._latency[slot] += latency_s

    def window(self, *, now: float | None = None) -> RequestWindow:
        """The last ``seconds`` seconds, oldest first; the last one is the current second, still filling."""
        last = int(time.time() if now is None else now)
        first = last - self._size + 1
        requests, failed, latency = [], [], []
        for second in range(first, last + 1):
            slot = second % self._size
            seen = self._second[slot] == second
            count = self._count[slot] if seen else 0
            requests.append(count)
            failed.append(self._failed[slot] if seen else 0)
            latency.append(round(self._latency[slot] / count * 1e3, 3) if count else None)
        return RequestWindow(start=first, requests=requests, failed=failed, mean_latency_ms=latency)


@dataclass(frozen=True)
class RequestWindow:
    start: int  # the first second, as a Unix time
    requests: list[int]
    failed: list[int]
    mean_latency_ms: list[float | None]


class ControllerMetrics(RequestMetrics, Collector):
    """The controller's series."""

    def __init__(self, health: Callable[[], FleetHealth], *, waiting: Callable[[], int] = lambda: 0) -> None:
        self._health = health
        self._waiting = waiting
        self.registry = registry = CollectorRegistry()

        # Each series' children are cached by label values for the per-request path:
        # prometheus_client's labels() validates and locks on every call (~2.5 us each, measured).
        def counter(name: str, doc: str, labels: list[str]) -> Callable[..., Counter]:
            return functools.cache(Counter(name, doc, labels, registry=registry).labels)

        def histogram(
            name: str, doc: str, labels: list[str], buckets: tuple[float, ...] = names.UPDATE_BUCKETS
        ) -> Callable[..., Histogram]:
            return functools.cache(Histogram(name, doc, labels, registry=registry, buckets=buckets).labels)

        self._requests = counter(names.REQUESTS, "Routed inference requests", ["model", "server", "outcome"])
        self._latency = histogram(
            names.REQUEST_SECONDS, "End-to-end latency of routed requests", ["model"], names.LATENCY_BUCKETS
        )
        self._ttft = histogram(
            names.TIME_TO_FIRST_TOKEN,
            "Time to the first streamed byte of routed streaming requests",
            ["model"],
            names.LATENCY_BUCKETS,
        )
        self._tokens = counter(names.GENERATED_TOKENS, "Tokens generated for routed requests", ["model", "server"])
        self._staleness = histogram(
            names.SAMPLE_STALENESS,
            "How many committed versions behind the newest the weights a response started on were",
            ["model"],
            names.STALENESS_BUCKETS,
        )
        self._updates = counter(names.UPDATES, "Weight updates", ["model", "strategy", "path", "status"])
        self._update_seconds = histogram(
            names.UPDATE_SECONDS, "Weight update duration, lock wait included", ["model", "strategy"]
        )
        self._phase_seconds = histogram(
            names.UPDATE_PHASE_SECONDS, "Seconds per phase of a weight update", ["model", "phase"]
        )
        self._blocked = histogram(
            names.UPDATE_BLOCKED_SECONDS, "Seconds an update held the model's requests at the router", ["model"]
        )
        self._bytes = histogram(
            names.UPDATE_BYTES, "Weight bytes the servers loaded per update", ["model"], names.BYTES_BUCKETS
        )
        self._mismatches = counter(
            names.CHECKSUM_MISMATCHES, "Servers that reported other weights than expected", ["model", "server"]
        )
        self._quarantines = counter(names.QUARANTINES, "Servers quarantined", ["model", "server"])
        self._rollbacks = counter(
            names.ROLLBACKS, "Servers put back on their verified weights by an update", ["model", "server"]
        )
        self._lock_wait = histogram(names.LOCK_WAIT_SECONDS, "Seconds waited for the controller lock", ["holder"])
        self._lock_hold = histogram(names.LOCK_HOLD_SECONDS, "Seconds the controller lock was held", ["holder"])
        self.history = RequestHistory()
        # Each model's committed versions, oldest first (bounded): what staleness is counted in.
        self._versions: dict[str, list[str]] = {}
        registry.register(self)

    # --- RequestMetrics ------------------------------------------------------------------------

    def first_byte(self, model: str, *, started: float) -> None:
        self._ttft(model).observe(time.perf_counter() - started)

    def request_done(
        self, model: str, *, server: str, outcome: str, started: float, content: bytes | None = None
    ) -> None:
        latency = time.perf_counter() - started
        self._requests(model, server, outcome).inc()
        self._latency(model).observe(latency)
        self.history.record(latency, ok=outcome == "ok")
        if not content or outcome != "ok":
            return
        if tokens := sum(int(n) for n in _COMPLETION_TOKENS.findall(content)):
            self._tokens(model, server).inc(tokens)
        for version in _VERSION_START.findall(content):
            self._staleness(model).observe(self._behind(model, version.decode(errors="replace")))

    def _behind(self, model: str, version: str) -> int:
        """Committed versions newer than ``version``: all of them for one older than any known."""
        versions = self._versions.get(model)
        if not versions:
            return 0
        try:
            return len(versions) - 1 - versions.index(version)
        except ValueError:
            return len(versions)

    # --- updates and events ----------------------------------------------------------------------

    def update_done(self, result: UpdateResult) -> None:
        model = result.model_name
        strategy = result.strategy.value
        path = "push" if result.strategy is UpdateMode.WINDOW else "disk"
        self._updates(model, strategy, path, result.status.value).inc()
        self._update_seconds(model, strategy).observe(result.duration_s)
        for phase, seconds in result.timings.items():
            self._phase_seconds(model, phase).observe(seconds)
        self._blocked(model).observe(result.serving_blocked_s)
        if result.bytes_moved is not None:
            self._bytes(model).observe(result.bytes_moved)
        for server in result.servers:
            if server.progress is ServerStep.RESTORED:
                self._rollbacks(model, server.server_id).inc()
        if result.status is UpdateStatus.COMMITTED and result.weight_version:
            versions = self._versions.setdefault(model, [])
            if not versions and result.previous_version:
                versions.append(result.previous_version)
            if result.weight_version in versions:
                versions.remove(result.weight_version)
            versions.append(result.weight_version)
            del versions[: -names.STALENESS_BUCKETS[-1] - 1]

    def event(self, event: Event) -> None:
        """An event the controller logged (subscribed to its event log)."""
        if isinstance(event, ChecksumMismatchEvent):
            self._mismatches(event.model_name, event.server_id).inc()
        elif isinstance(event, ServerStateChangedEvent):
            if event.to_state == ServerState.QUARANTINED.value:
                self._quarantines(event.model_name, event.server_id).inc()
        elif isinstance(event, LockAcquiredEvent):
            self._lock_wait(event.holder).observe(event.waited_s)
        elif isinstance(event, LockReleasedEvent):
            self._lock_hold(event.holder).observe(event.held_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """Servers, their weights, in-flight and waiting requests and the lock, read at scrape time."""
        report = self._health()
        states = GaugeMetricFamily(names.SERVERS, "Servers by model and state", labels=["model", "state"])
        counts = collections.Counter((server.model_name, server.state.value) for server in report.servers)
        for (model, state), count in sorted(counts.items()):
            states.add_metric([model, state], count)
        yield states
        info = InfoMetricFamily(
            names.SERVER,
            "Each server's state and the weights it holds (version, confirmed checksum), its node and GPUs",
            labels=["model", "server"],
        )
        in_flight = GaugeMetricFamily(names.SERVER_IN_FLIGHT, "Routed requests in flight", labels=["server"])
        restarts = CounterMetricFamily(names.SERVER_RESTARTS, "Restarts of each server", labels=["model", "server"])
        for server in report.servers:
            held = {n: getattr(server, n) or "" for n in ("weight_version", "checksum", "verified_weight_version")}
            placed = {"node": server.node_address or server.node_id or "", "gpus": ",".join(map(str, server.gpu_ids))}
            labels = {"state": server.state.value, "server_type": server.server_type, **held, **placed}
            info.add_metric([server.model_name, server.server_id], labels)
            in_flight.add_metric([server.server_id], server.in_flight)
            restarts.add_metric([server.model_name, server.server_id], server.restarts)
        yield from (info, in_flight, restarts)
        yield GaugeMetricFamily(
            names.REQUESTS_WAITING, "Routed requests waiting for a server (held by an update)", value=self._waiting()
        )
        yield GaugeMetricFamily(names.LOCK_HELD, "1 while the controller lock is held", value=int(report.lock.held))
        yield GaugeMetricFamily(names.LOCK_WAITERS, "Tasks waiting for the controller lock", value=report.lock.waiters)
        yield GaugeMetricFamily(names.FLEET_OK, "1 while every model can serve", value=int(report.ok))

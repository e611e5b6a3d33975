"""Prometheus metrics of one controller (its own registry, so several controllers can coexist)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from miles.controller.health import FleetHealth
from miles.controller.results import UpdateResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _FleetCollector(Collector):
    """Server states, in-flight requests and the lock, read from the health report at scrape time."""

    def __init__(self, health: Callable[[], FleetHealth]) -> None:
        self._health = health

    def collect(self) -> Iterator[GaugeMetricFamily]:
        report = self._health()
        states = GaugeMetricFamily("miles_servers", "Servers by model and state", labels=["model", "state"])
        counts: dict[tuple[str, str], int] = {}
        for server in report.servers:
            key = (server.model_name, server.state)
            counts[key] = counts.get(key, 0) + 1
        for (model, state), count in sorted(counts.items()):
            states.add_metric([model, state], count)
        yield states
        in_flight = GaugeMetricFamily("miles_server_in_flight", "Routed requests in flight", labels=["server"])
        for server in report.servers:
            in_flight.add_metric([server.server_id], server.in_flight)
        yield in_flight
        yield GaugeMetricFamily("miles_lock_held", "1 while the controller lock is held", value=int(report.lock.held))
        yield GaugeMetricFamily(
            "miles_lock_waiters", "Tasks waiting for the controller lock", value=report.lock.waiters
        )
        yield GaugeMetricFamily("miles_fleet_ok", "1 while every model can serve", value=int(report.ok))


class ControllerMetrics:
    def __init__(self, health: Callable[[], FleetHealth]) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "miles_requests", "Routed inference requests", ["model", "outcome"], registry=self.registry
        )
        self._latency = Histogram(
            "miles_request_seconds",
            "End-to-end latency of routed requests",
            ["model"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self._updates = Counter(
            "miles_updates", "Weight updates by outcome", ["model", "status"], registry=self.registry
        )
        self._update_seconds = Histogram(
            "miles_update_seconds",
            "Weight update duration",
            ["model"],
            registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.registry.register(_FleetCollector(health))

    def request_done(self, model: str, *, ok: bool, started: float) -> None:
        self._requests.labels(model, "ok" if ok else "failed").inc()
        self._latency.labels(model).observe(time.perf_counter() - started)

    def update_done(self, result: UpdateResult) -> None:
        self._updates.labels(result.model_name, result.status.value).inc()
        self._update_seconds.labels(result.model_name).observe(result.duration_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The engine's Prometheus series at ``GET /metrics``, under SGLang's names where they mean the same.

Requests are recorded as they finish (``request_done``, from the engine's event loop); the
scheduler's queue, batch and token count and the weights held are read at scrape time; weight
loads are recorded by the HTTP adapter around each load call (``weight_load``). Names and buckets
live in ``miles.protocol.metrics``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from miles.engine.scheduler import SchedulerStats
from miles.engine.sequence import Sequence
from miles.protocol import metrics as names
from miles.protocol.sglang import GenerateResponse


class EngineMetrics(Collector):
    def __init__(
        self, model_name: str, *, stats: Callable[[], SchedulerStats], weights: Callable[[], dict[str, str]]
    ) -> None:
        self.model_name = model_name
        self._stats, self._weights = stats, weights
        self.registry = registry = CollectorRegistry()
        labels = ["model_name"]
        self._requests = Counter(
            names.ENGINE_REQUESTS, "Number of requests processed.", labels, registry=registry
        ).labels(model_name)
        self._prompt_tokens = Counter(
            names.ENGINE_PROMPT_TOKENS, "Number of prefill tokens processed.", labels, registry=registry
        ).labels(model_name)
        self._aborted = Counter(names.ENGINE_ABORTED, "Number of requests aborted.", labels, registry=registry).labels(
            model_name
        )
        self._e2e = Histogram(
            names.ENGINE_E2E_SECONDS, "Histogram of End-to-end request latency in seconds",
            [*labels, "is_streaming"], registry=registry, buckets=names.LATENCY_BUCKETS,
        )  # fmt: skip
        self._ttft = Histogram(
            names.ENGINE_TTFT_SECONDS, "Histogram of time to first token in seconds.",
            [*labels, "is_streaming"], registry=registry, buckets=names.LATENCY_BUCKETS,
        )  # fmt: skip
        self._load_seconds = Gauge(
            names.ENGINE_WEIGHT_LOAD_SECONDS,
            "Wall time of the most recent update_weights_from_<source> call (seconds).",
            [*labels, "source"], registry=registry,
        )  # fmt: skip
        self._loads = Counter(
            names.ENGINE_WEIGHT_UPDATES, "Weight loads by source and outcome", [*labels, "source", "outcome"],
            registry=registry,
        )  # fmt: skip
        registry.register(self)  # collect(): what is read at scrape time

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        labels = ["model_name"]
        running = GaugeMetricFamily(names.ENGINE_RUNNING, "The number of running requests.", labels=labels)
        running.add_metric([self.model_name], stats.running)
        yield running
        queued = GaugeMetricFamily(names.ENGINE_QUEUED, "The number of requests in the waiting queue.", labels=labels)
        queued.add_metric([self.model_name], stats.waiting)
        yield queued
        tokens = CounterMetricFamily(
            names.ENGINE_GENERATION_TOKENS.removesuffix("_total"),
            "Number of generation tokens processed.",
            labels=labels,
        )
        tokens.add_metric([self.model_name], stats.tokens_generated)
        yield tokens
        info = InfoMetricFamily(names.ENGINE_WEIGHTS, "The weights this engine serves", labels=labels)
        info.add_metric([self.model_name], self._weights())
        yield info

    def request_done(self, sequence: Sequence, response: GenerateResponse) -> None:
        """A request finished (its last response): latency, time to first token, counts."""
        streaming = "true" if sequence.stream else "false"
        meta = response.meta_info
        self._requests.inc()
        self._prompt_tokens.inc(meta.prompt_tokens)
        if meta.finish_reason is not None and meta.finish_reason.type == "abort":
            self._aborted.inc()
        self._e2e.labels(self.model_name, streaming).observe(meta.e2e_latency)
        if sequence.first_token_at is not None:
            self._ttft.labels(self.model_name, streaming).observe(sequence.first_token_at - sequence.arrived)

    def clients_left(self, count: int) -> None:
        """``count`` requests aborted because their client went away before the answer (no final
        response reaches ``request_done`` for them)."""
        self._aborted.inc(count)

    def weight_load(self, source: str, *, started: float, success: bool) -> None:
        """A load call (``source``: disk, tensor, distributed or activate) ended."""
        self._load_seconds.labels(self.model_name, source).set(time.perf_counter() - started)
        self._loads.labels(self.model_name, source, "ok" if success else "refused").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

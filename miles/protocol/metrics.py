"""The name of every Prometheus series miles exposes, the controller's and the engine's, in one place.

The engine reuses SGLang's names (``sglang:*``, label ``model_name``) where a series means the same
as SGLang's, so a dashboard built for SGLang reads a miles engine unchanged. The controller's own
series are ``miles_*``. docs/METRICS.md says what each one answers.
"""

from __future__ import annotations

# --- the controller: routed requests ----------------------------------------------------------
REQUESTS = "miles_requests"  # counter {model, server, outcome}
REQUEST_SECONDS = "miles_request_seconds"  # histogram {model}
TIME_TO_FIRST_TOKEN = "miles_time_to_first_token_seconds"  # histogram {model}; streamed requests
GENERATED_TOKENS = "miles_generated_tokens"  # counter {model, server}
REQUESTS_WAITING = "miles_requests_waiting"  # gauge: requests waiting at the router for a server
SERVER_IN_FLIGHT = "miles_server_in_flight"  # gauge {server}
SAMPLE_STALENESS = "miles_sample_staleness_versions"  # histogram {model}

# --- the controller: weight updates ------------------------------------------------------------
UPDATES = "miles_updates"  # counter {model, strategy, path, status}
UPDATE_SECONDS = "miles_update_seconds"  # histogram {model, strategy}
UPDATE_PHASE_SECONDS = "miles_update_phase_seconds"  # histogram {model, phase}
UPDATE_BLOCKED_SECONDS = "miles_update_serving_blocked_seconds"  # histogram {model}
UPDATE_BYTES = "miles_update_bytes"  # histogram {model}
CHECKSUM_MISMATCHES = "miles_checksum_mismatches"  # counter {model, server}
QUARANTINES = "miles_quarantines"  # counter {model, server}
ROLLBACKS = "miles_rollbacks"  # counter {model, server}

# --- the controller: fleet and lock (read from the health report at scrape time) ----------------
SERVERS = "miles_servers"  # gauge {model, state}
SERVER = "miles_server"  # info {model, server, state, weight_version, checksum, node, gpus}
SERVER_RESTARTS = "miles_server_restarts"  # counter {model, server}
FLEET_OK = "miles_fleet_ok"  # gauge
LOCK_HELD = "miles_lock_held"  # gauge
LOCK_WAITERS = "miles_lock_waiters"  # gauge
LOCK_WAIT_SECONDS = "miles_lock_wait_seconds"  # histogram {holder}
LOCK_HOLD_SECONDS = "miles_lock_hold_seconds"  # histogram {holder}

# --- the engine (SGLang's names) ---------------------------------------------------------------
ENGINE_RUNNING = "sglang:num_running_reqs"  # gauge {model_name}
ENGINE_QUEUED = "sglang:num_queue_reqs"  # gauge {model_name}
ENGINE_REQUESTS = "sglang:num_requests_total"  # counter {model_name}
ENGINE_PROMPT_TOKENS = "sglang:prompt_tokens_total"  # counter {model_name}
ENGINE_GENERATION_TOKENS = "sglang:generation_tokens_total"  # counter {model_name}
ENGINE_ABORTED = "sglang:num_aborted_requests_total"  # counter {model_name}
ENGINE_E2E_SECONDS = "sglang:e2e_request_latency_seconds"  # histogram {model_name, is_streaming}
ENGINE_TTFT_SECONDS = "sglang:time_to_first_token_seconds"  # histogram {model_name, is_streaming}
ENGINE_WEIGHT_LOAD_SECONDS = "sglang:weight_load_duration_seconds"  # gauge {model_name, source}
# miles' own, on the engine
ENGINE_WEIGHTS = "miles_engine_weights"  # info {model_name, weight_version, checksum, status}
ENGINE_WEIGHT_UPDATES = "miles_engine_weight_updates"  # counter {model_name, source, outcome}

# Buckets: a tiny model on a CPU answers in milliseconds, a large one on a GPU in seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
UPDATE_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
BYTES_BUCKETS = tuple(float(4**k * 2**20) for k in range(0, 10))  # 1 MiB .. 256 GiB
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)

# The text format every /metrics answers in.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

"""The controller's settings: typed, read from ``MILES_*`` environment variables once at start-up.

Constructor arguments override the environment, which overrides the defaults. ``PATCH /config``
may change a subset at runtime; changing the rest is refused with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from miles.errors import ConflictError, InvalidRequestError, MilesError
from miles.utils.http import DEFAULT_MAX_REQUEST_MIB


class UpdateStrategy(StrEnum):
    """How a weight update moves through the fleet: ``barrier`` (requests wait at the router and
    every server switches together) or ``rolling`` (``rolling_batch_size`` servers at a time leave
    the router, so serving never stops)."""

    BARRIER = "barrier"
    ROLLING = "rolling"


class RuntimeKind(StrEnum):
    LOCAL = "local"  # child processes of the controller, on this machine
    RAY = "ray"  # Ray actors on placement-group bundles, anywhere in the cluster


class PlacementStrategy(StrEnum):
    """How a rollout's engines are spread over nodes (Ray's placement-group strategies)."""

    PACK = "PACK"  # as few nodes as possible
    SPREAD = "SPREAD"  # as many nodes as possible


class CheckpointTransfer(StrEnum):
    """How an engine on another node gets a checkpoint the controller names by path."""

    AUTO = "auto"  # read it in place when the engine's node sees the same files, else ship it
    SHARED = "shared"  # always read in place (a shared filesystem); never ship
    SHIP = "ship"  # always ship through the object store (nodes share no filesystem)


class TransferPath(StrEnum):
    """How a trainer's weights reach the servers."""

    AUTO = "auto"  # shm when every engine is on this machine, else distributed
    SHM = "shm"
    DISTRIBUTED = "distributed"
    DISK = "disk"  # a checkpoint per step (DiskPublisher)


class RoutingPolicy(StrEnum):
    LEAST_OUTSTANDING = "least_outstanding"
    ROUND_ROBIN = "round_robin"


class UpdatePauseMode(StrEnum):
    """What an update does to requests running on a server it is about to update."""

    DRAIN = "drain"
    ABORT = "abort"
    RETRACT = "retract"


MINUTE = 60.0
HOUR = 60 * MINUTE
DAY = 24 * HOUR
# A training window's lease: long enough for a real push, short enough that a dead trainer's
# window ends within a day. Shared by the settings and the per-window ``ttl_s``.
LEASE_TTL_MIN_S = 0.1
LEASE_TTL_MAX_S = DAY
# How long one update may take (per call ``timeout``), the same bounds as ``update_timeout_s``.
UPDATE_TIMEOUT_MIN_S = 0.1
UPDATE_TIMEOUT_MAX_S = DAY


# Shorter tokens can be guessed over a network in reasonable time.
MIN_TOKEN_CHARS = 16
# What an engine asks of a Ray cluster when nothing says otherwise: an engine's scheduler is one
# busy thread, so one CPU; less where the cluster has fewer to share (miles.ray.placement).
DEFAULT_CPUS_PER_ENGINE = 1.0


def check_seconds(value: float, *, name: str, low: float, high: float) -> float:
    """``value`` if it is a finite number of seconds in [low, high]; else InvalidRequestError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be a number of seconds between {low:g} and {high:g}, got {value!r}")
    return float(value)


def choice(enum_type: type[Any], value: Any, name: str) -> Any:
    """``value`` as a member of ``enum_type``; InvalidRequestError naming the choices otherwise."""
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(member.value for member in enum_type)
        raise InvalidRequestError(f"{name} must be one of {choices}, got {value!r}") from None


# Settings PATCH /config may change, and why each of the others may not.
RUNTIME_CHANGEABLE = frozenset(
    {
        "health_interval_s",
        "health_timeout_s",
        "health_failure_threshold",
        "routing_policy",
        "rolling_batch_size",
        "default_strategy",
        "default_pause_mode",
        "update_timeout_s",
        "lock_timeout_s",
        "lease_ttl_s",
        "request_timeout_s",
        "max_waiting_requests",
        "max_held_request_mib",
        "require_published_checksum",
        "write_out_interval_s",
    }
)
# Runtime settings that decide which weights may serve: changing one is logged loudly.
SAFETY_SETTINGS = frozenset({"require_published_checksum"})
FIXED_REASONS = {
    "host": "the HTTP server is bound at start; restart the controller to move it",
    "port": "the HTTP server is bound at start; restart the controller to move it",
    "seed": "seeds apply when servers and models are created; restart to change it",
    "gated_launch": "it decides how servers are launched, which has already happened",
    "startup_timeout_s": "it applies when servers are launched, which has already happened",
    "allowed_checkpoint_roots": "it is a security boundary; set MILES_ALLOWED_CHECKPOINT_ROOTS at start",
    "events_dir": "the event log is already open; restart to write elsewhere",
    "events_fsync": "the event log is already open; restart to change its durability",
    "log_dir": "server logs are already being written; restart to write elsewhere",
    "state_dir": "engines were launched writing there; restart to move it",
    "admin_token": "it is a credential; set MILES_ADMIN_TOKEN at start",
    "api_key": "it is a credential; set MILES_API_KEY at start",
    "runtime": "engines were launched by it; restart the controller to change it",
    "ray_address": "the controller joined its cluster at start; restart to join another",
    "ray_namespace": "the controller joined its cluster at start; restart to join another",
    "num_gpus_per_engine": "engines were placed with it; restart to change it",
    "num_cpus_per_engine": "engines were placed with it; restart to change it",
    "placement_strategy": "engines were placed with it; restart to change it",
    "max_request_mib": "the HTTP server was built with it; restart the controller to change it",
    "http_head_timeout_s": "the HTTP server was built with it; restart the controller to change it",
    "max_connections": "the HTTP server was built with it; restart the controller to change it",
}


class ControllerSettings(BaseSettings):
    """Every knob of the InferenceController, with its ``MILES_<NAME>`` environment variable."""

    # Infinity and NaN are refused for every float: an infinite timeout or interval silently
    # disables what it bounds (a health loop that never wakes, a request that never times out).
    model_config = SettingsConfigDict(
        env_prefix="MILES_", extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False
    )

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    seed: Annotated[int, Field(ge=0, lt=2**63)] = 0
    # Launch servers one after another (each healthy before the next starts): bounds the memory
    # and CPU spike of loading several models at once.
    gated_launch: bool = False
    # Bounds: below them a loop burns the CPU or every call times out at once; above them a
    # failure goes unnoticed for longer than anyone would wait.
    health_interval_s: Annotated[float, Field(ge=0.05, le=HOUR)] = 2.0
    health_timeout_s: Annotated[float, Field(ge=0.05, le=10 * MINUTE)] = 5.0
    health_failure_threshold: Annotated[int, Field(ge=1, le=1000)] = 3
    startup_timeout_s: Annotated[float, Field(ge=1.0, le=DAY)] = 180.0
    update_timeout_s: Annotated[float, Field(ge=UPDATE_TIMEOUT_MIN_S, le=UPDATE_TIMEOUT_MAX_S)] = 600.0
    lock_timeout_s: Annotated[float, Field(ge=0.01, le=DAY)] = 600.0
    # A training window's lease: renewed by its holder while it works (PushPublisher renews every
    # third of it), so a trainer that dies holds the fleet for one lease, not for a long push.
    lease_ttl_s: Annotated[float, Field(ge=LEASE_TTL_MIN_S, le=LEASE_TTL_MAX_S)] = 10.0
    request_timeout_s: Annotated[float, Field(ge=0.5, le=DAY)] = 600.0
    # The largest request body the controller reads (413 above it). Engines have their own limit
    # (the engine's --max-request-mib, in a model's engine_args), with the same default.
    max_request_mib: Annotated[int, Field(ge=1, le=1 << 16)] = DEFAULT_MAX_REQUEST_MIB
    # How long a request's head (request line and headers) may take, from the connection or, between
    # keep-alive requests, from its first byte: a slower one is answered 408 and closed. The
    # connections the HTTP server holds at once (at most half the file-descriptor limit): one more
    # closes the oldest that runs no request (a stalled head first), or gets 503 when all of them
    # run one (miles.utils.connections, docs/SECURITY.md). Engines have their own (the engine's
    # --http-head-timeout-s and --max-connections).
    http_head_timeout_s: Annotated[float, Field(ge=0.1, le=10 * MINUTE)] = 10.0
    max_connections: Annotated[int, Field(ge=8, le=1 << 20)] = 8192
    # Requests that may wait at once for a server (during a barrier update, for a version, for a
    # restart), and the bytes of request bodies held while being routed: one more gets 429 with
    # Retry-After rather than memory without bound.
    max_waiting_requests: Annotated[int, Field(ge=1, le=1 << 24)] = 16384
    max_held_request_mib: Annotated[int, Field(ge=1, le=1 << 20)] = 2048
    routing_policy: RoutingPolicy = RoutingPolicy.LEAST_OUTSTANDING
    rolling_batch_size: Annotated[int, Field(ge=1, le=1024)] = 1
    default_strategy: UpdateStrategy = UpdateStrategy.BARRIER
    default_pause_mode: UpdatePauseMode = UpdatePauseMode.DRAIN
    require_published_checksum: bool = False
    allowed_checkpoint_roots: Annotated[tuple[Path, ...], NoDecode] = ()
    events_dir: Path | None = None
    events_fsync: bool = False
    log_dir: Path | None = None
    # Bearer token every weight-, config- or event-changing endpoint requires when set; binding a
    # non-loopback host without one is refused (docs/SECURITY.md).
    admin_token: SecretStr | None = None
    # OpenAI-style key the inference and read-only endpoints require when set (/health stays open).
    api_key: SecretStr | None = None
    # Where the controller keeps what it writes while it runs: engine logs (unless log_dir is
    # set) and copies of weights a training window pushed. Default: a temporary directory that
    # is removed when the controller closes.
    state_dir: Path | None = None
    # Where engines run: "local" (child processes on this machine) or "ray" (actors on a Ray
    # cluster's placement groups); MILES_RUNTIME=ray. docs/ARCHITECTURE.md, "Runtimes".
    runtime: RuntimeKind = RuntimeKind.LOCAL
    # The Ray cluster to join: "auto", HOST:PORT, or None (the one this process is connected to,
    # else a new one-node cluster on loopback).
    ray_address: str | None = None
    ray_namespace: Annotated[str, Field(min_length=1, max_length=128)] = "miles"
    # What each engine asks of the cluster (every model's default; a server spec may override):
    # fractions of a GPU share it (a trainer and an engine colocated).
    num_gpus_per_engine: Annotated[float, Field(ge=0, le=64)] = 0.0
    # None: DEFAULT_CPUS_PER_ENGINE (one), except on a cluster `serve_controller` (`miles serve
    # --ray`) starts itself, whose CPUs are split between the engines so that they all fit.
    num_cpus_per_engine: Annotated[float, Field(gt=0, le=1024)] | None = None
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    # How engines on other nodes read checkpoints named by path: in place when they see the same
    # files (auto), always in place (shared), or always shipped through the object store (ship).
    checkpoint_transfer: CheckpointTransfer = CheckpointTransfer.AUTO
    # Prometheus series of routed requests, updates and the fleet at /metrics (docs/METRICS.md).
    # Off, routed requests record nothing and /metrics answers 404 (benchmarks/controller.py
    # measures the difference).
    metrics_enabled: bool = True
    # Weights a training window pushed are written to disk by one engine after the commit, so a
    # restart can reload them; per model, write-outs start at least this far apart, each with the
    # newest committed weights (a restart in between copies newer weights from a peer).
    write_out_interval_s: Annotated[float, Field(ge=0, le=HOUR)] = 2.0

    @field_validator("admin_token", "api_key", mode="before")
    @classmethod
    def _unset_when_empty(cls, value: Any) -> Any:
        # MILES_ADMIN_TOKEN= (empty) means no token, never a token that an empty header matches.
        if isinstance(value, str) and not value.strip():
            return None
        if isinstance(value, str) and len(value) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"a token must have at least {MIN_TOKEN_CHARS} characters; generate one with `openssl rand -hex 32`"
            )
        return value

    @field_validator("allowed_checkpoint_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        # The environment gives one string: paths separated by os.pathsep or commas.
        if isinstance(value, str):
            parts = [p.strip() for chunk in value.split(os.pathsep) for p in chunk.split(",")]
            return tuple(Path(p).expanduser().resolve() for p in parts if p)
        if isinstance(value, list | tuple):
            return tuple(Path(p).expanduser().resolve() for p in value)
        return value

    def changed(self, patch: dict[str, Any]) -> ControllerSettings:
        """A copy with ``patch`` applied, validated. Raises InvalidRequestError for unknown names or
        invalid values, ConflictError naming each setting fixed at start and why."""
        unknown = sorted(set(patch) - set(type(self).model_fields))
        if unknown:
            raise InvalidRequestError(f"unknown settings: {', '.join(unknown)}")
        fixed = _fixed(patch)
        if fixed:
            reasons = "; ".join(f"{name}: {why}" for name, why in sorted(fixed.items()))
            raise ConflictError(f"these settings cannot change at runtime: {reasons}")
        try:
            # Validate the merged values as a whole; the environment is not read again.
            return type(self).model_validate({**self.model_dump(), **patch})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise InvalidRequestError(f"invalid settings: {problems}") from exc

    def runtime_view(self) -> dict[str, Any]:
        """Every setting, JSON-ready, marked changeable or not (for ``GET /config``)."""
        values = self.model_dump(mode="json")
        return {"settings": values, "runtime_changeable": sorted(RUNTIME_CHANGEABLE), "fixed": _fixed(values)}


def _fixed(names: Iterable[str]) -> dict[str, str]:
    return {name: FIXED_REASONS.get(name, "fixed at start") for name in names if name not in RUNTIME_CHANGEABLE}


ENV_PREFIX = "MILES_"
# Settings whose values an error never shows (it lands in terminals and logs).
_CREDENTIAL_WORDS = ("token", "key", "secret", "password")


class SettingsError(MilesError):
    """A setting has a value miles cannot use; one line names where it came from (a flag, a
    ``MILES_*`` variable) and what is wrong with it."""

    @classmethod
    def from_validation(cls, exc: ValidationError, *, flags: Mapping[str, str] | None = None) -> SettingsError:
        """Every problem ``exc`` lists, each named as the user gave it: ``flags[field]``, else its
        ``MILES_*`` variable when set (ControllerSettings), else the field's (or model's) name."""
        from_env = exc.title == ControllerSettings.__name__
        problems = [_problem(error, title=exc.title, flags=flags or {}, from_env=from_env) for error in exc.errors()]
        return cls("; ".join(problems))


def _problem(error: ErrorDetails, *, title: str, flags: Mapping[str, str], from_env: bool) -> str:
    loc = [str(part) for part in error["loc"]]
    name = loc[0] if loc else ""
    variable = f"{ENV_PREFIX}{name.upper()}"
    if name in flags:
        source = flags[name]
    elif from_env and name and variable in os.environ:
        source = variable
    else:
        source = ".".join(loc) or title
    if error["type"] == "extra_forbidden":
        message = "there is no such setting"
    else:
        message = error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        message = message[:1].lower() + message[1:]
    shown = ""
    if loc and error["type"] != "missing" and not any(word in name.lower() for word in _CREDENTIAL_WORDS):
        value = repr(error.get("input"))
        shown = f"={value if len(value) <= 80 else value[:77] + '...'}"
    # One line whatever the validator wrote.
    return f"{source}{shown}: {' '.join(message.split())}"

"""The fleet's one health report: servers, the lock, the last update; and whether it can serve."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from miles.controller.results import UpdateResult
from miles.rollout.state import EngineApi, ServerSnapshot, ServerState, VerifiedWeights
from miles.utils.context_lock import LockStatistics


class FleetStatus(StrEnum):
    OK = "ok"
    UPDATING = "updating"  # a barrier update holds requests, which wait
    DEGRADED = "degraded"  # some server is not serving
    UNAVAILABLE = "unavailable"  # a model has no serving server: requests would fail


class ServerHealth(BaseModel):
    model_config = ConfigDict(frozen=True)

    server_id: str
    model_name: str
    # The server type that runs it (``SFTRollout``, ``VLLMRollout`` ...): a model may be served by
    # several at once. ``engine``: the API its engine speaks ("sglang" or "vllm").
    server_type: str
    engine: EngineApi
    url: str | None
    device: str
    # Where the engine runs and the GPUs its runtime gave it (None before its first launch).
    node_id: str | None
    node_address: str | None
    gpu_ids: list[int]
    # Someone else runs the server (attach mode): the controller never starts or stops it, and a
    # restart waits for it to answer again and verifies its weights.
    attached: bool
    state: ServerState
    state_for_s: float
    # What the engine holds now, as it last reported it (a quarantined server may hold other
    # weights than it was verified on).
    weight_version: str | None
    checksum: str | None
    # The weights last verified on the server and where they can be reloaded from: None while
    # pushed weights exist on no disk yet (a peer or the engine itself can write them out).
    verified_weight_version: str | None
    verified_checkpoint: str | None
    last_probe_ok: bool | None
    last_probe_age_s: float | None
    last_probe_latency_s: float | None
    consecutive_failures: int
    restarts: int
    in_flight: int
    pid: int | None


class ResumedFrom(BaseModel):
    """Where a model's servers started when the controller resumed from its event log."""

    model_config = ConfigDict(frozen=True)

    # The weights resumed (None when no committed weights had a copy: the start checkpoint).
    weight_version: str | None = None
    step: int | None = None
    checksum: str | None = None
    checkpoint: str | None = None
    update_id: str | None = None
    committed_at: datetime | None = None
    # The version the log committed last, and the highest integer one (updates must beat it).
    last_committed_version: str
    committed_high: int | None = None
    # Why what was resumed is not the version committed last, when it is not.
    note: str | None = None

    def weights(self) -> VerifiedWeights | None:
        """The weights resumed, as the servers must confirm them; None: the start checkpoint."""
        if self.weight_version is None or self.checksum is None or self.checkpoint is None:
            return None
        return VerifiedWeights(
            checkpoint=Path(self.checkpoint), weight_version=self.weight_version, checksum=self.checksum, step=self.step
        )


class ModelHealth(BaseModel):
    model_config = ConfigDict(frozen=True)

    model_name: str
    # The version every serving server agrees on, or None while the fleet holds several.
    weight_version: str | None
    versions: dict[str, int]
    serving: int
    total: int
    accepting_requests: bool  # False while a barrier update holds requests at the router
    # Set when the controller started again on an event log that had committed updates.
    resumed_from: ResumedFrom | None = None


class LockHealth(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    held: bool
    holder: str | None
    held_since: datetime | None
    held_for_s: float | None
    token: int | None
    waiters: int
    # True while a training window holds the lock, until training ends it or it expires at
    # ``lease_expires_at``.
    detached: bool
    lease_expires_at: datetime | None


class FleetHealth(BaseModel):
    """``GET /health``: ``ok`` and HTTP 200 while every model has a serving server, else 503."""

    model_config = ConfigDict(frozen=True)

    status: FleetStatus
    ok: bool
    models: dict[str, ModelHealth]
    servers: list[ServerHealth]
    lock: LockHealth
    last_update: UpdateResult | None
    uptime_s: float


# The fields of a server's health that its snapshot holds as they are.
_AS_IN_SNAPSHOT = (
    "server_id model_name server_type engine url state weight_version checksum consecutive_failures restarts pid"
).split()


def server_health(snapshot: ServerSnapshot, *, in_flight: int, now: float) -> ServerHealth:
    probe, placement, verified = snapshot.last_probe, snapshot.placement, snapshot.verified
    return ServerHealth(
        **{name: getattr(snapshot, name) for name in _AS_IN_SNAPSHOT},
        device=placement.device if placement else snapshot.device,
        node_id=placement.node_id if placement else None,
        node_address=placement.node_address if placement else None,
        gpu_ids=list(placement.gpu_ids) if placement else [],
        attached=placement.attached if placement else False,
        state_for_s=round(now - snapshot.state_since, 3),
        verified_weight_version=verified.weight_version if verified else None,
        verified_checkpoint=str(verified.checkpoint) if verified and verified.checkpoint else None,
        last_probe_ok=probe.ok if probe else None,
        last_probe_age_s=round(now - probe.at, 3) if probe else None,
        last_probe_latency_s=round(probe.latency_s, 4) if probe else None,
        in_flight=in_flight,
    )


def model_health(
    model_name: str, snapshots: list[ServerSnapshot], *, accepting: bool, resumed_from: ResumedFrom | None = None
) -> ModelHealth:
    serving = [s for s in snapshots if s.state is ServerState.SERVING]
    versions = dict(Counter(s.weight_version or "unknown" for s in serving))
    return ModelHealth(
        model_name=model_name,
        weight_version=next(iter(versions)) if len(versions) == 1 else None,
        versions=versions,
        serving=len(serving),
        total=len(snapshots),
        accepting_requests=accepting,
        resumed_from=resumed_from,
    )


def lock_health(stats: LockStatistics, *, window_expires_at: datetime | None) -> LockHealth:
    since = stats.held_since
    return LockHealth(
        **asdict(stats),  # the lock's own statistics, as they are
        held_for_s=round((datetime.now(UTC) - since).total_seconds(), 3) if since is not None else None,
        detached=window_expires_at is not None,
        lease_expires_at=window_expires_at,
    )


def fleet_health(
    snapshots: dict[str, list[ServerSnapshot]],
    *,
    accepting: Callable[[str], bool],
    in_flight: Callable[[str], int],
    resumed: dict[str, ResumedFrom],
    lock: LockHealth,
    last_update: UpdateResult | None,
    uptime_s: float,
) -> FleetHealth:
    """The report for every model's servers (``snapshots``, by model)."""
    now = time.time()
    models = {
        name: model_health(name, snaps, accepting=accepting(name), resumed_from=resumed.get(name))
        for name, snaps in snapshots.items()
    }
    servers = [
        server_health(s, in_flight=in_flight(s.server_id), now=now) for snaps in snapshots.values() for s in snaps
    ]
    status, ok = overall(models)
    return FleetHealth(
        status=status, ok=ok, models=models, servers=servers, lock=lock, last_update=last_update, uptime_s=uptime_s
    )


def overall(models: dict[str, ModelHealth]) -> tuple[FleetStatus, bool]:
    """``ok`` while every model can serve (requests held by a barrier update count: they wait)."""
    if not models or any(m.serving == 0 and m.accepting_requests for m in models.values()):
        return FleetStatus.UNAVAILABLE, False
    if any(not m.accepting_requests for m in models.values()):
        return FleetStatus.UPDATING, True
    if any(m.serving < m.total for m in models.values()):
        return FleetStatus.DEGRADED, True
    return FleetStatus.OK, True

"""The life of one server (one engine process): states, the transition table, the cell.

Each ``ServerCell`` is owned by one ``Rollout``; an illegal transition raises instead of corrupting
the fleet's view. Only ``SERVING`` cells receive traffic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Literal, Protocol

from miles.errors import CheckpointError, MilesError
from miles.rollout.engine_client import WeightsIdentity
from miles.rollout.runtime import Placement
from miles.weights.checksum import model_checksum
from miles.weights.manifest import manifest_or_none

# The HTTP API a server's engine speaks: SGLang's (embedded engines, SGLang servers: native
# /generate, pushes through /update_weights_from_tensor) or vLLM's (OpenAI routes only, pushes
# through its weight transfer). A model may have servers of both (miles.rollout.mixed).
EngineApi = Literal["sglang", "vllm"]


class ServerState(StrEnum):
    STARTING = "starting"  # process launched, not yet answering
    PENDING_WEIGHTS = "pending_weights"  # answering, weights not yet confirmed by checksum
    SERVING = "serving"  # confirmed weights; the router may send it requests
    UPDATING = "updating"  # loading and confirming new (or rolled-back) weights
    QUARANTINED = "quarantined"  # holds weights that failed verification; no traffic
    RESTARTING = "restarting"  # process being replaced
    STOPPED = "stopped"


TRANSITIONS: dict[ServerState, frozenset[ServerState]] = {
    ServerState.STARTING: frozenset({ServerState.PENDING_WEIGHTS, ServerState.RESTARTING, ServerState.STOPPED}),
    ServerState.PENDING_WEIGHTS: frozenset(
        {ServerState.SERVING, ServerState.QUARANTINED, ServerState.RESTARTING, ServerState.STOPPED}
    ),
    ServerState.SERVING: frozenset(
        {ServerState.UPDATING, ServerState.QUARANTINED, ServerState.RESTARTING, ServerState.STOPPED}
    ),
    ServerState.UPDATING: frozenset(
        {ServerState.SERVING, ServerState.QUARANTINED, ServerState.RESTARTING, ServerState.STOPPED}
    ),
    ServerState.QUARANTINED: frozenset({ServerState.UPDATING, ServerState.RESTARTING, ServerState.STOPPED}),
    ServerState.RESTARTING: frozenset({ServerState.STARTING, ServerState.RESTARTING, ServerState.STOPPED}),
    ServerState.STOPPED: frozenset({ServerState.STARTING}),
}


class IllegalTransitionError(MilesError):
    """A server was asked to move between two states the table does not connect."""


@dataclass(frozen=True)
class VerifiedWeights:
    """Weights a server was confirmed to hold: where they can be reloaded from (None: on no disk, as
    pushed weights no engine has written out yet: only a peer has them), version, checksum."""

    checkpoint: Path | None
    weight_version: str
    checksum: str
    step: int | None = None


@dataclass(frozen=True)
class ProbeResult:
    at: float  # wall clock (time.time())
    ok: bool
    latency_s: float
    error: str | None = None


@dataclass(frozen=True)
class StateChange:
    server_id: str
    model_name: str
    from_state: ServerState
    to_state: ServerState
    weight_version: str | None
    reason: str


@dataclass(frozen=True)
class ServerSnapshot:
    """A frozen view of one server for health reports and routing decisions."""

    server_id: str
    model_name: str
    url: str | None
    device: str
    state: ServerState
    state_since: float
    weight_version: str | None
    checksum: str | None
    verified: VerifiedWeights | None
    last_probe: ProbeResult | None
    consecutive_failures: int
    restarts: int
    pid: int | None
    # Where the engine runs and what it was given (None before its first launch).
    placement: Placement | None = None
    # Which launch of the server's process this is: a restart makes a new incarnation, so a
    # request that could not reach the old one may take the new one.
    incarnation: int = 0
    # The server type that runs it (``SFTRollout`` ...) and the API its engine speaks.
    server_type: str = ""
    engine: EngineApi = "sglang"


@dataclass(eq=False)
class ServerCell:
    """Mutable record of one server; only its Rollout changes it."""

    server_id: str
    model_name: str
    device: str
    server_type: str = ""
    engine: EngineApi = "sglang"
    state: ServerState = ServerState.STOPPED
    state_since: float = field(default_factory=time.time)
    url: str | None = None
    pid: int | None = None
    weight_version: str | None = None
    checksum: str | None = None
    verified: VerifiedWeights | None = None
    last_probe: ProbeResult | None = None
    consecutive_failures: int = 0
    restarts: int = 0
    incarnation: int = 0
    placement: Placement | None = None
    # The engine process's own identity, as it reported it when brought up (None when the engine
    # does not report one): a probe answered by another instance means a restart from outside.
    engine_instance: str | None = None

    def transition(self, to: ServerState, *, reason: str) -> StateChange:
        """Move to ``to`` if the table allows it; returns the change (for events), else raises."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransitionError(
                f"server cannot go from {self.state.value} to {to.value}", server_id=self.server_id, reason=reason
            )
        change = StateChange(
            server_id=self.server_id,
            model_name=self.model_name,
            from_state=self.state,
            to_state=to,
            weight_version=self.weight_version,
            reason=reason,
        )
        self.state = to
        self.state_since = time.time()
        return change

    def snapshot(self) -> ServerSnapshot:
        return ServerSnapshot(**{f.name: getattr(self, f.name) for f in fields(ServerSnapshot)})


class RolloutObserver(Protocol):
    """What a rollout reports as it goes (the controller turns these into events)."""

    def state_changed(self, change: StateChange) -> None: ...

    def weights_restored(self, server_id: str, model_name: str, verified: VerifiedWeights) -> None:
        """A server was confirmed to hold ``verified`` again after a start, restart or rollback."""

    def weights_written_out(self, model_name: str, checksum: str, checkpoint: Path) -> None:
        """Weights on no disk (pushed) now have a copy at ``checkpoint``, written by an engine."""

    def probed(self, server_id: str) -> None:
        """A health probe of the server finished (requests waiting for it may now route)."""

    def drifted(self, server_id: str, model_name: str, *, expected: VerifiedWeights, actual: WeightsIdentity) -> None:
        """A serving engine reported weights other than the ones verified on it."""


class RolloutError(MilesError):
    """A rollout could not do what was asked of one of its servers (start, load, confirm, restart)."""


# The version a start checkpoint without a manifest serves as: older than any published step.
PLAIN_START_VERSION = "0"


def start_weights(checkpoint: Path) -> VerifiedWeights:
    """What a start checkpoint holds: its manifest's version and checksum, or for a plain Hugging
    Face directory its files' checksum as version "0". Blocking; RolloutError when it cannot hash."""
    manifest = manifest_or_none(checkpoint)
    if manifest is not None:
        return VerifiedWeights(
            checkpoint=checkpoint,
            weight_version=manifest.weight_version,
            checksum=manifest.checksum,
            step=manifest.step,
        )
    try:
        checksum = model_checksum(checkpoint)
    except CheckpointError as exc:
        raise RolloutError(
            f"the start checkpoint has no miles manifest and its weights cannot be hashed: {exc.message}",
            checkpoint=str(checkpoint),
        ) from exc
    return VerifiedWeights(checkpoint=checkpoint, weight_version=PLAIN_START_VERSION, checksum=checksum, step=0)

"""The life of one server (one engine process): states, the transition table, the cell.

A ``ServerCell`` is owned by exactly one ``Rollout``, which applies every transition with
``ServerCell.transition``; an illegal transition raises instead of corrupting the fleet's view.
Only ``SERVING`` cells receive traffic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from miles.errors import MilesError
from miles.rollout.runtime import Placement


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
    """Weights a server was confirmed to hold: where they can be reloaded from, version, checksum.

    ``checkpoint`` is None for weights that exist on no disk (a training window pushed them and
    no copy has been written yet): they can then only be recovered from a peer that holds them.
    """

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


@dataclass(eq=False)
class ServerCell:
    """Mutable record of one server; only its Rollout changes it."""

    server_id: str
    model_name: str
    device: str
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
                f"server cannot go from {self.state.value} to {to.value}",
                server_id=self.server_id,
                reason=reason,
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
        return ServerSnapshot(
            server_id=self.server_id,
            model_name=self.model_name,
            url=self.url,
            device=self.device,
            state=self.state,
            state_since=self.state_since,
            weight_version=self.weight_version,
            checksum=self.checksum,
            verified=self.verified,
            last_probe=self.last_probe,
            consecutive_failures=self.consecutive_failures,
            restarts=self.restarts,
            pid=self.pid,
            placement=self.placement,
            incarnation=self.incarnation,
        )

"""What a weight update reports: its outcome per server and as a whole, and a training window."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from miles.config import UpdatePauseMode
from miles.errors import MilesError
from miles.rollout.state import EngineApi, ServerState


class UpdateStatus(StrEnum):
    COMMITTED = "committed"  # every server verified and serving the new version
    REJECTED = "rejected"  # refused before any server was touched (nothing changed)
    ROLLED_BACK = "rolled_back"  # servers were touched; a failure put them back on verified weights
    PARTIAL = "partial"  # a rolling update halted after some servers committed the new version
    ABORTED = "aborted"  # a training window was aborted, or its lease expired
    TIMED_OUT = "timed_out"  # the lock was not granted in time (nothing changed)


class UpdateMode(StrEnum):
    """How an update moved through the fleet: a strategy of an update from disk, or a window."""

    BARRIER = "barrier"
    ROLLING = "rolling"
    WINDOW = "window"  # training pushed the weights itself between start and end


class ChecksumSource(StrEnum):
    PUBLISHED = "published"  # training published it (InferenceEngineWeightChecksumEvent)
    MANIFEST = "manifest"  # nothing was published; the checkpoint's own manifest
    TRAINING = "training"  # given by training when it ended its window


class ServerStep(StrEnum):
    """How far one server got in one update."""

    PENDING = "pending"  # not touched yet (a later batch of a rolling update)
    TAKEN_OUT = "taken_out"  # out of routing and paused
    LOADED = "loaded"  # loaded the new weights; not yet confirmed
    REFUSED = "refused"  # refused the new weights before touching its own (nothing changed)
    CONFIRMED = "confirmed"  # reported exactly the expected checksum
    MISMATCHED = "mismatched"  # reported another checksum: quarantined
    FAILED = "failed"  # a call to it failed (it timed out or answered an error)
    # Its engine died during the update: a crash like any other, restarted on the weights the
    # update ended with (the new ones once the others committed them), never a reason to fail them.
    CRASHED = "crashed"
    ADMITTED = "admitted"  # serving the new version
    RESTORED = "restored"  # back on its last verified weights


class ServerOutcome(BaseModel):
    """One server after an update: what it holds now, and what the update saw of it."""

    model_config = ConfigDict(frozen=True)

    server_id: str
    state: ServerState
    weight_version: str | None
    checksum: str | None
    loaded: bool = False
    confirmed_checksum: str | None = None
    matched: bool | None = None
    error: str | None = None
    # Seconds per phase of the server's load, as the server reported them.
    load_timings: dict[str, float] = {}
    # How far the server got in the update.
    progress: ServerStep | None = None


class UpdateResult(BaseModel):
    """The whole story of one update, returned by every way of updating weights."""

    model_config = ConfigDict(frozen=True)

    update_id: str
    status: UpdateStatus
    model_name: str
    # All None for an update that never got the lock (nothing was decided).
    weight_version: str | None = None
    previous_version: str | None = None
    step: int | None = None
    checkpoint: str | None = None
    expected_checksum: str | None = None
    checksum_source: ChecksumSource | None = None
    strategy: UpdateMode
    pause_mode: UpdatePauseMode
    servers: tuple[ServerOutcome, ...] = ()
    message: str
    duration_s: float
    # Seconds per phase: lock_wait, validate (the checkpoint gate), transfer (a window's pushes),
    # pause, load, confirm, commit, rollback; and transaction (everything after the gate).
    timings: dict[str, float] = {}
    # How long requests for the model were held at the router (a barrier's gate; 0 for rolling).
    serving_blocked_s: float = 0.0
    # Weight bytes the servers loaded (the manifest's size times the servers that loaded it);
    # None when no manifest says how large the weights are (a window's pushes, a plain directory).
    bytes_moved: int | None = None
    fencing_token: int | None = None

    @property
    def ok(self) -> bool:
        return self.status is UpdateStatus.COMMITTED

    @property
    def versions(self) -> dict[str, str | None]:
        """Which weight version each server holds after the update."""
        return {s.server_id: s.weight_version for s in self.servers}

    def raise_for_status(self) -> UpdateResult:
        """Return self when committed; raise WeightUpdateError carrying this result otherwise."""
        if not self.ok:
            raise WeightUpdateError(self)
        return self


class WeightUpdateError(MilesError):
    """An update did not commit; ``result`` says what happened to every server."""

    def __init__(self, result: UpdateResult) -> None:
        self.result = result
        super().__init__(
            f"weight update {result.status.value}: {result.message}",
            model=result.model_name,
            weight_version=result.weight_version,
            versions=result.versions,
        )


class WindowServer(BaseModel):
    model_config = ConfigDict(frozen=True)

    server_id: str
    url: str
    weight_version: str | None
    # The HTTP API the server's engine takes pushes through: "sglang" (embedded engines, SGLang's
    # /update_weights_from_tensor) or "vllm" (vLLM's native weight transfer, miles' backend).
    engine: EngineApi = "sglang"


class UpdateWindow(BaseModel):
    """A training-driven update in progress: push to ``servers``, then end or abort it with ``token``.

    The lock is held as a lease until ``expires_at``; then the window is rolled back and its token
    refused. The engines of ``servers`` accept ``credential`` (``Authorization: Bearer``) for pushes
    while this window is open, and never after."""

    model_config = ConfigDict(frozen=True)

    window_id: str
    update_id: str
    model_name: str
    token: int
    expires_at: datetime | None
    ttl_s: float
    pause_mode: UpdatePauseMode
    servers: tuple[WindowServer, ...]
    credential: str | None = None
    # The servers keep serving while training pushes: pushes stage (``activate=false``) and the
    # commit swaps the weights in.
    staged: bool = False

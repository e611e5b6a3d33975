"""The typed events miles records: one frozen pydantic model per event type, and their union.

Each serialises to a JSON object whose ``type`` names its model (``parse_event`` reads it back).
Models refuse unknown fields and naive timestamps (normalised to UTC); sequences are tuples.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from miles.errors import EventValidationError

_CHECKSUM_PREVIEW_CHARS = 12


def short_checksum(checksum: str) -> str:
    """Return ``checksum`` cut to a prefix long enough to tell checksums apart in a table."""
    return checksum if len(checksum) <= _CHECKSUM_PREVIEW_CHARS else checksum[:_CHECKSUM_PREVIEW_CHARS] + "…"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EventSource(_Frozen):
    """Who logged an event: a component name and an id unique to one process of it."""

    component: str = Field(min_length=1)
    id: str = Field(min_length=1)

    @classmethod
    def of_this_process(cls, component: str = "miles") -> EventSource:
        """Return a source naming ``component`` in this process (id ``"{hostname}:{pid}"``)."""
        return cls(component=component, id=f"{socket.gethostname()}:{os.getpid()}")


class ChecksumRole(StrEnum):
    """Why a checksum was reported."""

    PUBLISHED = "published"
    """Training wrote a checkpoint and published its checksum: the value servers must match."""
    CONFIRMED = "confirmed"
    """A server hashed the weights it holds after loading an update."""
    RESTORED = "restored"
    """A server hashed the weights it rolled back to, or reloaded after a restart."""


class BaseEvent(_Frozen):
    """Fields every event carries. Subclasses add a ``type`` literal that names them on the wire."""

    type: str
    event_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1)
    # Naive datetimes are refused rather than guessed at: a log merged from several hosts is
    # ordered by this field, and a silently wrong zone would reorder it.
    timestamp: AwareDatetime = Field(default_factory=lambda: datetime.now(UTC))
    source: EventSource = Field(default_factory=EventSource.of_this_process)

    @field_validator("timestamp")
    @classmethod
    def _to_utc(cls, value: datetime) -> datetime:
        return value.astimezone(UTC)

    def involved_servers(self) -> tuple[str, ...]:
        """Return the ids of the rollout servers this event is about (empty when none): those its
        ``server_ids`` or ``server_id`` field names."""
        server_id = getattr(self, "server_id", None)
        return getattr(self, "server_ids", None) or (() if server_id is None else (server_id,))

    def summary(self) -> str:
        """Return a short human description of the event's payload, for logs and tables."""
        return ""


class InferenceEngineWeightChecksumEvent(BaseEvent):
    """A model checksum, as published by training or as reported by a server about its weights."""

    type: Literal["inference_engine_weight_checksum"] = "inference_engine_weight_checksum"
    model_name: str
    checksum: str = Field(min_length=1)
    step: NonNegativeInt
    weight_version: str | None = None
    server_id: str | None = None
    role: ChecksumRole = ChecksumRole.PUBLISHED

    @model_validator(mode="after")
    def _server_reports_name_the_server(self) -> InferenceEngineWeightChecksumEvent:
        if self.role is not ChecksumRole.PUBLISHED and self.server_id is None:
            raise ValueError(f"a {self.role.value} checksum is reported by a server: set server_id")
        return self

    def summary(self) -> str:
        return f"{self.role.value} {short_checksum(self.checksum)}"


class _UpdateEvent(BaseEvent):
    """The fields every event of one weight update begins with."""

    update_id: str
    model_name: str
    weight_version: str
    step: NonNegativeInt | None = None


class WeightUpdateStartedEvent(_UpdateEvent):
    """The controller took the update lock and began moving servers to a new weight version."""

    type: Literal["weight_update_started"] = "weight_update_started"
    checkpoint: str | None = None
    strategy: str
    pause_mode: str
    server_ids: tuple[str, ...]
    fencing_token: int | None = None

    def summary(self) -> str:
        return f"update {self.update_id} {self.strategy}/{self.pause_mode} on {len(self.server_ids)} server(s)"


class WeightUpdateCommittedEvent(_UpdateEvent):
    """Every server of an update confirmed the expected checksum; they now serve the new version."""

    type: Literal["weight_update_committed"] = "weight_update_committed"
    checksum: str = Field(min_length=1)
    server_ids: tuple[str, ...]
    duration_s: NonNegativeFloat
    # Seconds per phase (``UpdateResult.timings``) and how long the model's requests were held at
    # the router; absent from logs written before they were recorded.
    timings: dict[str, NonNegativeFloat] = {}
    serving_blocked_s: NonNegativeFloat | None = None
    # Where these weights can be read from (the checkpoint loaded, or a window's); None for weights
    # pushed from memory until a ``WeightsWrittenOutEvent`` names their copy. A controller started
    # again on the same log resumes from here (miles.controller.resume).
    checkpoint: str | None = None

    def summary(self) -> str:
        return f"update {self.update_id} {short_checksum(self.checksum)} in {self.duration_s:.3f}s"


class WeightsWrittenOutEvent(BaseEvent):
    """Weights pushed from memory were written to ``checkpoint`` by an engine holding them: where
    restarts, and a controller started again on this log, read them from."""

    type: Literal["weights_written_out"] = "weights_written_out"
    model_name: str
    checksum: str = Field(min_length=1)
    checkpoint: str = Field(min_length=1)

    def summary(self) -> str:
        return f"weights {short_checksum(self.checksum)} of {self.model_name} written to {self.checkpoint}"


class WeightUpdateAbortedEvent(_UpdateEvent):
    """An update was halted; ``server_versions`` says what each server holds afterwards."""

    type: Literal["weight_update_aborted"] = "weight_update_aborted"
    reason: str
    # A dict, the natural JSON shape; the model is frozen, so the mapping is only ever read.
    server_versions: dict[str, str]
    duration_s: NonNegativeFloat | None = None
    # As in WeightUpdateCommittedEvent.
    timings: dict[str, NonNegativeFloat] = {}
    serving_blocked_s: NonNegativeFloat | None = None

    def involved_servers(self) -> tuple[str, ...]:
        return tuple(self.server_versions)

    def summary(self) -> str:
        return f"update {self.update_id} aborted: {self.reason}"


class ChecksumMismatchEvent(BaseEvent):
    """A server reported a checksum other than the expected one and was kept from serving."""

    type: Literal["checksum_mismatch"] = "checksum_mismatch"
    update_id: str | None = None
    model_name: str
    server_id: str
    step: NonNegativeInt | None = None
    weight_version: str | None = None
    expected: str
    actual: str

    def summary(self) -> str:
        return f"expected {short_checksum(self.expected)} got {short_checksum(self.actual)}"


class ServerStateChangedEvent(BaseEvent):
    """A rollout server moved from one state of its state machine to another."""

    type: Literal["server_state_changed"] = "server_state_changed"
    server_id: str
    model_name: str
    from_state: str
    to_state: str
    weight_version: str | None = None
    reason: str | None = None

    def summary(self) -> str:
        text = f"{self.from_state} -> {self.to_state}"
        return text if self.reason is None else f"{text} ({self.reason})"


class _LockEvent(BaseEvent):
    lock_name: str
    holder: str
    token: int


class LockAcquiredEvent(_LockEvent):
    """A holder took a lock after waiting ``waited_s``; ``token`` fences out earlier holders."""

    type: Literal["lock_acquired"] = "lock_acquired"
    waited_s: NonNegativeFloat

    def summary(self) -> str:
        return f"{self.lock_name} by {self.holder} token={self.token} waited {self.waited_s:.3f}s"


class LockReleasedEvent(_LockEvent):
    """A lock was given up, by its holder (``released``) or by its lease running out."""

    type: Literal["lock_released"] = "lock_released"
    held_s: NonNegativeFloat
    # A free string rather than an enum: the lock module owns the list of reasons
    # ("released", "lease_expired", ...), and the log must accept any it adds.
    reason: str = "released"

    def summary(self) -> str:
        return f"{self.lock_name} by {self.holder} token={self.token} {self.reason} after {self.held_s:.3f}s"


class SettingsChangedEvent(BaseEvent):
    """Runtime settings changed (``PATCH /config``): each changed setting's value before and after."""

    type: Literal["settings_changed"] = "settings_changed"
    before: dict[str, Any]
    after: dict[str, Any]
    # A setting that guards which weights may serve (``require_published_checksum``) changed.
    safety: bool = False

    def summary(self) -> str:
        changes = ", ".join(f"{name}: {self.before.get(name)!r} -> {value!r}" for name, value in self.after.items())
        return f"{'safety ' if self.safety else ''}settings changed: {changes}"


_E = TypeVar("_E", bound=BaseEvent)

Event = Annotated[
    (
        InferenceEngineWeightChecksumEvent
        | WeightUpdateStartedEvent
        | WeightUpdateCommittedEvent
        | WeightUpdateAbortedEvent
        | WeightsWrittenOutEvent
        | ChecksumMismatchEvent
        | ServerStateChangedEvent
        | LockAcquiredEvent
        | LockReleasedEvent
        | SettingsChangedEvent
    ),
    Field(discriminator="type"),
]
"""Any event miles logs; pydantic picks the model from the ``type`` field."""

EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

# The members of ``Event``'s union, in its order.
EVENT_CLASSES: tuple[type[BaseEvent], ...] = get_args(get_args(Event)[0])

EVENT_TYPES: tuple[str, ...] = tuple(cls.model_fields["type"].default for cls in EVENT_CLASSES)
"""The ``type`` value of every event model, in the order of ``EVENT_CLASSES``."""


def parse_event(data: str | bytes | Mapping[str, Any]) -> Event:
    """The event ``data`` (JSON or a decoded dict) describes; EventValidationError when it is not
    JSON, names no known type, or does not fit that type's model."""
    try:
        if isinstance(data, (str, bytes)):
            return EVENT_ADAPTER.validate_json(data)
        return EVENT_ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise EventValidationError("not a valid event", errors=_describe(exc)) from exc


def build_event(event_cls: type[_E], fields: Mapping[str, Any]) -> _E:
    """``fields`` as an ``event_cls`` (``type`` may be omitted); EventValidationError if they do not fit."""
    try:
        return event_cls.model_validate(fields)
    except ValidationError as exc:
        raise EventValidationError(f"not a valid {event_cls.__name__}", errors=_describe(exc)) from exc


def _describe(exc: ValidationError) -> str:
    """Condense pydantic's errors to one line: ``loc: message; loc: message``."""
    errors = exc.errors(include_url=False)
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '<event>'}: {e['msg']}" for e in errors)

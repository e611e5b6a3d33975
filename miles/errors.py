"""The exception hierarchy of miles: every error carries the context needed to act on it."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class Refusal(StrEnum):
    """A refusal a caller acts on by name rather than by reading its message: an HTTP API answers
    it in the error body (``{"error": {..., "refusal": ...}}``, ``miles.utils.http``)."""

    # A staged push (``activate=false``) on an engine that cannot stage now (staging off, or no
    # memory for a second copy): the pusher redoes it in a window whose servers leave routing.
    CANNOT_STAGE = "cannot_stage"


class MilesError(Exception):
    """Base of every error miles raises on purpose.

    ``context`` holds the facts that explain the failure (server id, weight version, expected and
    actual checksum, path ...); they are appended to the message so a log line alone is enough to
    act on.
    """

    def __init__(self, message: str, *, refusal: Refusal | None = None, **context: Any) -> None:
        self.message = message
        # The refusal this error names, for a caller that acts on it (a 409, a failed publish).
        self.refusal = refusal
        self.context: Mapping[str, Any] = {k: v for k, v in context.items() if v is not None}
        super().__init__(self._render())

    def _render(self) -> str:
        if not self.context:
            return self.message
        details = ", ".join(f"{key}={value!r}" for key, value in self.context.items())
        return f"{self.message} [{details}]"


# --- locks -------------------------------------------------------------------------------------


class LockError(MilesError):
    """A ContextLock was used against its discipline."""


class LockReentryError(LockError):
    """The current context already holds this lock; taking it again would deadlock."""


class LockNestingError(LockError):
    """The current context holds another ContextLock; nesting two locks is refused."""


class LockNotHeldError(LockError):
    """An operation that needs the lock ran without holding it."""


class LockDisciplineError(LockError, TypeError):
    """A class that owns a lock declared a method without saying how it relates to the lock."""


class LockTimeoutError(LockError, TimeoutError):
    """Acquiring a ContextLock did not succeed within its timeout; the waiter left no trace."""


# --- events ------------------------------------------------------------------------------------


class EventLogError(MilesError):
    """An event log could not be written or read."""


class EventValidationError(EventLogError, ValueError):
    """Data offered as an event (a dict, a JSON line) does not match the event model."""


class EventTypeMismatchError(EventLogError, TypeError):
    """An event was logged under an event class other than its own."""


# --- weights and checkpoints -------------------------------------------------------------------


class CheckpointError(MilesError):
    """A checkpoint is missing, malformed, or does not match its manifest."""


class ChecksumMismatchError(MilesError):
    """Weights hashed to a checksum other than the one expected."""


class TensorNameError(MilesError, ValueError):
    """A tensor name cannot be written in the canonical checksum listing (tab, newline, empty)."""


class UnsupportedTensorError(MilesError, TypeError):
    """A tensor has no plain byte layout to hash (sparse, quantized, nested ...)."""


class UnknownPresetError(MilesError, ValueError):
    """A model preset name that miles.models.presets.PRESETS does not define."""


class ManifestMissingError(CheckpointError):
    """A directory has no miles_manifest.json; seal it (``miles checkpoint seal``) or re-export it."""


class ManifestInvalidError(CheckpointError):
    """miles_manifest.json exists but is not JSON or does not match the Manifest model."""


class CheckpointFileError(CheckpointError):
    """A weights file of a checkpoint is missing or unreadable."""


class CheckpointFileMissingError(CheckpointFileError):
    """A weights file named by the manifest (or given by the caller) does not exist."""


class CheckpointFileTruncatedError(CheckpointFileError):
    """A safetensors file is shorter than its own header says: it was cut while written or copied."""


class CheckpointFileInvalidError(CheckpointFileError):
    """A safetensors file has a malformed header (bad length, not JSON, bad dtype/shape/offsets)."""


class CheckpointExistsError(CheckpointError):
    """The target directory of a checkpoint write already exists and overwrite was not asked for."""


class CheckpointVerificationError(CheckpointError):
    """A checkpoint failed verification; ``report`` holds every problem found."""

    def __init__(self, message: str, *, report: Any, **context: Any) -> None:
        self.report = report
        super().__init__(message, **context)


# --- requests ----------------------------------------------------------------------------------


# What a caller did wrong, or could not have. Domain code raises these; each HTTP adapter maps
# them to status codes in one table (miles.utils.http.ERROR_STATUS), never the domain code.


class InvalidRequestError(MilesError):
    """A request is malformed or asks for something impossible (bad input): HTTP 400."""


class AuthenticationError(MilesError):
    """A request carries no credential where one is required: HTTP 401."""


class PermissionDeniedError(MilesError):
    """A request's credential does not grant what it asks: HTTP 403."""


class NotFoundError(MilesError):
    """A request names something that does not exist (a model, a directory, an endpoint): 404."""


class ConflictError(MilesError):
    """A request conflicts with the current state (a stale fencing token, no open window, a
    setting fixed at start, unverified weights): HTTP 409. ``refusal``: see ``Refusal``."""


class InsufficientStorageError(MilesError):
    """There is not room on disk for what a request writes (an exported checkpoint): HTTP 507."""


class UnavailableError(MilesError):
    """Nothing can serve the request now (no serving server in time, shutting down): HTTP 503."""


class QueueFullError(MilesError):
    """A server's queue holds as many requests as it may take: HTTP 429 with ``Retry-After: 0``
    (SGLang's answer), which tells a router to send the request to another server now."""

    # Seconds a client should wait before trying again (the ``Retry-After`` header).
    retry_after_s = 0


class ControllerBusyError(QueueFullError):
    """The controller holds as many requests as it may (waiting for a server, or their bodies'
    bytes): HTTP 429, ``Retry-After: 1``; no other server would take it sooner."""

    retry_after_s = 1


# --- reference trainer -------------------------------------------------------------------------


class TrainerError(MilesError):
    """The reference trainer (``miles.train``) could not carry on."""


class TrainerRankError(TrainerError):
    """A rank of a trainer split over processes failed, died or could not start; the message
    names the rank, how it ended and its log."""


class RolloutRequestError(TrainerError):
    """A ``/generate`` call for training samples failed or answered something unusable."""


class PublishError(TrainerError):
    """A trained checkpoint could not be published: written, announced, or applied to the servers.
    ``refusal``: the one a server named, when the publisher may act on it (``Refusal``)."""


class PublishNotReadyError(PublishError, TimeoutError):
    """The serving side never reported ready before the publish deadline; nothing was pushed."""

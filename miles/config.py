"""The controller's settings: typed, read from ``MILES_*`` environment variables once at start-up.

Constructor arguments override the environment, which overrides the defaults. A subset can be
changed at runtime (``PATCH /config``); the rest is fixed for the controller's lifetime, and
changing it is refused with the reason.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from miles.errors import InvalidRequestError


class UpdateStrategy(StrEnum):
    """How a weight update moves through the fleet.

    ``barrier``: requests wait at the router and every server switches together.
    ``rolling``: at most ``rolling_batch_size`` servers leave the router at a time, so serving
    never stops (the fleet holds two versions while the update moves through it).
    """

    BARRIER = "barrier"
    ROLLING = "rolling"


class RoutingPolicy(StrEnum):
    LEAST_OUTSTANDING = "least_outstanding"
    ROUND_ROBIN = "round_robin"


class UpdatePauseMode(StrEnum):
    """What an update does to requests running on a server it is about to update."""

    DRAIN = "drain"
    ABORT = "abort"
    RETRACT = "retract"


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
        "require_published_checksum",
    }
)
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
}


class ControllerSettings(BaseSettings):
    """Every knob of the InferenceController, with its ``MILES_<NAME>`` environment variable."""

    model_config = SettingsConfigDict(env_prefix="MILES_", extra="forbid", frozen=True, validate_default=True)

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    seed: int = 0
    # Launch servers one after another (each healthy before the next starts): bounds the memory
    # and CPU spike of loading several models at once.
    gated_launch: bool = False
    health_interval_s: Annotated[float, Field(gt=0)] = 2.0
    health_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    health_failure_threshold: Annotated[int, Field(ge=1)] = 3
    startup_timeout_s: Annotated[float, Field(gt=0)] = 180.0
    update_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    lock_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    lease_ttl_s: Annotated[float, Field(gt=0)] = 120.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    routing_policy: RoutingPolicy = RoutingPolicy.LEAST_OUTSTANDING
    rolling_batch_size: Annotated[int, Field(ge=1)] = 1
    default_strategy: UpdateStrategy = UpdateStrategy.BARRIER
    default_pause_mode: UpdatePauseMode = UpdatePauseMode.DRAIN
    require_published_checksum: bool = False
    allowed_checkpoint_roots: Annotated[tuple[Path, ...], NoDecode] = ()
    events_dir: Path | None = None
    events_fsync: bool = False
    log_dir: Path | None = None

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
        """A copy with ``patch`` applied, validated; refuses fields that cannot change at runtime.

        Raises InvalidRequestError naming each refused field and why, or the invalid values.
        """
        unknown = sorted(set(patch) - set(type(self).model_fields))
        if unknown:
            raise InvalidRequestError(f"unknown settings: {', '.join(unknown)}")
        fixed = {name: FIXED_REASONS.get(name, "fixed at start") for name in patch if name not in RUNTIME_CHANGEABLE}
        if fixed:
            reasons = "; ".join(f"{name}: {why}" for name, why in sorted(fixed.items()))
            raise InvalidRequestError(f"these settings cannot change at runtime: {reasons}", status_code=409)
        try:
            # Validate the merged values as a whole; the environment is not read again.
            return type(self).model_validate({**self.model_dump(), **patch})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise InvalidRequestError(f"invalid settings: {problems}") from exc

    def runtime_view(self) -> dict[str, Any]:
        """Every setting, JSON-ready, marked changeable or not (for ``GET /config``)."""
        values = self.model_dump(mode="json")
        return {
            "settings": values,
            "runtime_changeable": sorted(RUNTIME_CHANGEABLE),
            "fixed": {name: FIXED_REASONS.get(name, "fixed at start") for name in values if name not in RUNTIME_CHANGEABLE},
        }

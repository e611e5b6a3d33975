"""Settings of one embedded engine process (command-line flags, plus what only the environment
may carry: checkpoint roots and credentials, read once at start-up)."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from miles.utils.http import DEFAULT_MAX_REQUEST_MIB

ALLOWED_ROOTS_ENV = "MILES_ALLOWED_CHECKPOINT_ROOTS"
# A waiting sequence costs about 11 KB before its prompt: this many take a few hundred MB at most.
DEFAULT_MAX_QUEUED_REQUESTS = 16384
# A request head that takes longer is answered 408 and closed; the connections held at once (the
# controller's pool opens at most 256 to one engine). miles.utils.connections.
DEFAULT_HTTP_HEAD_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 2048
# Credentials travel in the environment, never on the command line (which `ps` shows anyone).
SECRET_ENV = "MILES_ENGINE_SECRET"
API_KEY_ENV = "MILES_API_KEY"
# Set by the forkserver in the engines it forks: the process that launched them (their parent is
# the forkserver), which --exit-with-parent watches.
LAUNCHER_PID_ENV = "MILES_ENGINE_LAUNCHER_PID"


class Forward(Enum):
    """Which forward serves the model (``miles.engine.model_runner``)."""

    AUTO = "auto"  # the fused decoder when the architecture allows it, else Transformers
    FUSED = "fused"  # the fused decoder, or an error naming why it cannot run the model
    TRANSFORMERS = "transformers"  # the model's own Transformers forward


class StagingMode(Enum):
    """How a weight update reaches the live weights (``miles.engine.weights.buffers``)."""

    # Stage when a second copy of the weights fits in ``weight_staging_budget`` of the memory
    # available when it is first needed, else copy in place.
    AUTO = "auto"
    ON = "on"  # always stage (in place only when the second copy cannot be allocated)
    OFF = "off"  # copy in place, generation paused for the whole copy


class EngineSettings(BaseModel):
    """How one engine process serves one model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: Path
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 30000
    # "cpu", "cuda[:N]", or "auto": the first of ``gpu_ids`` (or GPU 0) when CUDA is available, else
    # the CPU (``resolved_device``).
    device: str = "cpu"
    # The GPUs this engine was given (by its runtime: a Ray bundle's, or the device's index), and
    # the node it runs on; both reported by /get_server_info.
    gpu_ids: tuple[Annotated[int, Field(ge=0)], ...] = ()
    node_id: str | None = None
    served_model_name: str | None = None
    max_running_requests: Annotated[int, Field(ge=1, le=1024)] = 32
    # Sequences (prompts x n) that may wait for a row; a request that would pass it gets 429.
    max_queued_requests: Annotated[int, Field(ge=1, le=1 << 24)] = DEFAULT_MAX_QUEUED_REQUESTS
    # Torch intra-op threads; engines sharing a small machine should split the cores between them.
    num_threads: Annotated[int, Field(ge=1)] | None = None
    context_length: Annotated[int, Field(ge=8)] | None = None
    forward: Forward = Forward.AUTO
    weight_staging: StagingMode = StagingMode.AUTO
    # The fraction of the memory available (host RAM, or the GPU's free memory) that ``auto`` lets
    # the staging copy of the weights take.
    weight_staging_budget: float = 0.5
    # Checkpoint directories that /update_weights_from_disk may read; empty means any local path.
    allowed_checkpoint_roots: tuple[Path, ...] = ()
    health_generate_timeout_s: Annotated[float, Field(gt=0)] = 20.0
    # The largest request body the engine reads (413 above it).
    max_request_mib: Annotated[int, Field(ge=1, le=1 << 16)] = DEFAULT_MAX_REQUEST_MIB
    # How long a request's head may take to arrive (408 and closed after), and how many
    # connections the HTTP server holds at once (one more closes the oldest stalled head, or gets
    # 503 when every one runs a request); at most half the file-descriptor limit.
    http_head_timeout_s: Annotated[float, Field(ge=0.1, le=600)] = DEFAULT_HTTP_HEAD_TIMEOUT_S
    max_connections: Annotated[int, Field(ge=8, le=1 << 20)] = DEFAULT_MAX_CONNECTIONS
    # Where POST /export_weights writes snapshots of the held weights; None disables the endpoint.
    snapshot_dir: Path | None = None
    log_level: str = "warning"
    # The control secret (MILES_ENGINE_SECRET): control endpoints need it, or a window credential
    # derived from it. None: control is open (or guarded by the API key, when there is one).
    secret: SecretStr | None = None
    # The API key (MILES_API_KEY): inference and read-only endpoints need it (or the secret).
    api_key: SecretStr | None = None

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value not in ("cpu", "auto") and not value.startswith("cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda[:N]' or 'auto', got {value!r}")
        return value

    @field_validator("weight_staging_budget")
    @classmethod
    def _budget(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(
                f"weight_staging_budget is a fraction of the available memory in (0, 1], got {value}; "
                "0.5 lets the staging copy take half of it"
            )
        return value

    @property
    def base_gpu_id(self) -> int:
        """SGLang's ``base_gpu_id``: the first GPU the engine was given (0 without any)."""
        return self.gpu_ids[0] if self.gpu_ids else 0

    def resolved_device(self, *, cuda_available: bool) -> str:
        """The device the model runs on: ``device`` unless it is "auto", which means the first
        given GPU (its physical index: runtimes leave CUDA_VISIBLE_DEVICES unset and pass the
        ids) when CUDA is available, and the CPU otherwise."""
        if self.device != "auto":
            return self.device
        return f"cuda:{self.base_gpu_id}" if cuda_available else "cpu"

    @staticmethod
    def roots_from_env() -> tuple[Path, ...]:
        """Parse ``MILES_ALLOWED_CHECKPOINT_ROOTS`` (paths separated by ``os.pathsep`` or commas)."""
        raw = os.environ.get(ALLOWED_ROOTS_ENV, "")
        parts = [p.strip() for chunk in raw.split(os.pathsep) for p in chunk.split(",")]
        return tuple(Path(p).expanduser().resolve() for p in parts if p)

    @staticmethod
    def credential_from_env(name: str) -> SecretStr | None:
        """The credential in environment variable ``name`` (unset: None).

        Raises ValueError for a value that is set but unusable: empty (most likely an unset shell
        variable expanded, which would silently leave the engine open) or not printable ASCII
        without spaces (it must travel in an ``Authorization: Bearer`` header).
        """
        raw = os.environ.get(name)
        if raw is None:
            return None
        if not raw:
            raise ValueError(f"{name} is set but empty; give it a value, or unset it to leave the engine open")
        if not all("!" <= c <= "~" for c in raw):
            raise ValueError(
                f"{name} must be printable ASCII without spaces (it is sent as `Authorization: Bearer <value>`); "
                "generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        return SecretStr(raw)

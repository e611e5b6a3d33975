"""Typed requests and responses of SGLang's weight-update HTTP API: loads from disk, pushes from a
trainer's memory (shared memory, torch.distributed), versions, checksums and exports.

Names and defaults follow SGLang's ``io_struct.py``; miles extensions are named as such. Requests
are strict, as in ``miles.protocol.sglang``.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, Field, StrictBool, StrictInt, model_validator

from miles.errors import InvalidRequestError
from miles.protocol.base import RequestModel, ResponseModel, WeightVersion
from miles.protocol.compat import SGLangFields, Unsupported
from miles.protocol.sglang import PauseMode


class UpdateWeightsFromDiskRequest(RequestModel):
    """``POST /update_weights_from_disk``: load a checkpoint directory into the live weights.
    ``expected_checksum`` (miles extension): the manifest's must equal it; without a manifest it
    is required (with ``weight_version``) and the files must hash to it."""

    model_path: str
    expected_checksum: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: WeightVersion | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: StrictInt = 0
    flush_cache: bool = True

    @model_validator(mode="before")
    @classmethod
    def _single_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("model_path"), list):
            # ValueError, not TypeError: pydantic turns only ValueError into a validation error.
            raise ValueError("model_path must be one checkpoint directory, not a list of paths")  # noqa: TRY004
        return data


class UpdateWeightsResponse(ResponseModel):
    success: bool
    message: str
    num_paused_requests: int = 0
    weight_version: str | None = None
    checksum: str | None = None
    # miles extension: the model checksum hashed from the checkpoint's files while verifying it
    # (null when the load was refused before they were hashed).
    checkpoint_checksum: str | None = None
    # miles extension: seconds per phase of the load (pause, open, verify, match, lock, copy,
    # checksum), so an operator can see where an update's time went.
    timings: dict[str, float] = {}


class UpdateWeightVersionRequest(RequestModel):
    """``POST /update_weight_version``. Unlike SGLang, ``abort_all_requests`` defaults to false:
    renaming the version must never cost the requests in flight."""

    new_version: WeightVersion
    abort_all_requests: bool = False


class WeightsCheckerRequest(RequestModel):
    action: Literal["checksum"] = "checksum"


class WeightsChecksumPayload(ResponseModel):
    """The ``payload`` of ``/weights_checker`` with action ``checksum`` (miles' canonical checksum)."""

    action: str = "checksum"
    checksum: str
    algorithm: str = "xxh3_128_chunked"  # miles.weights.checksum.ALGORITHM
    num_tensors: int
    num_bytes: int
    weight_version: str
    weights_status: str


class WeightsCheckerResponse(ResponseModel):
    success: bool
    message: str
    payload: WeightsChecksumPayload | None = None


class SGLangWeightsCheckerResponse(WeightsCheckerResponse):
    """``/weights_checker`` as either server type answers it: miles' canonical ``payload``, or
    SGLang's own (``check_weights``): a ``ChecksumInfo`` per rank in ``ranks`` and
    ``per_engine_checksum``, SHA-256 over the ranks' checksums."""

    ranks: list[dict[str, Any]] | None = None
    per_engine_checksum: str | None = None


class PauseGenerationResponse(ResponseModel):
    status: str
    message: str
    # The embedded engine's additions; SGLang answers only ``status`` and ``message``.
    mode: PauseMode | None = None
    num_paused_requests: int = 0


class WeightVersionResponse(ResponseModel):
    """``GET /get_weight_version``: the identity of the weights held now, for drift detection."""

    weight_version: str
    # The model checksum of the weights held now (miles extension; None only before the model
    # has loaded).
    checksum: str | None = None
    # Which process answers (miles extension): a new value after every start of the engine, so a
    # server restarted by someone else is told apart from one whose weights changed.
    instance_id: str | None = None


class ExportWeightsRequest(RequestModel):
    """``POST /export_weights`` (miles extension): the step recorded in the written manifest."""

    # Steps are 64-bit wherever they are stored or compared.
    step: Annotated[StrictInt, Field(ge=0, lt=2**63)]


class ExportWeightsResponse(ResponseModel):
    success: bool
    path: str
    checksum: str
    weight_version: str


# --- weights pushed from the trainer's memory (no disk) ----------------------------------------

# The flat buckets of a torch.distributed push: one broadcast per bucket.
FLAT_LOAD_FORMAT = "flattened_bucket"
_BASE_REQUEST_FIELDS = frozenset({"rid", "http_worker_ipc"})  # SGLang's IPC bookkeeping


class _PushFields(SGLangFields):
    """What every push of tensors carries besides them (SGLang's fields, and ours)."""

    ignored_fields: ClassVar[frozenset[str]] = _BASE_REQUEST_FIELDS | {"torch_empty_cache"}
    unsupported_fields: ClassVar[Mapping[str, Unsupported]] = {
        "selector": Unsupported(default="all", reason="the engine has no draft model; leave it 'all'")
    }
    extension_fields: ClassVar[frozenset[str]] = frozenset({"expected_checksum", "activate"})

    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: WeightVersion | None = None
    # The last push of an update carries the model checksum the engine must hold after it (and a
    # weight_version): the engine confirms it over its live weights before it serves them.
    # Earlier pushes leave generation paused with the weights unverified.
    expected_checksum: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # False: stage the pushed weights beside the live ones and keep serving; after the last
    # push, wait for /activate_weights (refused by an engine that cannot stage now).
    activate: StrictBool = True


class UpdateWeightsFromTensorRequest(_PushFields):
    """``POST /update_weights_from_tensor``: tensors of the trainer's, handed over in memory as one
    base64 document of the ``load_format`` (``miles.weights.transport.documents``: ``miles_shm``,
    ``miles_cuda_ipc``); SGLang's pickled tensors are refused. Every tensor's digest is checked."""

    serialized_named_tensors: Annotated[list[str], Field(min_length=1, max_length=64)]
    load_format: str | None = None


# The longest a weight-update group may take to form, or one broadcast to run (``timeout_s``).
PUSH_TIMEOUT_MAX_S = 3600.0


_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _host(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not all(_HOST_LABEL.fullmatch(label) for label in value.removesuffix(".").split(".")):
            raise ValueError("must be an IP address or a host name (letters, digits and '-' between dots)") from None
    return value


class InitWeightsUpdateGroupRequest(SGLangFields):
    """``POST /init_weights_update_group``: join a torch.distributed group whose rank 0 sends."""

    ignored_fields: ClassVar[frozenset[str]] = _BASE_REQUEST_FIELDS
    extension_fields: ClassVar[frozenset[str]] = frozenset({"timeout_s"})

    master_address: Annotated[str, Field(min_length=1, max_length=253), AfterValidator(_host)]
    master_port: Annotated[StrictInt, Field(ge=1, le=65535)]
    rank_offset: Annotated[StrictInt, Field(ge=1, le=4096)]
    world_size: Annotated[StrictInt, Field(ge=2, le=4097)]
    group_name: Annotated[str, Field(min_length=1, max_length=128)] = "weight_update_group"
    backend: str = "nccl"
    # How long every member may take to join; past it both sides fail, naming who is missing.
    timeout_s: Annotated[float, Field(gt=0, le=PUSH_TIMEOUT_MAX_S)] = 60.0


class UpdateWeightsFromDistributedRequest(_PushFields):
    """``POST /update_weights_from_distributed``: receive one bucket by broadcast from rank 0, one
    broadcast per tensor or (``flattened_bucket``) one for all; ``digests`` (miles extension) are
    checked before use."""

    extension_fields: ClassVar[frozenset[str]] = frozenset({"expected_checksum", "activate", "timeout_s", "digests"})

    names: Annotated[list[str], Field(min_length=1, max_length=100_000)]
    dtypes: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    group_name: Annotated[str, Field(min_length=1, max_length=128)] = "weight_update_group"
    load_format: str | None = None
    digests: list[Annotated[str, Field(min_length=32, max_length=32, pattern=r"^[0-9a-f]+$")]] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=PUSH_TIMEOUT_MAX_S)] = 600.0

    def flattened(self) -> bool:
        """Whether the bucket comes as one flat broadcast; InvalidRequestError for an unknown format."""
        if self.load_format not in (None, FLAT_LOAD_FORMAT):
            raise InvalidRequestError(
                f"load_format {self.load_format!r} is not supported; send {FLAT_LOAD_FORMAT!r} "
                "(every tensor of the bucket in one broadcast) or none (a broadcast per tensor)"
            )
        return self.load_format == FLAT_LOAD_FORMAT

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedRequest:
        digests = self.names if self.digests is None else self.digests
        lengths = {len(self.names), len(self.dtypes), len(self.shapes), len(digests)}
        if len(lengths) != 1:
            raise ValueError("names, dtypes, shapes (and digests) must have one entry per tensor")
        return self


class DestroyWeightsUpdateGroupRequest(SGLangFields):
    ignored_fields: ClassVar[frozenset[str]] = _BASE_REQUEST_FIELDS

    group_name: Annotated[str, Field(min_length=1, max_length=128)] = "weight_update_group"


class ActivateWeightsRequest(RequestModel):
    """``POST /activate_weights`` (miles extension): serve the weights staged with
    ``activate=false``, which must hash to ``expected_checksum``, as ``weight_version``; this ends
    their window. A generating engine pauses for the swap (``pause_mode``: default ``drain``, or
    ``abort`` with ``abort_all_requests``) and resumes, in this one call."""

    weight_version: WeightVersion
    expected_checksum: Annotated[str, Field(min_length=1, max_length=256)]
    abort_all_requests: bool = False
    pause_mode: PauseMode | None = None


class GroupResponse(BaseModel):
    success: bool
    message: str

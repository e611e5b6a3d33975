"""What ``/update_weights_from_tensor`` carries in ``serialized_named_tensors[0]`` for each miles
``load_format``: one typed document per format, encoded by the trainer, decoded by the engine.

SGLang puts pickled tensors there; the miles engine refuses them (unpickling a request runs
whatever code it names) and takes instead the base64 of a JSON document, decoded strictly.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from miles.errors import InvalidRequestError
from miles.weights.buckets import BucketTable
from miles.weights.transport.cuda_ipc import CudaIpcHandle
from miles.weights.transport.segments import SegmentRef

# A bucket in a shared-memory segment on the engine's node, its table as JSON.
SHM_LOAD_FORMAT = "miles_shm"
# A bucket in the trainer's GPU memory, handed over as a CUDA IPC handle (JSON, never pickled).
CUDA_IPC_LOAD_FORMAT = "miles_cuda_ipc"


class _BucketDocument(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # The load_format this document travels under, and the key that says where its bytes lie.
    load_format: ClassVar[str]
    where: ClassVar[str]

    table: BucketTable

    def encode(self) -> str:
        """``serialized_named_tensors[0]`` of the push that carries this bucket."""
        return base64.b64encode(self.model_dump_json().encode()).decode()


class ShmDocument(_BucketDocument):
    """``{"shm": {"pid", "fd", "name"}, "table": ...}``: the bucket's tensors lie at their table's
    offsets in a shared-memory segment on the engine's node (``miles.weights.transport.segments``)."""

    load_format: ClassVar[str] = SHM_LOAD_FORMAT
    where: ClassVar[str] = "shm"

    shm: SegmentRef


class CudaIpcDocument(_BucketDocument):
    """``{"cuda_ipc": CudaIpcHandle, "table": ...}``: the bucket lies in a flat buffer of GPU
    memory of a process on the engine's node (``miles.weights.transport.cuda_ipc``)."""

    load_format: ClassVar[str] = CUDA_IPC_LOAD_FORMAT
    where: ClassVar[str] = "cuda_ipc"

    cuda_ipc: CudaIpcHandle


BucketDocument = ShmDocument | CudaIpcDocument
_BY_FORMAT: dict[str, type[ShmDocument] | type[CudaIpcDocument]] = {
    kind.load_format: kind for kind in (ShmDocument, CudaIpcDocument)
}


def decode(load_format: str | None, serialized_named_tensors: Sequence[str]) -> BucketDocument:
    """The document a push sent, checked whole (a miles format, one document of its shape, at least one
    tensor, each with its digest). Raises InvalidRequestError saying what to send instead."""
    kind = _BY_FORMAT.get(load_format or "")
    if kind is None:
        raise InvalidRequestError(
            f"load_format {load_format!r} is not accepted: SGLang's pickled tensors would run "
            f"whatever code the request names when unpickled; send load_format={SHM_LOAD_FORMAT!r} "
            f"(or {CUDA_IPC_LOAD_FORMAT!r} from a GPU; miles.train.push.PushPublisher pushes that way)"
        )
    if len(serialized_named_tensors) != 1:
        raise InvalidRequestError("serialized_named_tensors must hold one document (the engine has one rank)")
    try:
        raw = base64.b64decode(serialized_named_tensors[0], validate=True)
        # Strict: a number sent as text, a float or a boolean is no offset, size or dimension.
        document = kind.model_validate_json(raw, strict=True)
    except (binascii.Error, ValueError, ValidationError, RecursionError) as exc:
        raise InvalidRequestError(
            f'serialized_named_tensors[0] must be base64 of {{"{kind.where}": ..., "table": {{...}}}}: {exc}'
        ) from None
    if not document.table.entries:
        raise InvalidRequestError("the bucket's table holds no tensors; push at least one")
    unsigned = next((e.name for e in document.table.entries if e.digest is None), None)
    if unsigned is not None:
        raise InvalidRequestError(
            f"tensor {unsigned!r} has no digest: every tensor pushed as {load_format!r} carries the "
            "xxh3-128 digest of its bytes, checked as it is copied (PushPublisher sends them)"
        )
    return document

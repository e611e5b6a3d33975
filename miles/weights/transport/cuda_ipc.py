"""A flat bucket in GPU memory handed to another process on the node as CUDA IPC handles.

Both halves (``share``, ``open_shared``) use what ``torch.multiprocessing`` shares a CUDA tensor
with, sent as JSON (``CudaIpcHandle``), never pickled: unpickling a request runs whatever code it names.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from miles.errors import InvalidRequestError


class CudaIpcHandle(BaseModel):
    """A flat uint8 CUDA tensor of another process's, as ``torch.multiprocessing`` shares it
    (``reduce_tensor``): the bytes of its IPC handles in base64, and where the tensor lies."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: Annotated[int, Field(ge=0, le=1023)]
    numel: Annotated[int, Field(ge=0)]
    storage_offset: Annotated[int, Field(ge=0)]
    storage_handle: Annotated[str, Field(min_length=1, max_length=4096)]
    storage_size_bytes: Annotated[int, Field(ge=0)]
    storage_offset_bytes: Annotated[int, Field(ge=0)]
    ref_counter_handle: Annotated[str, Field(min_length=1, max_length=4096)]
    ref_counter_offset: Annotated[int, Field(ge=0)]
    event_handle: Annotated[str, Field(max_length=4096)] | None = None
    event_sync_required: bool = False


def share(buffer: torch.Tensor) -> CudaIpcHandle:
    """How another process on this machine opens the flat uint8 CUDA tensor ``buffer``. Each call
    makes a handle of its own: each process that opens one releases its own reference."""
    _, shared = reduce_tensor(buffer)
    (_, _, _, offset, _, _, device, handle, size, storage_offset, _, ref_handle, ref_offset, event, sync) = shared
    return CudaIpcHandle(
        device=device,
        numel=buffer.numel(),
        storage_offset=offset,
        storage_handle=base64.b64encode(handle).decode(),
        storage_size_bytes=size,
        storage_offset_bytes=storage_offset,
        ref_counter_handle=base64.b64encode(ref_handle).decode(),
        ref_counter_offset=ref_offset,
        event_handle=base64.b64encode(event).decode() if event else None,
        event_sync_required=bool(sync),
    )


def open_shared(handle: CudaIpcHandle, needed: int) -> torch.Tensor:
    """The sender's flat uint8 CUDA tensor, opened from its IPC handles without unpickling anything.
    Raises InvalidRequestError when it holds fewer than ``needed`` bytes or cannot be opened here."""
    if handle.numel < needed:
        raise InvalidRequestError(f"the CUDA buffer holds {handle.numel} bytes, fewer than the {needed} of its table")
    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([handle.numel]),
            (1,),
            handle.storage_offset,
            torch.storage.TypedStorage,
            torch.uint8,
            handle.device,
            base64.b64decode(handle.storage_handle, validate=True),
            handle.storage_size_bytes,
            handle.storage_offset_bytes,
            False,
            base64.b64decode(handle.ref_counter_handle, validate=True),
            handle.ref_counter_offset,
            base64.b64decode(handle.event_handle, validate=True) if handle.event_handle else None,
            handle.event_sync_required,
        )
    except (binascii.Error, RuntimeError) as exc:
        raise InvalidRequestError(
            f"the CUDA IPC handle cannot be opened ({exc}): the sender must run on this engine's node, "
            "with its buffer alive until the push is answered"
        ) from None

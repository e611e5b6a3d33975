"""A push's calls to a vLLM server (``WindowServer.engine == "vllm"``), made with vLLM's native
weight-transfer routes, which miles' backend in its worker (``miles.vllm.transfer``) reads; the
table of which route stands for which call is in docs/VLLM.md. CUDA IPC handles are refused by
name: the backend reads shared memory and broadcasts only.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import BaseModel

from miles.controller.results import WindowServer
from miles.errors import PublishError
from miles.protocol.sglang_weights import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)
from miles.weights.transport.documents import SHM_LOAD_FORMAT

# How much of a server's message a failure quotes.
QUOTED_CHARS = 500


async def post_to_vllm(
    http: httpx.AsyncClient, server: WindowServer, request: BaseModel, *, sessions: set[str] | None
) -> None:
    """Make the vLLM calls that stand for ``request`` on ``server`` (``sessions``: the servers whose
    session this push has begun); PublishError naming the call that failed and what it said."""
    for route, body in _calls(server, request, began=sessions is not None and server.server_id in sessions):
        try:
            answer = await http.post(f"{server.url}{route}", json=body)
        except httpx.HTTPError as exc:
            raise PublishError(
                f"{server.server_id} at {server.url} did not answer {route} ({type(exc).__name__}: {exc})"
            ) from None
        if answer.status_code >= 400:
            raise PublishError(
                f"{server.server_id}: {route} answered {answer.status_code}: {answer.text[:QUOTED_CHARS]}"
            )
        if sessions is not None and route == "/start_weight_update":
            sessions.add(server.server_id)
        if sessions is not None and route == "/finish_weight_update":
            sessions.discard(server.server_id)


def _calls(server: WindowServer, request: BaseModel, *, began: bool) -> list[tuple[str, dict[str, Any] | None]]:
    """The routes and bodies that stand for ``request``, in order."""
    if isinstance(request, InitWeightsUpdateGroupRequest):
        return [("/init_weight_transfer_engine", {"init_info": request.model_dump(mode="json")})]
    if isinstance(request, DestroyWeightsUpdateGroupRequest):
        return [("/shutdown_weight_transfer_engine", None)]
    if isinstance(request, UpdateWeightsFromTensorRequest):
        if request.load_format != SHM_LOAD_FORMAT:
            raise PublishError(
                f"{server.server_id} is a vLLM server: it reads buckets from shared memory or a broadcast, not "
                f"{request.load_format}; push from CPU tensors"
            )
        bucket: dict[str, Any] = {"document": request.serialized_named_tensors[0]}
    elif isinstance(request, UpdateWeightsFromDistributedRequest):
        bucket = {"distributed": request.model_dump(mode="json")}
    else:
        raise PublishError(f"{server.server_id} is a vLLM server: a push cannot send it {type(request).__name__}")
    calls: list[tuple[str, dict[str, Any] | None]] = [] if began else [("/start_weight_update", None)]
    calls.append(("/update_weights", {"update_info": bucket}))
    if request.expected_checksum is not None:
        calls.append(("/finish_weight_update", {"weight_version": request.weight_version}))
        calls.append(("/reset_prefix_cache", None))
    return calls

"""One call to every engine of a window at once (``post_all``; ``EngineCalls`` for one push's),
and what a push's calls cost (``PushStats``). A refusal is a PublishError naming each engine that
refused (and the ``Refusal`` one named). A vLLM server (``WindowServer.engine == "vllm"``) is called
with vLLM's native weight-transfer routes, which miles' backend in its worker
(``miles.vllm.transfer``) reads; which route stands for which call is in docs/VLLM.md."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from miles.controller.results import UpdateWindow, WindowServer
from miles.errors import PublishError, Refusal
from miles.protocol.base import ErrorAnswer
from miles.protocol.sglang_weights import (
    DestroyWeightsUpdateGroupRequest,
    GroupResponse,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResponse,
)
from miles.weights.transport.documents import SHM_LOAD_FORMAT

# How much of a server's message a failure quotes.
QUOTED_CHARS = 500

# What each endpoint a push calls answers when it did what it was asked.
_ANSWERS: dict[str, type[UpdateWeightsResponse] | type[GroupResponse]] = {
    "/update_weights_from_tensor": UpdateWeightsResponse,
    "/update_weights_from_distributed": UpdateWeightsResponse,
    "/init_weights_update_group": GroupResponse,
    "/destroy_weights_update_group": GroupResponse,
}


@dataclass
class PushStats:
    """What one push sent and what it cost (``PushPublisher.last``)."""

    path: str
    tensors: int = 0  # sent
    skipped: int = 0  # unchanged since the last committed push (delta)
    buckets: int = 0
    calls: int = 0
    # Each sent tensor's digest, computed while it was packed.
    digests: dict[str, str] = field(default_factory=dict)
    # What each engine reported each update call cost it (seconds per phase), in call order.
    engine_timings: list[dict[str, float]] = field(default_factory=list)
    bytes: int = 0
    # Of ``bytes``, those sent from where they lie, no copy on this side: read by the engines in the
    # trainer's shared memory (``PushPublisher.share_memory``), or broadcast tensor by tensor.
    in_place: int = 0
    # Seconds: "open", "push" and "commit" of the window; within the push, the sender's own
    # phases, summed over buckets: "pack" (copy and digest), "join" (forming the group),
    # "broadcast", and "engines" (waiting for the engines' answers once their bytes are sent).
    timings: dict[str, float] = field(default_factory=dict)

    def spent(self, phase: str, since: float) -> None:
        """Add the time from ``since`` (a ``time.perf_counter()``) to now to ``phase``."""
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - since


@dataclass(frozen=True)
class EngineCalls:
    """One push's calls of weight version ``version`` to the engines of ``window``."""

    http: httpx.AsyncClient
    window: UpdateWindow
    version: str
    stats: PushStats
    # vLLM servers whose weight-transfer session this push has begun.
    vllm_sessions: set[str] = field(default_factory=set)

    async def post(self, path: str, body: Callable[[int], BaseModel], *, fail_fast: bool = False) -> None:
        await post_all(
            self.http,
            self.window,
            path=path,
            body=body,
            stats=self.stats,
            fail_fast=fail_fast,
            vllm_sessions=self.vllm_sessions,
        )


@dataclass(frozen=True)
class _Failure:
    message: str
    refusal: Refusal | None = None


async def post_all(
    http: httpx.AsyncClient,
    window: UpdateWindow,
    *,
    path: str,
    body: Callable[[int], BaseModel],
    stats: PushStats,
    fail_fast: bool = False,
    vllm_sessions: set[str] | None = None,
) -> None:
    """POST ``body(i)`` to the ``i``-th engine of the window, all at once, with its credential. Raises
    PublishError naming each engine that refused or did not answer (with ``fail_fast``, the first, at once)."""
    headers = {"authorization": f"Bearer {window.credential}"} if window.credential else {}
    expected = _ANSWERS[path]

    async def one(index: int, server: WindowServer) -> _Failure | None:
        if server.engine == "vllm":
            try:
                await post_to_vllm(http, server, body(index), sessions=vllm_sessions)
            except PublishError as exc:
                return _Failure(exc.message)
            return None
        try:
            answer = await http.post(f"{server.url}{path}", json=body(index).model_dump(mode="json"), headers=headers)
        except httpx.HTTPError as exc:
            return _Failure(f"{server.server_id} at {server.url} did not answer ({type(exc).__name__}: {exc})")
        stats.calls += 1
        try:
            answered = expected.model_validate_json(answer.content)
        except ValidationError:
            return _refused(server, answer)
        if not answered.success:
            return _Failure(f"{server.server_id}: {answered.message[:QUOTED_CHARS]}")
        if isinstance(answered, UpdateWeightsResponse):
            stats.engine_timings.append(answered.timings)
        return None

    calls = [asyncio.ensure_future(one(i, server)) for i, server in enumerate(window.servers)]
    failures: list[_Failure] = []
    pending: set[asyncio.Future[_Failure | None]] = set(calls)
    try:
        while pending and not (failures and fail_fast):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failures += [failure for call in calls if call in done and (failure := call.result())]
    finally:
        for call in pending:
            call.cancel()
    if failures:
        raise PublishError(
            f"{path} failed: " + "; ".join(f.message for f in failures),
            refusal=next((f.refusal for f in failures if f.refusal is not None), None),
        )


def _refused(server: WindowServer, answer: httpx.Response) -> _Failure:
    """An answer other than success: the engine's error, or what it said, quoted."""
    try:
        error = ErrorAnswer.model_validate_json(answer.content).error
    except ValidationError:
        return _Failure(
            f"{server.server_id} at {server.url} answered {answer.status_code} with a body that is no answer of "
            f"the engine's API: {answer.text[:QUOTED_CHARS]!r}"
        )
    return _Failure(f"{server.server_id}: {error.message[:QUOTED_CHARS]}", refusal=error.refusal)


def answered() -> asyncio.Future[None]:
    """A send's answers when there is nothing left to wait for."""
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


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

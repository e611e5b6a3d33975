"""The engine's HTTP API: SGLang's native endpoints plus OpenAI-compatible ones (thin adapter).

Every handler parses a typed request, calls ``Engine``, and shapes the answer. Every error is
answered as ``{"error": {"message", "type", "code"}}`` (bad input a 4xx, like SGLang), so a client
never meets an HTML page or a dropped connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from miles.engine.access import ENDPOINTS, GRANT_STATE_KEY, EngineAccess, admit, grant_of
from miles.engine.engine import Engine
from miles.engine.openai_routes import chat_to_generate, completion_to_generate, openai_stream
from miles.engine.receiver import WeightGroups, tensor_bucket
from miles.errors import InvalidRequestError
from miles.protocol.auth import FenceRequest, FenceState
from miles.protocol.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from miles.protocol.openai import ChatCompletionRequest, CompletionRequest, chat_body, completion_body, new_id
from miles.protocol.sglang import (
    AbortRequest,
    ContinueGenerationRequest,
    GenerateRequest,
    GenerateResponse,
    PauseGenerationRequest,
)
from miles.protocol.sglang_weights import (
    ActivateWeightsRequest,
    DestroyWeightsUpdateGroupRequest,
    ExportWeightsRequest,
    GroupResponse,
    InitWeightsUpdateGroupRequest,
    PauseGenerationResponse,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResponse,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
    WeightsCheckerResponse,
    WeightsChecksumPayload,
)
from miles.utils.http import MIB, BodyLimit, CheckFirst, error_response, install_error_handlers, sse, until_disconnected
from miles.weights.transport.documents import CUDA_IPC_LOAD_FORMAT
from miles.weights.transport.segments import SegmentMaps

logger = logging.getLogger("miles.engine")


def create_app(engine: Engine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="miles embedded engine", lifespan=lifespan)
    install_error_handlers(
        app, logger=logger, not_found="no such endpoint; see docs/ENGINE.md for the engine's endpoints"
    )
    access = EngineAccess(secret=engine.settings.secret, api_key=engine.settings.api_key)
    # The outermost middleware runs first. Credentials and fences are checked before a body is
    # read, so a caller without the right credential learns nothing from validation messages and
    # costs no parsing; then the body's size is bounded.
    app.add_middleware(
        BodyLimit, max_bytes=engine.settings.max_request_mib * MIB, setting="the engine's --max-request-mib"
    )
    app.add_middleware(CheckFirst, check=access.check_first, key=GRANT_STATE_KEY)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        problem = await engine.health_generate()
        if problem is not None:
            return error_response(problem, code=503, kind="unavailable")
        return Response(status_code=200)

    # SGLang serves both names (the get_ ones are deprecated there); its router asks for the new
    # name first and falls back to the old one.
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {**engine.server_info(), **access.state.model_dump()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return engine.weights.identity().model_dump(mode="json")

    @app.post("/generate")
    async def generate(request: GenerateRequest, http_request: Request) -> Response:
        if request.stream:
            return StreamingResponse(_native_stream(await engine.stream(request)), media_type="text/event-stream")
        result = await until_disconnected(http_request, engine.generate(request))
        if isinstance(result, Response):
            return result
        if isinstance(result, list):
            return JSONResponse([r.model_dump(mode="json") for r in result])
        return JSONResponse(result.model_dump(mode="json"))

    def answered(
        result: UpdateWeightsResponse, *, source: str, started: float, received: float | None = None
    ) -> JSONResponse:
        """A change's answer (400 when refused), counted in the metrics by where it came from."""
        engine.metrics.weight_load(source, started=started, success=result.success)
        body = result.model_dump(mode="json")
        if received is not None:
            # Mapping or receiving the bucket.
            body["timings"] = {"receive": received, **body["timings"]}
        return JSONResponse(body, status_code=200 if result.success else 400)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: UpdateWeightsFromDiskRequest, http_request: Request) -> JSONResponse:
        admit(access, http_request)
        started = time.perf_counter()
        return answered(await engine.changes.update_from_disk(request), source="disk", started=started)

    groups = WeightGroups(device=engine.device)
    segments = SegmentMaps(forget_every_s=1.0)

    async def window_moved(state: FenceState, *, ended: bool = False) -> None:
        """A window that ended (closed, or overtaken by a newer one) takes its groups with it,
        whoever ended it: its pusher may be dead. With ``ended``, the mappings of segments their
        pusher let go of (or died holding) go too, at once (``segments`` looks every second)."""
        over = groups.follow(state)
        if over:
            await asyncio.to_thread(groups.leave, over)
        if ended:
            await asyncio.to_thread(segments.forget_gone)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(
        request: UpdateWeightsFromTensorRequest, http_request: Request
    ) -> JSONResponse:
        admit(access, http_request, activates=request.activate)
        started = time.perf_counter()
        bucket = await asyncio.to_thread(
            tensor_bucket, request, engine.changes.check_table, device=engine.device, segments=segments
        )
        received = time.perf_counter() - started
        source = "CUDA IPC" if request.load_format == CUDA_IPC_LOAD_FORMAT else "shared memory"
        try:
            result = await engine.changes.apply_pushed(bucket, request, source=source)
        finally:
            bucket.close()
        return answered(result, source="tensor", started=started, received=received)

    @app.post("/activate_weights")
    async def activate_weights(request: ActivateWeightsRequest, http_request: Request) -> JSONResponse:
        admit(access, http_request)
        # Nothing may change the weights between their swap and the controller's commit.
        access.close_window()
        await window_moved(access.state)
        started = time.perf_counter()
        return answered(await engine.changes.activate_staged(request), source="activate", started=started)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: InitWeightsUpdateGroupRequest, http_request: Request) -> GroupResponse:
        admit(access, http_request)
        # Groups of windows that ended while this engine could not be told go first: their name
        # is free again for this window's pusher.
        await window_moved(access.state)
        owner = grant_of(http_request)
        return GroupResponse(
            success=True, message=await groups.join_within(request, owner=owner.fence if owner else None)
        )

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(
        request: UpdateWeightsFromDistributedRequest, http_request: Request
    ) -> JSONResponse:
        admit(access, http_request, activates=request.activate)
        started = time.perf_counter()
        async with groups.bucket(request, engine.changes.check_table) as bucket:
            received = time.perf_counter() - started
            result = await engine.changes.apply_pushed(bucket, request, source=f"group {request.group_name}")
        return answered(result, source="distributed", started=started, received=received)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(
        request: DestroyWeightsUpdateGroupRequest, http_request: Request
    ) -> GroupResponse:
        admit(access, http_request)
        return GroupResponse(success=True, message=groups.destroy(request.group_name))

    @app.post("/update_weight_version")
    async def update_weight_version(request: UpdateWeightVersionRequest, http_request: Request) -> dict[str, Any]:
        admit(access, http_request)
        await engine.changes.rename(request)
        return {"success": True, "message": "weight version updated", "new_version": request.new_version}

    @app.post("/pause_generation")
    async def pause_generation(request: PauseGenerationRequest, http_request: Request) -> dict[str, Any]:
        admit(access, http_request)
        paused = await engine.pause(request.mode)
        return PauseGenerationResponse(
            status="ok",
            message=f"Generation paused ({request.mode.value}).",
            mode=request.mode,
            num_paused_requests=paused,
        ).model_dump(mode="json")

    @app.post("/continue_generation")
    async def continue_generation(http_request: Request, _: ContinueGenerationRequest | None = None) -> dict[str, Any]:
        admit(access, http_request)
        engine.resume()
        return {"status": "ok", "message": "Generation continued."}

    @app.post("/abort_request")
    async def abort_request(request: AbortRequest, http_request: Request) -> dict[str, Any]:
        if not request.abort_all and not request.rid:
            raise InvalidRequestError("give a rid to abort, or abort_all=true")
        admit(access, http_request)
        aborted = engine.abort(request.rid, abort_all=request.abort_all, message=request.abort_message)
        return {"success": True, "num_aborted": aborted}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(http_request: Request) -> PlainTextResponse:
        admit(access, http_request)
        # The engine keeps no prefix cache across requests, so there is nothing stale to drop.
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/export_weights")
    async def export_weights(request: ExportWeightsRequest, http_request: Request) -> dict[str, Any]:
        admit(access, http_request)
        return (await engine.weights.export(request)).model_dump(mode="json")

    @app.post("/weights_checker")
    async def weights_checker(http_request: Request, request: WeightsCheckerRequest | None = None) -> dict[str, Any]:
        admit(access, http_request)
        checksum = await engine.weights.checksum()
        held = engine.weights.held
        return WeightsCheckerResponse(
            success=True,
            message=f"checksum of the weights held at version {held.version}",
            payload=WeightsChecksumPayload(
                action=(request or WeightsCheckerRequest()).action,
                checksum=checksum.checksum,
                algorithm=checksum.algorithm,
                num_tensors=len(checksum.tensors),
                num_bytes=checksum.num_bytes,
                weight_version=held.version,
                weights_status=held.status.value,
            ),
        ).model_dump(mode="json")

    @app.post("/fence")
    async def fence(request: FenceRequest, http_request: Request) -> dict[str, Any]:
        admit(access, http_request)
        state = access.move_fence(request)
        await window_moved(state, ended=not request.window_open)
        if not request.window_open:
            # A window ended: what it pushed but did not activate is dropped.
            await engine.changes.discard_push()
        return state.model_dump()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.served_model_name,
                    "object": "model",
                    "created": int(engine.started_at),
                    "owned_by": "miles",
                    "root": str(engine.model_path),
                    "max_model_len": engine.context_length,
                    "weight_version": engine.weights.held.version,
                }
            ],
        }

    async def openai_answer(
        request: CompletionRequest | ChatCompletionRequest, generated: GenerateRequest, http_request: Request
    ) -> Response:
        """An OpenAI-compatible answer: streamed as chunks, or one body of every choice."""
        chat = isinstance(request, ChatCompletionRequest)
        rid, model = new_id("chatcmpl" if chat else "cmpl"), engine.served_model_name
        if request.stream:
            stream = await engine.stream(generated)
            chunks = openai_stream(stream, model=model, rid=rid, chat=chat, usage=request.include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        result = await until_disconnected(http_request, engine.generate(generated))
        if isinstance(result, Response):
            return result
        responses = result if isinstance(result, list) else [result]
        body = chat_body if chat else completion_body
        return JSONResponse(body(responses, model=model, request_id=rid, with_logprobs=bool(generated.return_logprob)))

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http_request: Request) -> Response:
        return await openai_answer(request, completion_to_generate(request), http_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, http_request: Request) -> Response:
        return await openai_answer(request, await chat_to_generate(engine, request), http_request)

    unclassified = sorted({getattr(r, "path", "") for r in app.routes} - ENDPOINTS.keys())
    if unclassified:
        raise RuntimeError(f"routes {unclassified} are missing from miles.engine.access.ENDPOINTS; classify them")
    return app


async def _native_stream(snapshots: AsyncIterator[GenerateResponse]) -> AsyncIterator[bytes]:
    async for snapshot in snapshots:
        yield sse(snapshot.model_dump(mode="json"))
    yield sse("[DONE]")

"""The engine's HTTP API: SGLang's native endpoints plus OpenAI-compatible ones (thin adapter).

Every handler parses a typed request, calls ``Engine``, and shapes the answer; no logic lives
here. Bad input is answered with a 4xx and a message (``{"error": {"message", "type", "code"}}``),
never a 500: malformed JSON and unknown or invalid fields are 400, like SGLang. Every other error
is answered in the same shape too (an unknown path is a 404 with a message, and a bug a logged
JSON 500), so a client never meets an HTML page or a dropped connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from miles.engine.engine import Engine
from miles.errors import InvalidRequestError
from miles.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    completion_body,
    finish_reason,
    new_id,
    versions,
)
from miles.protocol.sglang import (
    AbortRequest,
    ContinueGenerationRequest,
    ExportWeightsRequest,
    GenerateRequest,
    GenerateResponse,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
)

logger = logging.getLogger("miles.engine")

T = TypeVar("T")


def error_body(message: str, *, code: int, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


def _field_path(loc: tuple[object, ...]) -> str:
    # Drop "body" and pydantic's union-branch tags ("function-after[...]", "list[...]").
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and "[" in p)]
    return ".".join(parts) or "body"


def validation_message(exc: RequestValidationError) -> str:
    errors = list(exc.errors())
    # A field typed "X | list[X]" reports a failure for both branches; the list branch's
    # "Input should be a valid list" only adds noise when the value was clearly not a list.
    plain = [e for e in errors if not any(isinstance(p, str) and p.startswith("list[") for p in e.get("loc", ()))]
    errors = plain or errors
    parts: list[str] = []
    for error in errors:
        where = _field_path(tuple(error.get("loc", ())))
        if error.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}"
        if error.get("type") in ("model_attributes_type", "dict_type") and tuple(error.get("loc", ())) == ("body",):
            return "the request body must be a JSON object, sent with Content-Type: application/json"
        if error.get("type") == "missing" and tuple(error.get("loc", ())) == ("body",):
            return "the request needs a JSON body"
        # "Value error, " is pydantic's prefix for our own validators' messages, which say it all.
        msg = str(error.get("msg", "")).removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            text = f"unknown field {where!r}"
        else:
            text = msg if where == "body" else f"{where}: {msg}"
        if text not in parts:
            parts.append(text)
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    """Map validation and request errors to 4xx answers with a message (shared with the controller)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(validation_message(exc), code=400), status_code=400)

    @app.exception_handler(InvalidRequestError)
    async def _refused(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), code=exc.status_code), status_code=exc.status_code)


def install_engine_handlers(app: FastAPI) -> None:
    """The engine's answers to errors that are not request validation: HTTP errors (unknown path,
    wrong method, a body that is not text) in the API's error shape, and a last resort for bugs."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = "the request body could not be parsed: send a JSON object encoded as UTF-8"
        elif exc.status_code == 404:
            message = "no such endpoint; see docs/ENGINE.md for the engine's endpoints"
        elif exc.status_code == 405:
            message = "this endpoint does not accept this HTTP method"
        return JSONResponse(error_body(message, code=exc.status_code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Last resort: nothing a client sends should get here (requests are validated first), but
        # a bug must still answer in the API's error shape and leave its traceback in the log.
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        message = f"internal error ({type(exc).__name__}: {str(exc)[:200]}); see the engine log"
        return JSONResponse(error_body(message, code=500, kind="internal_error"), status_code=500)


_DISCONNECT_POLL_S = 0.25


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Await ``work``, cancelling it if the client goes away meanwhile.

    Starlette never cancels a handler whose client left, so a long generation would run to its
    end for nobody; cancelling the handler's work aborts its sequences in the engine (and, in the
    controller, closes the upstream request, which the engine sees the same way).
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                # Nobody reads this answer; 499 ("client closed request") is what proxies log.
                return Response(status_code=499)
    finally:
        if not task.done():
            task.cancel()


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def create_app(engine: Engine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="miles embedded engine", lifespan=lifespan)
    install_error_handlers(app)
    install_engine_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        problem = await engine.health_generate()
        if problem is not None:
            return JSONResponse(error_body(problem, code=503, kind="unavailable"), status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return engine.server_info()

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return engine.weights.identity().model_dump(mode="json")

    @app.post("/generate")
    async def generate(request: GenerateRequest, http_request: Request) -> Response:
        if request.stream:
            return StreamingResponse(_native_stream(engine.stream(request)), media_type="text/event-stream")
        result = await until_disconnected(http_request, engine.generate(request))
        if isinstance(result, Response):
            return result
        if isinstance(result, list):
            return JSONResponse([r.model_dump(mode="json") for r in result])
        return JSONResponse(result.model_dump(mode="json"))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: UpdateWeightsFromDiskRequest) -> JSONResponse:
        result = await engine.weights.update_from_disk(request)
        return JSONResponse(result.model_dump(mode="json"), status_code=200 if result.success else 400)

    @app.post("/update_weight_version")
    async def update_weight_version(request: UpdateWeightVersionRequest) -> dict[str, Any]:
        await engine.weights.rename(request)
        return {"success": True, "message": "weight version updated", "new_version": request.new_version}

    @app.post("/pause_generation")
    async def pause_generation(request: PauseGenerationRequest) -> dict[str, Any]:
        paused = await engine.pause(request.mode)
        return {
            "status": "ok",
            "message": f"Generation paused ({request.mode.value}).",
            "mode": request.mode.value,
            "num_paused_requests": paused,
        }

    @app.post("/continue_generation")
    async def continue_generation(_: ContinueGenerationRequest | None = None) -> dict[str, Any]:
        engine.resume()
        return {"status": "ok", "message": "Generation continued."}

    @app.post("/abort_request")
    async def abort_request(request: AbortRequest) -> dict[str, Any]:
        if not request.abort_all and not request.rid:
            raise InvalidRequestError("give a rid to abort, or abort_all=true")
        aborted = engine.abort(request.rid, abort_all=request.abort_all, message=request.abort_message)
        return {"success": True, "num_aborted": aborted}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        # The engine keeps no prefix cache across requests, so there is nothing stale to drop.
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/export_weights")
    async def export_weights(request: ExportWeightsRequest) -> dict[str, Any]:
        return (await engine.weights.export(request)).model_dump(mode="json")

    @app.post("/weights_checker")
    async def weights_checker(request: WeightsCheckerRequest | None = None) -> dict[str, Any]:
        checksum = await engine.weights.checksum()
        return {
            "success": True,
            "message": f"checksum of the weights held at version {engine.weight_version}",
            "payload": {
                "action": (request or WeightsCheckerRequest()).action,
                "checksum": checksum.checksum,
                "algorithm": checksum.algorithm,
                "num_tensors": len(checksum.tensors),
                "num_bytes": checksum.num_bytes,
                "weight_version": engine.weight_version,
                "weights_status": engine.weights.held.status.value,
            },
        }

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
                    "weight_version": engine.weight_version,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http_request: Request) -> Response:
        generate_request = _completion_to_generate(request)
        rid = new_id("cmpl")
        if request.stream:
            chunks = _openai_stream(
                engine.stream(generate_request), model=engine.served_model_name, rid=rid, chat=False
            )
            return StreamingResponse(chunks, media_type="text/event-stream")
        result = await until_disconnected(http_request, engine.generate(generate_request))
        if isinstance(result, Response):
            return result
        responses = result if isinstance(result, list) else [result]
        return JSONResponse(
            completion_body(
                responses, model=engine.served_model_name, request_id=rid, with_logprobs=request.logprobs is not None
            )
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, http_request: Request) -> Response:
        generate_request = _chat_to_generate(engine, request)
        rid = new_id("chatcmpl")
        if request.stream:
            chunks = _openai_stream(engine.stream(generate_request), model=engine.served_model_name, rid=rid, chat=True)
            return StreamingResponse(chunks, media_type="text/event-stream")
        result = await until_disconnected(http_request, engine.generate(generate_request))
        if isinstance(result, Response):
            return result
        responses = result if isinstance(result, list) else [result]
        return JSONResponse(
            chat_body(responses, model=engine.served_model_name, request_id=rid, with_logprobs=request.logprobs)
        )

    return app


def _translated(build: Any) -> GenerateRequest:
    # The OpenAI models refuse what the native ones would (miles.protocol.openai), so this only
    # guards against the two drifting apart: a 400 naming the field, not a 500.
    try:
        return build()  # type: ignore[no-any-return]
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors())
        raise InvalidRequestError(f"invalid request: {problems}") from None


def _completion_to_generate(request: CompletionRequest) -> GenerateRequest:
    prompt = request.prompt

    def build() -> GenerateRequest:
        common: dict[str, Any] = {
            "sampling_params": request.sampling_params(),
            "return_logprob": request.logprobs is not None,
            "top_logprobs_num": request.logprobs or 0,
            "stream": request.stream,
        }
        if isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], str)):
            return GenerateRequest(text=prompt, **common)
        return GenerateRequest(input_ids=prompt, **common)

    return _translated(build)


def _chat_to_generate(engine: Engine, request: ChatCompletionRequest) -> GenerateRequest:
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    try:
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template is user data (from the checkpoint); any failure is theirs
        raise InvalidRequestError(f"the model's chat template could not render these messages: {exc}") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return _translated(
        lambda: GenerateRequest(
            input_ids=list(ids),
            sampling_params=request.sampling_params(),
            return_logprob=request.logprobs,
            top_logprobs_num=request.top_logprobs or 0,
            stream=request.stream,
        )
    )


async def _native_stream(snapshots: AsyncIterator[GenerateResponse]) -> AsyncIterator[bytes]:
    async for snapshot in snapshots:
        yield sse(snapshot.model_dump(mode="json"))
    yield sse("[DONE]")


async def _openai_stream(
    snapshots: AsyncIterator[GenerateResponse], *, model: str, rid: str, chat: bool
) -> AsyncIterator[bytes]:
    sent = ""
    kind = "chat.completion.chunk" if chat else "text_completion"
    async for snapshot in snapshots:
        reason = finish_reason(snapshot)
        # Snapshots carry the whole text so far; OpenAI streams deltas. A trailing U+FFFD may be
        # an incomplete UTF-8 sequence that the next token completes, so it is held back.
        stable = snapshot.text if reason is not None else snapshot.text.rstrip("\ufffd")
        delta = ""
        if stable.startswith(sent):  # else a stop string was trimmed from text already sent
            delta, sent = stable[len(sent) :], stable
        if not delta and reason is None:
            continue
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if chat:
            choice["delta"] = {"role": "assistant", "content": delta}
        else:
            choice["text"] = delta
        if reason is not None:
            choice.update(versions(snapshot))
        yield sse({"id": rid, "object": kind, "model": model, "choices": [choice]})
    yield sse("[DONE]")

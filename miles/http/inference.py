"""The data path's requests: what routing needs of each body, and each request sent to the server
the router picks in the shape that server's engine takes.

Requests are routed as they came (the server validates them), less the controller's extension
fields; a ``/generate`` for a vLLM server is translated into completions (docs/VLLM.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

from miles.controller.fleet import Fleet
from miles.controller.router import RouteLease
from miles.errors import InvalidRequestError
from miles.http.proxy import HeldBodies, Proxy, RouteOptions
from miles.protocol.base import Label
from miles.protocol.generate_completions import completion_body, generate_answers, parse_generate
from miles.utils.http import error_response, until_disconnected

# Request bodies from this size on are parsed and re-encoded on a worker thread.
PREPARE_OFF_LOOP_BYTES = 1 << 20
_LABEL: TypeAdapter[str] = TypeAdapter(Label)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Inference:
    """Routes one controller's inference requests (its proxy, fleet and budget of held bodies)."""

    proxy: Callable[[], Proxy]
    fleet: Fleet
    bodies: HeldBodies
    timeout_s: Callable[[], float]

    async def route(self, path: str, request: Request, prepare: Callable[[bytes], Routed]) -> Response:
        """Answer ``request`` to ``path`` from a server of its model (``prepare`` reads its body:
        ``generate_request`` or ``openai_request``); refusals are raised as the errors they are."""
        # The body is held (request.body() keeps it) until the answer: its bytes count against
        # the budget from before it is parsed; the parsed JSON is dropped once the payload is built.
        raw = await request.body()
        with self.bodies.hold(len(raw)):
            routed = await _off_loop_if_large(prepare, raw)
            route = RouteOptions(
                model_name=self.fleet.rollout(routed.model).model_name,
                session_id=routed.session_id,
                min_weight_version=routed.min_weight_version,
                timeout_s=self.timeout_s(),
            )
            with self.bodies.hold(0 if routed.payload is raw else len(routed.payload), refusable=False):
                return await until_disconnected(request, self._send(path, routed, route))

    async def _generate_on_either(self, routed: Routed, route: RouteOptions) -> Response:
        """``/generate`` for a model served by vLLM servers and engines that answer it: the router
        picks the server, then the request is shaped for it; a retry stays with that API."""
        started = time.perf_counter()
        lease = await self.proxy().lease(route)
        # The request's deadline counts from its arrival: the wait for the server is spent.
        route = replace(route, engine=lease.engine, timeout_s=max(route.timeout_s - (time.perf_counter() - started), 0))
        if lease.engine == "vllm":
            return await self._generate_by_completions(routed, route, first=lease)
        return await self.proxy().forward("/generate", routed.payload, route, lease=lease)

    async def _generate_by_completions(
        self, routed: Routed, route: RouteOptions, *, first: RouteLease | None = None
    ) -> Response:
        """``/generate`` as one completions request per prompt (vLLM), each answer turned into
        SGLang's; the first goes to ``first``'s server when the router already picked one."""
        try:
            generate = await _off_loop_if_large(lambda raw: parse_generate(json_object(raw)), routed.payload)
        except BaseException:
            if first is not None:
                self.proxy().release(first)
            raise
        started = time.perf_counter()

        def versions() -> dict[str, str]:
            return {s.server_id: s.weight_version or "" for s in self.fleet.snapshots(route.model_name)}

        async def one(index: int) -> tuple[Response, list[dict[str, Any]] | None]:
            sent = versions()
            body = encoded(completion_body(generate, index))
            answer = await self.proxy().forward("/v1/completions", body, route, lease=first if index == 0 else None)
            if answer.status_code != 200:
                return answer, None
            server = answer.headers.get("x-miles-server", "")
            end = versions().get(server, "")
            try:
                translated = generate_answers(
                    generate,
                    index,
                    bytes(answer.body),
                    versions=(sent.get(server, end), end),
                    latency_s=time.perf_counter() - started,
                )
            except ValueError as exc:
                message = f"{server} answered /v1/completions with what is not a completions answer: {exc}"
                return error_response(message, code=502, kind="bad_gateway"), None
            return answer, translated

        results = await asyncio.gather(*(one(index) for index in range(generate.batch_size)))
        answers: list[dict[str, Any]] = []
        for answer, translated in results:
            if translated is None:
                return answer
            answers += translated
        served_by = ",".join(dict.fromkeys(answer.headers.get("x-miles-server", "") for answer, _ in results))
        body = answers[0] if not generate.is_batch and len(answers) == 1 else answers
        return JSONResponse(body, headers={"x-miles-server": served_by})

    async def _send(self, path: str, routed: Routed, route: RouteOptions) -> Response:
        # The APIs the engines of the model's servers speak (``route`` named a served model).
        engines = {s.engine for s in self.fleet.snapshots(route.model_name)} if path == "/generate" else set()
        if engines == {"vllm"}:
            return await self._generate_by_completions(routed, route)
        if "vllm" in engines:
            if not routed.stream:
                return await self._generate_on_either(routed, route)
            # vLLM's answers are not streamed as SGLang's: a streamed /generate goes to the
            # servers that answer /generate themselves.
            route = replace(route, engine="sglang")
        if routed.stream:
            return await self.proxy().stream(path, routed.payload, route)
        return await self.proxy().forward(path, routed.payload, route)


async def _off_loop_if_large(parse: Callable[[bytes], T], raw: bytes) -> T:
    # Parsing and encoding a body of megabytes takes a while: not on the serving loop.
    return parse(raw) if len(raw) < PREPARE_OFF_LOOP_BYTES else await asyncio.to_thread(parse, raw)


@dataclass(frozen=True)
class Routed:
    """What routing an inference request needs of its body: the payload sent on, and how to route it."""

    payload: bytes
    model: str | None
    session_id: str | None
    min_weight_version: str | None
    stream: bool


def generate_request(raw: bytes) -> Routed:
    """``/generate``: sent on as it came, less the controller's extension fields."""
    return _routed(raw, ("model", "min_weight_version"))


def openai_request(raw: bytes) -> Routed:
    """``/v1/*``: ``model`` picks the fleet's model (the engine serves one and answers under its
    name); ``session_id`` and ``min_weight_version`` are the controller's."""
    return _routed(raw, ("model", "session_id", "min_weight_version"))


def _routed(raw: bytes, extensions: tuple[str, ...]) -> Routed:
    body = json_object(raw)
    ext = {k: body.pop(k) for k in extensions if k in body}
    return Routed(
        payload=raw if not ext else encoded(body),
        model=_text(ext.get("model")),
        # A /generate's session_id is SGLang's own too: read for routing, and sent on.
        session_id=_text(ext.get("session_id", body.get("session_id"))),
        min_weight_version=_version(ext.get("min_weight_version")),
        stream=_streams(body.get("stream")),
    )


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise InvalidRequestError("the request body nests JSON too deeply to parse") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


def encoded(body: dict[str, Any]) -> bytes:
    """``body`` as compact UTF-8 JSON, never larger than what was sent (default separators and
    ASCII escapes could pass the engine's limit); a lone surrogate goes escaped, for the engine
    to refuse by name."""
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


_STREAM: TypeAdapter[bool] = TypeAdapter(bool)


def _streams(value: object) -> bool:
    """Whether the engine will stream: ``stream`` read as the engine reads it (true, 1, "yes" ...)."""
    try:
        return value is not None and _STREAM.validate_python(value)
    except ValidationError:
        return False


def _version(value: object) -> str | None:
    """``min_weight_version``: a version label (1-256 characters, no control characters)."""
    text = _text(value)
    if text is None:
        return None
    try:
        return _LABEL.validate_python(text)
    except ValidationError as exc:
        raise InvalidRequestError(f"min_weight_version: {exc.errors()[0]['msg']}") from None


def _text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise InvalidRequestError(f"expected a string, got {value!r}")

"""The controller's HTTP API (port 8000 by default): a thin adapter over AsyncInferenceController.

Inference: ``/generate`` (SGLang native) and ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models`` (OpenAI), routed to a serving server (``/generate`` to a model served by vLLM goes
as ``/v1/completions``, its answer turned into SGLang's: ``miles.protocol.generate_completions``).
Three request fields are miles extensions and are removed before forwarding: ``model`` on
``/generate`` (which model, when several are served), ``min_weight_version`` (wait for a server at
that version or later) and, on the OpenAI endpoints, ``session_id`` (keep a conversation on one
server; SGLang's ``/generate`` has it natively).

Operations: ``GET /health`` (200 while the fleet can serve, else 503), ``/metrics``, the status page
at ``/`` (and its JSON at ``/status``),
``POST /update_weights`` (+ ``/start``, ``/renew``, ``/end``, ``/abort`` for training-driven windows),
``POST/GET /events``, ``GET/PATCH /config``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import aiohttp
from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, TypeAdapter, ValidationError
from starlette.datastructures import Headers
from starlette.types import Scope

from miles.config import (
    LEASE_TTL_MAX_S,
    LEASE_TTL_MIN_S,
    RUNTIME_CHANGEABLE,
    UPDATE_TIMEOUT_MAX_S,
    UPDATE_TIMEOUT_MIN_S,
    ControllerSettings,
    UpdatePauseMode,
    UpdateStrategy,
)
from miles.controller.core import AsyncInferenceController
from miles.errors import ConflictError, EventLogError, InvalidRequestError, NotFoundError
from miles.http.auth import Access, Credentials
from miles.http.metrics import CONTENT_TYPE, NO_REQUEST_METRICS, ControllerMetrics
from miles.http.proxy import HeldBodies, Proxy, RouteOptions, new_session
from miles.http.status import add_status_page
from miles.protocol.generate_completions import completion_body, generate_answers, parse_generate
from miles.rollout.rollout import Rollout
from miles.utils.audit_utils.event_logger.models import (
    EVENT_ADAPTER,
    EVENT_TYPES,
    ChecksumRole,
    InferenceEngineWeightChecksumEvent,
)
from miles.utils.http import MIB, BodyLimit, CheckFirst, error_response, install_error_handlers, until_disconnected
from miles.weights.paths import path_text_problem

logger = logging.getLogger("miles.controller")

_EXTENSIONS = ("model", "min_weight_version")
# Request bodies from this size on are parsed and re-encoded on a worker thread.
_PREPARE_OFF_LOOP_BYTES = 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _usable_path(value: str) -> str:
    problem = path_text_problem(value)
    if problem is not None:
        raise ValueError(f"the path {problem}")
    return value


PathText = Annotated[str, AfterValidator(_usable_path)]
# One line of a sensible length: names, versions and checksums reach logs, tables and answers as
# they are (a newline in one would forge a log line).
Label = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
# Steps are 64-bit wherever they are stored or compared.
Step = Annotated[int, Field(ge=0, lt=2**63, strict=True)]
_LABEL: TypeAdapter[str] = TypeAdapter(Label)
_EVENT_ID: TypeAdapter[str] = TypeAdapter(Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")])
# How far from the controller's clock the timestamp of a posted event may be.
MAX_POSTED_CLOCK_SKEW_S = 86_400
_STEP: TypeAdapter[int] = TypeAdapter(Step)


class UpdateRequest(_Strict):
    checkpoint: PathText
    model_name: Label | None = None
    strategy: UpdateStrategy | None = None
    pause_mode: UpdatePauseMode | None = None
    timeout_s: Annotated[float, Field(ge=UPDATE_TIMEOUT_MIN_S, le=UPDATE_TIMEOUT_MAX_S)] | None = None
    weight_version: Label | None = None


class StartWindowRequest(_Strict):
    model_name: Label | None = None
    ttl_s: Annotated[float, Field(strict=True, ge=LEASE_TTL_MIN_S, le=LEASE_TTL_MAX_S)] | None = None
    pause_mode: UpdatePauseMode | None = None
    # Servers keep serving while training pushes into their engines' stages (see
    # AsyncInferenceController.start_update_weights).
    staged: StrictBool = False


class EndWindowRequest(_Strict):
    token: Annotated[int, Field(strict=True)]
    checksum: Label
    step: Step
    checkpoint: PathText | None = None
    weight_version: Label | None = None


class RenewWindowRequest(_Strict):
    token: Annotated[int, Field(strict=True)]
    ttl_s: Annotated[float, Field(strict=True, ge=LEASE_TTL_MIN_S, le=LEASE_TTL_MAX_S)] | None = None


class AbortWindowRequest(_Strict):
    token: Annotated[int, Field(strict=True)]
    # Logged as one line: a newline would forge the next one.
    reason: Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00-\x1f\x7f]+$")] = "aborted by training"


def _posted_checksum_problems(event: InferenceEngineWeightChecksumEvent) -> list[str]:
    """What a checksum posted by another process may not hold, by the bounds of this API's own
    requests (the event model itself also records what servers report, unbounded)."""
    fields: list[tuple[str, Any, TypeAdapter[Any]]] = [
        ("model_name", event.model_name, _LABEL),
        ("checksum", event.checksum, _LABEL),
        ("step", event.step, _STEP),
    ]
    if event.weight_version is not None:
        fields.append(("weight_version", event.weight_version, _LABEL))
    fields += [
        ("event_id", event.event_id, _EVENT_ID),
        ("source.component", event.source.component, _LABEL),
        ("source.id", event.source.id, _LABEL),
    ]
    problems = []
    if event.server_id is not None:
        problems.append("server_id: a published checksum is training's, not a server's; leave it out")
    # The audit timeline is ordered by timestamps: one far from the controller's clock would
    # move the event anywhere in it.
    skew = abs((event.timestamp - datetime.now(UTC)).total_seconds())
    if skew > MAX_POSTED_CLOCK_SKEW_S:
        problems.append(
            f"timestamp: {event.timestamp.isoformat()} is {skew:.0f}s away from the controller's clock "
            f"(at most {MAX_POSTED_CLOCK_SKEW_S}s); leave it out to have the controller stamp the event"
        )
    for name, value, adapter in fields:
        try:
            adapter.validate_python(value)
        except ValidationError as exc:
            problems.append(f"{name}: {exc.errors()[0]['msg']}")
    return problems


def create_app(controller: AsyncInferenceController) -> FastAPI:
    enabled = controller.settings.metrics_enabled
    metrics = ControllerMetrics(
        controller.health, waiting=lambda: controller.router.waiting() if controller.router else 0
    )
    if enabled:
        controller.on_update(metrics.update_done)
    sessions: list[aiohttp.ClientSession] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sessions.append(new_session())  # created on the serving loop, which it must belong to
        subscription = controller.event_logger.subscribe(metrics.event) if enabled else None
        try:
            yield
        finally:
            if subscription is not None:
                subscription.close()
            await sessions.pop().close()

    app = FastAPI(title="miles inference controller", lifespan=lifespan)
    install_error_handlers(
        app, logger=logger, not_found="no such endpoint; the controller's API is listed in the README"
    )
    app.add_middleware(BodyLimit, max_bytes=controller.settings.max_request_mib * MIB, setting="MILES_MAX_REQUEST_MIB")
    credentials = Credentials(admin_token=controller.settings.admin_token, api_key=controller.settings.api_key)

    def reader(request: Request) -> None:
        credentials.check(request, Access.READ)

    def admin(request: Request) -> None:
        credentials.check(request, Access.ADMIN)

    # Declared on the route, so a caller without the credential is refused before its body is
    # even parsed.
    as_reader = [Depends(reader)]
    as_admin = [Depends(admin)]

    proxies: list[Proxy] = []
    bodies = HeldBodies(lambda: controller.settings.max_held_request_mib * MIB)

    def proxy() -> Proxy:
        if not proxies:
            assert controller.router is not None, "the controller was not started"
            servers = sum(len(controller.fleet.snapshots(m)) for m in controller.fleet.model_names)
            proxies.append(
                Proxy(
                    router=controller.router,
                    session=sessions[0],
                    metrics=metrics if enabled else NO_REQUEST_METRICS,
                    # Enough for every server to fail once and each to be tried again restarted.
                    max_attempts=2 * servers + 2,
                    on_unreachable=controller.suspect,
                    engine_secret=controller.engine_secret,
                )
            )
        return proxies[0]

    def options(model: str | None, session_id: str | None, min_version: str | None) -> RouteOptions:
        return RouteOptions(
            model_name=controller.fleet.rollout(model).model_name,
            session_id=session_id,
            min_weight_version=min_version,
            timeout_s=controller.settings.request_timeout_s,
        )

    # --- inference -----------------------------------------------------------------------------
    # The body is routed as it came, without a second validation here: the server validates it
    # and its 400 (with the same message) comes back unchanged. Only the extension fields are
    # read and removed.

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        credentials.check(request, Access.READ)
        return await _route("/generate", request, _generate_request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        credentials.check(request, Access.READ)
        return await _route("/v1/completions", request, _openai_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        credentials.check(request, Access.READ)
        return await _route("/v1/chat/completions", request, _openai_request)

    def _translated(model: str | None) -> Rollout | None:
        """The rollout of ``model`` when its servers do not answer SGLang's native /generate (vLLM)."""
        try:
            rollout = controller.fleet.rollout(model)
        except (InvalidRequestError, NotFoundError):
            return None  # the router answers for a model it cannot pick
        return None if rollout.serves_generate else rollout

    async def _generate_by_completions(routed: _Routed, rollout: Rollout) -> Response:
        """``/generate`` for a model whose servers answer only ``/v1/completions``: one completions
        request per prompt, each answer turned into SGLang's (``miles.protocol.generate_completions``)."""
        # As for every routed body: a large one is parsed off the serving loop.
        if len(routed.payload) < _PREPARE_OFF_LOOP_BYTES:
            generate = parse_generate(_json_object(routed.payload))
        else:
            generate = await asyncio.to_thread(lambda: parse_generate(_json_object(routed.payload)))
        route = options(routed.model, routed.session_id, routed.min_weight_version)
        started = time.perf_counter()

        def versions() -> dict[str, str]:
            return {s.server_id: s.weight_version or "" for s in rollout.snapshot()}

        async def one(index: int) -> tuple[Response, list[dict[str, Any]] | None]:
            sent = versions()
            answer = await proxy().forward("/v1/completions", _encoded(completion_body(generate, index)), route)
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

    async def _route(path: str, request: Request, prepare: Callable[[bytes], _Routed]) -> Response:
        # The body is held (request.body() keeps it) until the answer: its bytes count against
        # the budget from before it is parsed; the parsed JSON is dropped once the payload is built.
        raw = await request.body()
        with bodies.hold(len(raw)):
            # Parsing and encoding a body of megabytes takes a while: not on the serving loop.
            routed = prepare(raw) if len(raw) < _PREPARE_OFF_LOOP_BYTES else await asyncio.to_thread(prepare, raw)
            if path == "/generate" and (rollout := _translated(routed.model)) is not None:
                return await until_disconnected(request, _generate_by_completions(routed, rollout))
            route = options(routed.model, routed.session_id, routed.min_weight_version)
            payload = routed.payload
            with bodies.hold(0 if payload is raw else len(payload), refusable=False):
                if routed.stream:
                    return await until_disconnected(request, proxy().stream(path, payload, route))
                return await until_disconnected(request, proxy().forward(path, payload, route))

    @app.get("/v1/models", dependencies=as_reader)
    async def models() -> dict[str, Any]:
        report = controller.health()
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "owned_by": "miles",
                    "weight_version": m.weight_version,
                    "serving": m.serving,
                }
                for name, m in report.models.items()
            ],
        }

    # --- operations ----------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        report = controller.health()
        return JSONResponse(report.model_dump(mode="json"), status_code=200 if report.ok else 503)

    @app.get("/metrics", dependencies=as_reader)
    async def metrics_endpoint() -> Response:
        if not enabled:
            raise NotFoundError("metrics are off on this controller; start it with MILES_METRICS_ENABLED=true")
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    add_status_page(app, controller, metrics=metrics if enabled else None, reader=reader)

    @app.post("/update_weights", dependencies=as_admin)
    async def update_weights(request: UpdateRequest) -> JSONResponse:
        result = await controller.update_rollout_weights(
            Path(request.checkpoint),
            model_name=request.model_name,
            strategy=request.strategy,
            pause_mode=request.pause_mode,
            timeout=request.timeout_s,
            weight_version=request.weight_version,
        )
        return JSONResponse(result.model_dump(mode="json"), status_code=200 if result.ok else 409)

    @app.post("/update_weights/start", dependencies=as_admin)
    async def start_window(request: StartWindowRequest, http_request: Request) -> Any:
        # A caller that goes away while it waits for the lock gets no window: nobody would hold
        # its token, and the fleet would wait out the window's lease.
        window = await until_disconnected(
            http_request,
            controller.start_update_weights(
                request.model_name, ttl_s=request.ttl_s, pause_mode=request.pause_mode, staged=request.staged
            ),
        )
        return window if isinstance(window, Response) else window.model_dump(mode="json")

    @app.post("/update_weights/end", dependencies=as_admin)
    async def end_window(request: EndWindowRequest) -> JSONResponse:
        result = await controller.end_update_weights(
            request.token,
            checksum=request.checksum,
            step=request.step,
            checkpoint=request.checkpoint,
            weight_version=request.weight_version,
        )
        return JSONResponse(result.model_dump(mode="json"), status_code=200 if result.ok else 409)

    @app.post("/update_weights/renew", dependencies=as_admin)
    async def renew_window(request: RenewWindowRequest) -> dict[str, Any]:
        window = await controller.renew_update_weights(request.token, ttl_s=request.ttl_s)
        return window.model_dump(mode="json")

    @app.post("/update_weights/abort", dependencies=as_admin)
    async def abort_window(request: AbortWindowRequest) -> dict[str, Any]:
        result = await controller.abort_update_weights(request.token, reason=request.reason)
        return result.model_dump(mode="json")

    @app.post("/events", dependencies=as_admin)
    async def post_event(body: Annotated[dict[str, Any], Body()]) -> dict[str, str]:
        """Record an event from another process (a trainer publishing its checksum)."""
        try:
            # Strict, as JSON: true is no step 1, nor "114" step 114.
            event = EVENT_ADAPTER.validate_json(json.dumps(body), strict=True)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            raise InvalidRequestError(f"not a valid event ({problems}); known types: {', '.join(EVENT_TYPES)}") from exc
        # The controller logs every other event itself, as it happens: one posted from outside
        # would put an update, a lock, a server state or a server's confirmation into the audit
        # that never was.
        if not isinstance(event, InferenceEngineWeightChecksumEvent):
            raise InvalidRequestError(
                f"a {event.type} event cannot be posted: POST /events records the checksums training "
                "publishes (type inference_engine_weight_checksum); the controller logs the other events itself"
            )
        if event.role is not ChecksumRole.PUBLISHED:
            raise InvalidRequestError(
                f"a checksum with role {event.role.value!r} cannot be posted: the controller records what "
                "servers confirm; training posts role 'published' (the default)"
            )
        out_of_bounds = _posted_checksum_problems(event)
        if out_of_bounds:
            raise InvalidRequestError(f"not a valid event ({'; '.join(out_of_bounds)})")
        if event.model_name not in controller.fleet.model_names:
            raise NotFoundError(
                f"no model {event.model_name!r} is served here (served: {', '.join(controller.fleet.model_names)}); "
                "publish the checksum under the name of the model it is for"
            )
        if any(e.event_id == event.event_id for e in controller.event_logger.events):
            raise ConflictError(f"an event with id {event.event_id!r} is already logged; give each event its own id")
        try:
            logged = controller.event_logger.log(type(event), event, print_log=False)
        except EventLogError as exc:
            raise InvalidRequestError(str(exc)) from exc
        return {"event_id": logged.event_id, "type": logged.type}

    @app.get("/events", dependencies=as_reader)
    async def get_events(
        type: Annotated[str | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
    ) -> dict[str, Any]:
        if type is not None and type not in EVENT_TYPES:
            raise InvalidRequestError(f"unknown event type {type!r}; known types: {', '.join(EVENT_TYPES)}")
        events = [e for e in controller.event_logger.events if type is None or e.type == type]
        return {"events": [e.model_dump(mode="json") for e in events[-limit:]]}

    @app.get("/config", dependencies=as_reader)
    async def get_config() -> dict[str, Any]:
        return controller.settings.runtime_view()

    @app.patch("/config", dependencies=as_admin)
    async def patch_config(patch: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        _check_json_types(patch)
        await controller.reconfigure(patch)
        return controller.settings.runtime_view()

    # Each route's credential, as its dependencies declare it, checked before its body is read.
    levels = {reader: Access.READ, admin: Access.ADMIN}
    guarded = {
        (method, route.path): levels[dependency.dependency]
        for route in app.routes
        if isinstance(route, APIRoute)
        for dependency in route.dependencies
        if dependency.dependency in levels
        for method in route.methods or ()
    }

    def check_first(scope: Scope) -> None:
        access = guarded.get((scope.get("method", ""), scope.get("path", "")))
        if access is not None:
            credentials.check_header(scope["path"], Headers(scope=scope).get("authorization"), access)

    app.add_middleware(CheckFirst, check=check_first, key="miles_access")
    return app


def _check_json_types(patch: dict[str, Any]) -> None:
    """Refuse a setting sent as another JSON type than its own: ``true`` is no 1, ``"5"`` no 5,
    and ``"yes"`` does not switch a safety setting on. (Names and values are checked after.)"""
    problems = []
    for name, value in patch.items():
        info = ControllerSettings.model_fields.get(name)
        if info is None or name not in RUNTIME_CHANGEABLE:
            continue  # refused by name after
        kind: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        try:
            TypeAdapter(kind).validate_json(json.dumps(value), strict=True)
        except ValidationError as exc:
            problems.append(f"{name}: {exc.errors()[0]['msg']}")
    if problems:
        raise InvalidRequestError(f"invalid settings: {'; '.join(problems)}")


@dataclass(frozen=True)
class _Routed:
    """What routing an inference request needs of its body: the payload sent on, and how to route it."""

    payload: bytes
    model: str | None
    session_id: str | None
    min_weight_version: str | None
    stream: bool


def _generate_request(raw: bytes) -> _Routed:
    """``/generate``: sent on as it came, unless it names the controller's extension fields
    (removed: the engine does not take them)."""
    body = _json_object(raw)
    ext = {k: body.pop(k) for k in _EXTENSIONS if k in body}
    return _Routed(
        payload=raw if not ext else _encoded(body),
        model=_text(ext.get("model")),
        session_id=_text(body.get("session_id")),
        min_weight_version=_version(ext.get("min_weight_version")),
        stream=_streams(body.get("stream")),
    )


def _openai_request(raw: bytes) -> _Routed:
    """``/v1/*``: ``model`` picks the fleet's model (the engine serves one and answers under its
    name); ``session_id`` and ``min_weight_version`` are the controller's."""
    body = _json_object(raw)
    model = _text(body.pop("model", None))
    session_id = _text(body.pop("session_id", None))
    min_weight_version = _version(body.pop("min_weight_version", None))
    return _Routed(
        payload=_encoded(body),
        model=model,
        session_id=session_id,
        min_weight_version=min_weight_version,
        stream=_streams(body.get("stream")),
    )


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise InvalidRequestError("the request body nests JSON too deeply to parse") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


def _encoded(body: dict[str, Any]) -> bytes:
    """``body`` as JSON for the engine: compact and UTF-8, so never larger than what was sent
    (Python's default separators and ASCII escapes could push a body past the engine's limit).
    Text with a lone surrogate cannot be UTF-8: it goes escaped, for the engine to refuse by name."""
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


_STREAM: TypeAdapter[bool] = TypeAdapter(bool)


def _streams(value: object) -> bool:
    """Whether the engine will stream its answer: ``stream`` read as the engine reads it (true,
    1, "yes" ...), so the controller relays a stream as one; a value the engine refuses is not."""
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

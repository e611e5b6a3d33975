"""The controller's HTTP API (port 8000 by default): a thin adapter over AsyncInferenceController.

Inference requests are read, shaped and routed by ``miles.http.inference``.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from operator import attrgetter
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
from miles.http.inference import Inference, generate_request, openai_request
from miles.http.metrics import NO_REQUEST_METRICS, ControllerMetrics
from miles.http.proxy import HeldBodies, Proxy, new_session
from miles.http.status import add_status_page
from miles.protocol.base import Label
from miles.protocol.metrics import CONTENT_TYPE
from miles.utils.audit_utils.event_logger.models import (
    EVENT_ADAPTER,
    EVENT_TYPES,
    ChecksumRole,
    InferenceEngineWeightChecksumEvent,
)
from miles.utils.http import MIB, BodyLimit, CheckFirst, install_error_handlers, until_disconnected
from miles.weights.paths import path_text_problem

logger = logging.getLogger("miles.controller")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _usable_path(value: str) -> str:
    if (problem := path_text_problem(value)) is not None:
        raise ValueError(f"the path {problem}")
    return value


PathText = Annotated[str, AfterValidator(_usable_path)]
# Steps are 64-bit wherever they are stored or compared.
Step = Annotated[int, Field(ge=0, lt=2**63, strict=True)]
_LABEL: TypeAdapter[Any] = TypeAdapter(Label)
# How far from the controller's clock the timestamp of a posted event may be.
MAX_POSTED_CLOCK_SKEW_S = 86_400
# The bounds this API keeps a posted checksum's fields to (the event model also records what
# servers report, unbounded).
_EVENT_ID: TypeAdapter[Any] = TypeAdapter(Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")])
_POSTED_BOUNDS = {
    "model_name": _LABEL,
    "checksum": _LABEL,
    "step": TypeAdapter(Step),
    "weight_version": _LABEL,
    "event_id": _EVENT_ID,
    "source.component": _LABEL,
    "source.id": _LABEL,
}


# Each request's fields are the keywords of the controller method its route calls (a window's
# ``token`` and an update's ``checkpoint`` and ``timeout_s`` aside).
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


class _WindowRequest(_Strict):
    token: Annotated[int, Field(strict=True)]


class EndWindowRequest(_WindowRequest):
    checksum: Label
    step: Step
    checkpoint: PathText | None = None
    weight_version: Label | None = None


class RenewWindowRequest(_WindowRequest):
    ttl_s: Annotated[float, Field(strict=True, ge=LEASE_TTL_MIN_S, le=LEASE_TTL_MAX_S)] | None = None


class AbortWindowRequest(_WindowRequest):
    # Logged as one line: a newline would forge the next one.
    reason: Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00-\x1f\x7f]+$")] = "aborted by training"


def _posted_checksum_problems(event: InferenceEngineWeightChecksumEvent) -> list[str]:
    """What a checksum posted by another process breaks of ``_POSTED_BOUNDS`` and the clock."""
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
    for name, adapter in _POSTED_BOUNDS.items():
        if (value := attrgetter(name)(event)) is None:
            continue
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

    bodies = HeldBodies(lambda: controller.settings.max_held_request_mib * MIB)

    @functools.cache  # built at the first request, once the controller has started and the session exists
    def proxy() -> Proxy:
        assert controller.router is not None, "the controller was not started"
        servers = sum(len(controller.fleet.snapshots(m)) for m in controller.fleet.model_names)
        return Proxy(
            router=controller.router,
            session=sessions[0],
            metrics=metrics if enabled else NO_REQUEST_METRICS,
            # Enough for every server to fail once and each to be tried again restarted.
            max_attempts=2 * servers + 2,
            on_unreachable=controller.suspect,
            engine_secret=controller.engine_secret,
        )

    inference = Inference(
        proxy=proxy, fleet=controller.fleet, bodies=bodies, timeout_s=lambda: controller.settings.request_timeout_s
    )

    # --- inference (miles.http.inference) ------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        credentials.check(request, Access.READ)
        return await inference.route("/generate", request, generate_request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        credentials.check(request, Access.READ)
        return await inference.route("/v1/completions", request, openai_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        credentials.check(request, Access.READ)
        return await inference.route("/v1/chat/completions", request, openai_request)

    @app.get("/v1/models", dependencies=as_reader)
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                dict(id=name, object="model", owned_by="miles", weight_version=m.weight_version, serving=m.serving)
                for name, m in controller.health().models.items()
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
        options = request.model_dump(exclude={"checkpoint", "timeout_s"})
        result = await controller.update_rollout_weights(Path(request.checkpoint), timeout=request.timeout_s, **options)
        return JSONResponse(result.model_dump(mode="json"), status_code=200 if result.ok else 409)

    @app.post("/update_weights/start", dependencies=as_admin)
    async def start_window(request: StartWindowRequest, http_request: Request) -> Any:
        # A caller that goes away while it waits for the lock gets no window: nobody would hold
        # its token, and the fleet would wait out the window's lease.
        window = await until_disconnected(http_request, controller.start_update_weights(**request.model_dump()))
        return window if isinstance(window, Response) else window.model_dump(mode="json")

    @app.post("/update_weights/end", dependencies=as_admin)
    async def end_window(request: EndWindowRequest) -> JSONResponse:
        result = await controller.end_update_weights(request.token, **request.model_dump(exclude={"token"}))
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
        if out_of_bounds := _posted_checksum_problems(event):
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
        type: Annotated[str | None, Query()] = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 200
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
        if (access := guarded.get((scope.get("method", ""), scope.get("path", "")))) is not None:
            credentials.check_header(scope["path"], Headers(scope=scope).get("authorization"), access)

    app.add_middleware(CheckFirst, check=check_first, key="miles_access")
    return app


def _check_json_types(patch: dict[str, Any]) -> None:
    """Refuse a setting sent as another JSON type than its own: ``true`` is no 1, ``"5"`` no 5,
    and ``"yes"`` does not switch a safety setting on."""
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

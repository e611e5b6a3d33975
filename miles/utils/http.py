"""What every miles HTTP API shares: its error shape, the one table from errors to status codes,
a bound on the size of request bodies, bearer credentials checked before a body is read, and
waiting on work that a departed client no longer wants.

Domain code raises ``MilesError`` subclasses and never picks a status code; ``install_error_handlers``
answers every failure as ``{"error": {"message", "type", "code"}}`` (plus ``"refusal"``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from miles.errors import (
    AuthenticationError,
    ConflictError,
    InsufficientStorageError,
    InvalidRequestError,
    LockError,
    LockTimeoutError,
    MilesError,
    NotFoundError,
    PermissionDeniedError,
    QueueFullError,
    Refusal,
    UnavailableError,
)

T = TypeVar("T")

# The one table from errors to status codes; the first entry an error is an instance of wins.
ERROR_STATUS: tuple[tuple[type[MilesError], int, str], ...] = (
    (InvalidRequestError, 400, "invalid_request_error"),
    (AuthenticationError, 401, "authentication_error"),
    (PermissionDeniedError, 403, "permission_error"),
    (NotFoundError, 404, "not_found_error"),
    (ConflictError, 409, "conflict_error"),
    (QueueFullError, 429, "rate_limit_error"),
    (LockTimeoutError, 503, "timeout"),
    (LockError, 409, "lock"),
    (UnavailableError, 503, "unavailable"),
    (InsufficientStorageError, 507, "insufficient_storage"),
)


def status_of(exc: MilesError) -> tuple[int, str] | None:
    """The status code and error type the table gives ``exc``; None for an error not in it."""
    for kind, code, name in ERROR_STATUS:
        if isinstance(exc, kind):
            return code, name
    return None


def error_body(
    message: str, *, code: int, kind: str = "invalid_request_error", refusal: Refusal | None = None
) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": kind, "code": code}
    if refusal is not None:
        error["refusal"] = refusal.value
    return {"error": error}


def error_response(
    message: str, *, code: int, kind: str, headers: Mapping[str, str] | None = None, refusal: Refusal | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, code=code, kind=kind, refusal=refusal), status_code=code, headers=headers)


def _field_path(loc: tuple[object, ...]) -> str:
    # Drop "body" and pydantic's union-branch tags ("function-after[...]", "list[...]").
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and "[" in p)]
    return ".".join(parts) or "body"


def validation_message(exc: RequestValidationError) -> str:
    """One line naming every invalid field and why, for a 400."""
    errors = list(exc.errors())
    # A field typed "X | list[X]" reports a failure for both branches; the list branch's
    # "Input should be a valid list" only adds noise when the value was clearly not a list.
    plain = [e for e in errors if not any(isinstance(p, str) and p.startswith("list[") for p in e.get("loc", ()))]
    errors = plain or errors
    parts: dict[str, None] = {}  # an ordered set
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
        parts[text] = None
    return "invalid request: " + "; ".join(parts)


def refusal(exc: MilesError) -> JSONResponse | None:
    """The answer the table gives ``exc``; None when it has no entry for it (a bug)."""
    mapped = status_of(exc)
    if mapped is None:
        return None
    code, kind = mapped
    headers = {"www-authenticate": "Bearer"} if code == 401 else None
    if isinstance(exc, QueueFullError):
        # When to try again: 0 from an engine (now, elsewhere, as SGLang answers).
        headers = {"retry-after": str(exc.retry_after_s)}
    return error_response(str(exc), code=code, kind=kind, headers=headers, refusal=exc.refusal)


def install_error_handlers(app: FastAPI, *, logger: logging.Logger, not_found: str) -> None:
    """Answer every failure of ``app`` in the error shape; ``not_found`` answers an unknown path:
    validation as 400, the table's errors with their code, anything else as a logged 500."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_message(exc), code=400, kind="invalid_request_error")

    @app.exception_handler(MilesError)
    async def _refused(request: Request, exc: MilesError) -> JSONResponse:
        return refusal(exc) or internal_error(request.method, request.url.path, exc, logger=logger)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals, in the API's shape rather than {"detail": ...}.
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = "the request body could not be parsed: send a JSON object encoded as UTF-8"
        elif exc.status_code == 404:
            message = not_found
        elif exc.status_code == 405:
            message = "this endpoint does not accept this HTTP method"
        return error_response(message, code=exc.status_code, kind="invalid_request_error", headers=exc.headers)

    app.add_middleware(CatchAll, logger=logger)


def internal_error(method: str, path: str, exc: BaseException, *, logger: logging.Logger) -> JSONResponse:
    """A bug's answer, in the API's error shape, with its traceback in the log."""
    logger.error("unhandled error on %s %s", method, path, exc_info=exc)
    message = f"internal error ({type(exc).__name__}: {str(exc)[:200]}); this is a bug in miles, see its log"
    return error_response(message, code=500, kind="internal_error")


class CatchAll:
    """ASGI middleware: an exception no handler took becomes the 500 of ``internal_error``, and
    the connection stays open. (Starlette's own last-resort handler re-raises after answering,
    and the server then drops the connection: a client's next request on it fails.)"""

    def __init__(self, app: ASGIApp, *, logger: logging.Logger) -> None:
        self.app = app
        self.logger = logger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except ClientDisconnect:
            # The client went away before its request was read: no one to answer, nothing wrong here.
            self.logger.debug("client left %s %s before sending its whole body", scope["method"], scope["path"])
        except Exception as exc:
            if started:
                raise  # part of an answer is out: nothing can be said in its place
            response = internal_error(scope["method"], scope["path"], exc, logger=self.logger)
            await response(scope, receive, send)


# The largest request body an API reads unless its settings say otherwise: room for a batch of
# long prompts sent as token ids, while parsing what it lets in stays a matter of a second or two.
DEFAULT_MAX_REQUEST_MIB = 64
MIB = 1 << 20


# An oversized body is read and dropped (up to this much) before the refusal is sent: a server
# that closes a connection with unread input resets it, and the reset can destroy the refusal
# before the client reads it.
DRAIN_MAX_BYTES = 1 << 30


# How long a request's body may stop arriving before the request is refused (408): a client
# that sends headers and then a byte a minute would otherwise hold its connection, and what it
# sent, for as long as it liked.
BODY_IDLE_TIMEOUT_S = 30.0


class BodyLimit:
    """ASGI middleware: a body larger than ``max_bytes`` is refused with 413 (none of it past
    ``max_bytes`` kept), one that stops arriving for ``BODY_IDLE_TIMEOUT_S`` with 408. ``setting`` names
    what raises the limit, for the message."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, setting: str) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.setting = setting

    def _message(self, size: str) -> str:
        return (
            f"the request body ({size}) is larger than this server reads ({self.max_bytes / MIB:g} MiB); "
            f"send less per request (several smaller batches), or raise {self.setting}"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        # The HTTP layer ends a body at its declared length, so only that needs checking; a
        # chunked body has none, and is counted as it arrives.
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            message = self._message(f"{int(declared)} bytes")
            refusal = error_response(message, code=413, kind="invalid_request_error", headers={"connection": "close"})
            await answer_unread(refusal, scope, receive, send)
            return
        received = 0
        complete = False

        async def watched() -> Message:
            # Refusals raised here are answered by the app's error handlers (HTTPException).
            nonlocal received, complete
            if complete:
                return await receive()  # the body is in: what comes is the client leaving
            try:
                message = await asyncio.wait_for(receive(), BODY_IDLE_TIMEOUT_S)
            except TimeoutError:
                raise StarletteHTTPException(
                    408,
                    f"the request body stopped arriving: nothing came for {BODY_IDLE_TIMEOUT_S:g}s; send the "
                    "whole body without pausing",
                    {"connection": "close"},
                ) from None
            if message["type"] != "http.request":
                complete = True
                return message
            received += len(message.get("body", b""))
            complete = not message.get("more_body", False)
            if declared is None and received > self.max_bytes:
                if not complete:
                    await drain(receive, DRAIN_MAX_BYTES - received)
                raise StarletteHTTPException(
                    413, self._message(f"more than {self.max_bytes} bytes, chunked"), {"connection": "close"}
                )
            return message

        await self.app(scope, watched, send)


def bearer(authorization: str | None, *, path: str, needs: str) -> str:
    """The credential an ``Authorization: Bearer`` header presents; AuthenticationError (401)
    without one, naming what ``path`` ``needs``."""
    if authorization is None or not authorization.strip():
        raise AuthenticationError(f"{path} needs {needs}: send `Authorization: Bearer <credential>`")
    scheme, _, presented = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise AuthenticationError(f"{path} needs {needs}: the Authorization header must be `Bearer <credential>`")
    return presented.strip()


def presents_one_of(presented: str, accepted: Iterable[SecretStr]) -> bool:
    """Whether ``presented`` is one of the ``accepted`` secrets, every one compared in constant time
    (a refusal's timing tells nothing). Headers arrive as latin-1: encoding back gives the bytes sent."""
    offered = presented.encode("latin-1", "replace")
    return any([hmac.compare_digest(offered, secret.get_secret_value().encode()) for secret in accepted])


class CheckFirst:
    """ASGI middleware: ``check(scope)`` runs before anything reads a request's body (its result
    kept in the request's state under ``key``; a ``MilesError`` it raises answered here, the body
    unread). FastAPI parses a body before a route's dependencies run: a credential checked there
    would first parse whatever an unauthenticated caller sent, 64 MiB of it if it liked."""

    def __init__(self, app: ASGIApp, *, check: Callable[[Scope], object], key: str) -> None:
        self.app = app
        self.check = check
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            granted = self.check(scope)
        except MilesError as exc:
            answer = refusal(exc)
            if answer is None:
                raise
            await answer_unread(answer, scope, receive, send)
            return
        scope.setdefault("state", {})[self.key] = granted
        await self.app(scope, receive, send)


async def answer_unread(answer: Response, scope: Scope, receive: Receive, send: Send) -> None:
    """Send ``answer`` to a request whose body nothing read, draining the body first (see
    ``DRAIN_MAX_BYTES``), unless the client sent ``Expect: 100-continue``: it has sent nothing yet,
    and reading would tell it to send everything."""
    headers = Headers(scope=scope)
    declared = headers.get("content-length")
    too_large = declared is not None and declared.isdigit() and int(declared) > DRAIN_MAX_BYTES
    if not too_large and headers.get("expect", "").lower() != "100-continue":
        await drain(receive, DRAIN_MAX_BYTES)
    await answer(scope, receive, send)


async def drain(receive: Receive, budget: int) -> None:
    """Read and drop the rest of a body: at most ``budget`` bytes, until ``BODY_IDLE_TIMEOUT_S`` idle."""
    while budget > 0:
        try:
            message = await asyncio.wait_for(receive(), BODY_IDLE_TIMEOUT_S)
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


_DISCONNECT_POLL_S = 0.25


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Await ``work``, cancelling it if the client goes away meanwhile: Starlette never cancels a
    handler whose client left, so a long generation would run to its end for nobody."""
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
    """One server-sent event carrying ``payload`` (a JSON object, or a literal like ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()

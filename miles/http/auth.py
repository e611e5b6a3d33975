"""Who may call the controller's HTTP API: bearer tokens checked at the edge (adapter).

Two credentials, both optional and read once at start-up (docs/SECURITY.md):
- the admin token (``MILES_ADMIN_TOKEN``) guards everything that changes weights, settings or
  the event log: updates, training windows, ``POST /events``, ``PATCH /config``;
- the API key (``MILES_API_KEY``) guards inference and the read-only endpoints, OpenAI-style
  (``Authorization: Bearer <key>``); the admin token is accepted there too.
``GET /health`` stays open: orchestrators and load balancers probe it without credentials.
A route that declares its credential is refused before its body is read (``CredentialsFirst``).
Without an admin token, the changing endpoints fall back to the API key, so that setting only a
key never leaves weights open to callers the key shuts out of inference.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from fastapi import Request
from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from miles.errors import AuthenticationError, MilesError, PermissionDeniedError
from miles.utils.http import DRAIN_MAX_BYTES, drain, refusal


class Access(Enum):
    READ = "read"  # inference and read-only endpoints
    ADMIN = "admin"  # weight-, config- and event-changing endpoints


@dataclass(frozen=True)
class Credentials:
    admin_token: SecretStr | None
    api_key: SecretStr | None

    def check(self, request: Request, access: Access) -> None:
        """Return if the request may have ``access``; raise InvalidRequestError 401/403 otherwise."""
        accepted = self._accepted(access)
        if not accepted:
            return
        header = request.headers.get("authorization")
        what = "the admin token (MILES_ADMIN_TOKEN)" if access is Access.ADMIN and self.admin_token else "the API key"
        if header is None:
            raise AuthenticationError(
                f"{request.method} {request.url.path} needs {what}: send `Authorization: Bearer <token>`",
            )
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise AuthenticationError("the Authorization header must be `Bearer <token>`")
        offered = presented.strip().encode()
        # Compare against every accepted secret without stopping at the first match: the time
        # taken must not tell which secret (or how much of one) was guessed right.
        matches = [hmac.compare_digest(offered, secret.get_secret_value().encode()) for secret in accepted]
        if not any(matches):
            raise PermissionDeniedError(
                f"the token does not grant {access.value} access to {request.url.path}; it needs {what}",
            )

    def _accepted(self, access: Access) -> list[SecretStr]:
        if access is Access.ADMIN:
            return [self.admin_token] if self.admin_token else ([self.api_key] if self.api_key else [])
        return [s for s in (self.api_key, self.admin_token) if s] if self.api_key else []


class CredentialsFirst:
    """ASGI middleware: a request for a route in ``guarded`` ((method, path) -> access) is checked
    before anything reads its body. FastAPI parses a route's body before its dependencies run, so
    a route's own credential check would first parse (and answer about) whatever an
    unauthenticated caller sent, 64 MiB of it if it liked."""

    def __init__(self, app: ASGIApp, *, guarded: Mapping[tuple[str, str], Access], credentials: Credentials) -> None:
        self.app = app
        self.guarded = guarded
        self.credentials = credentials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        access = self.guarded.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        if access is not None:
            try:
                self.credentials.check(Request(scope), access)
            except MilesError as exc:
                answer = refusal(exc)
                if answer is None:
                    raise
                # Read and dropped, never parsed: a connection closed with unread input is reset,
                # which can destroy the answer before the client reads it.
                await drain(receive, DRAIN_MAX_BYTES)
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)

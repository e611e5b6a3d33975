"""Who may call the controller's HTTP API: bearer tokens checked at the edge (adapter).

The admin token guards what changes weights, settings or the event log, the API key (or the admin
token) inference and the read-only endpoints; ``GET /health`` stays open (docs/SECURITY.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from fastapi import Request
from pydantic import SecretStr

from miles.errors import PermissionDeniedError
from miles.utils.http import bearer, presents_one_of


class Access(Enum):
    READ = "read"  # inference and read-only endpoints
    ADMIN = "admin"  # weight-, config- and event-changing endpoints


@dataclass(frozen=True)
class Credentials:
    admin_token: SecretStr | None
    api_key: SecretStr | None

    def check(self, request: Request, access: Access) -> None:
        """Return if the request may have ``access``; else AuthenticationError or PermissionDeniedError."""
        self.check_header(request.url.path, request.headers.get("authorization"), access)

    def check_header(self, path: str, authorization: str | None, access: Access) -> None:
        accepted = self._accepted(access)
        if not accepted:
            return
        what = "the admin token (MILES_ADMIN_TOKEN)" if access is Access.ADMIN and self.admin_token else "the API key"
        if not presents_one_of(bearer(authorization, path=path, needs=what), accepted):
            raise PermissionDeniedError(f"the token does not grant {access.value} access to {path}; it needs {what}")

    def _accepted(self, access: Access) -> list[SecretStr]:
        if access is Access.ADMIN:
            return [self.admin_token] if self.admin_token else ([self.api_key] if self.api_key else [])
        return [s for s in (self.api_key, self.admin_token) if s] if self.api_key else []

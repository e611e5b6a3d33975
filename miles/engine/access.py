"""Who may call which engine endpoint, and the fence that keeps superseded updates out (adapter).

Endpoints are open, inference or control (``ENDPOINTS``); the credentials each takes and the
fencing rules are in docs/ENGINE.md. The check runs before the body is read (``check_first``), the
fence moves only once the handler runs (``admit``). Everything here runs on the event loop, and no
check awaits between reading and writing the fence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import Scope

from miles.errors import ConflictError, InvalidRequestError, PermissionDeniedError
from miles.protocol.auth import FENCE_HEADER, MAX_FENCE, FenceRequest, FenceState, is_window_credential, window_token
from miles.utils.http import bearer, presents_one_of

logger = logging.getLogger("miles.engine")


class WindowState(Enum):
    """The window of the engine's fencing token: its credential works only while it is open, and
    only to stage weights while it is staged (its servers serve meanwhile)."""

    CLOSED = "closed"
    OPEN = "open"
    STAGED = "open, staged"


class Kind(Enum):
    OPEN = "open"
    INFERENCE = "inference"  # inference and read-only endpoints: the API key (or the secret)
    CONTROL = "control"  # weight- and generation-changing endpoints: the secret (or a window credential)


# Every path the engine serves, by kind. ``create_app`` refuses to build an app with a route
# missing here, so a new endpoint cannot be left unguarded by forgetting it.
ENDPOINTS: dict[str, Kind] = {
    "/health": Kind.OPEN,
    **{
        path: Kind.CONTROL
        for path in (
            "/update_weights_from_disk",
            "/update_weights_from_tensor",
            "/activate_weights",
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/destroy_weights_update_group",
            "/update_weight_version",
            "/pause_generation",
            "/continue_generation",
            "/abort_request",
            "/export_weights",
            "/weights_checker",
            "/flush_cache",
            "/fence",
        )
    },
    **{
        path: Kind.INFERENCE
        for path in (
            "/generate",
            "/health_generate",
            "/get_model_info",
            "/model_info",
            "/get_server_info",
            "/server_info",
            "/get_weight_version",
            "/metrics",
            "/v1/models",
            "/v1/completions",
            "/v1/chat/completions",
            "/openapi.json",
            "/docs",
            "/docs/oauth2-redirect",
            "/redoc",
        )
    },
}

_WINDOW_ALLOWED = frozenset(p for p, k in ENDPOINTS.items() if k is Kind.CONTROL) - {"/fence"}
# What the credential of a staged window may call: its servers serve while it is open, so nothing
# that changes what they serve (the pushes themselves only with ``activate=false``).
_STAGING_ALLOWED = frozenset(
    {
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/weights_checker",
    }
)


def kind_of(path: str) -> Kind:
    """The kind of ``path``; a path the engine does not serve needs the API key like inference (it
    answers 404 once let in), so an unknown path never reveals more to a caller without one."""
    return ENDPOINTS.get(path.rstrip("/") or "/", Kind.INFERENCE)


@dataclass(frozen=True)
class ControlGrant:
    """A control call that passed authentication: the fencing token it carries (None: unfenced)
    and, for a window credential, the window it was minted for."""

    fence: int | None
    window: int | None
    # The path called (what a staged window's credential may call depends on it).
    path: str = field(default="", compare=False)


class EngineAccess:
    """The engine's credentials and its fence; one per engine, used on the event loop only."""

    def __init__(self, *, secret: SecretStr | None, api_key: SecretStr | None) -> None:
        self._secret = secret
        self._api_key = api_key
        self._fence = 0
        self._window = WindowState.CLOSED

    @property
    def state(self) -> FenceState:
        return FenceState(fence=self._fence, window_open=self._window is not WindowState.CLOSED)

    # --- authentication (before the body is read) ----------------------------------------------

    def authorize(self, path: str, *, authorization: str | None, fence: str | None) -> ControlGrant | None:
        """Check a call's credential (and, for control calls, its fencing token) without changing
        anything; returns the grant a control call must ``admit``, else None.

        Raises InvalidRequestError: 401 without a credential, 403 with a wrong one or a window
        credential that is closed or superseded, 409 for a stale fencing token, 400 for a
        malformed fence header.
        """
        kind = kind_of(path)
        if kind is Kind.OPEN:
            return None
        if kind is Kind.INFERENCE:
            self._check_inference(path, authorization)
            return None
        window = self._check_control(path, authorization)
        token = _parse_fence(fence)
        if window is not None and token is not None and token != window:
            raise InvalidRequestError(
                f"the {FENCE_HEADER} header ({token}) differs from the window credential's token ({window}); "
                "drop the header or send the window's token",
            )
        grant = ControlGrant(fence=token if window is None else window, window=window, path=path)
        self._check_grant(grant)
        return grant

    def _check_inference(self, path: str, authorization: str | None) -> None:
        # Inference and reads stay open unless an API key is set: the secret guards what changes
        # the weights, not who may read them (the controller sets a key when its own is set).
        if self._api_key is None:
            return
        accepted = [c for c in (self._api_key, self._secret) if c is not None]
        presented = bearer(authorization, path=path, needs="the API key (MILES_API_KEY)")
        if not presents_one_of(presented, accepted):
            raise PermissionDeniedError(
                f"the credential presented for {path} is wrong: it needs the API key (MILES_API_KEY) "
                "or the engine secret",
            )

    def _check_control(self, path: str, authorization: str | None) -> int | None:
        """The window token of a valid window credential, None for the secret (or no credential
        configured); raises 401/403 otherwise."""
        if self._secret is None:
            if self._api_key is not None:
                # No secret: the API key is the engine's only credential, and it guards control too.
                presented = bearer(authorization, path=path, needs="the API key (MILES_API_KEY)")
                if not presents_one_of(presented, [self._api_key]):
                    raise PermissionDeniedError(
                        f"the credential presented for {path} is wrong: this engine has no secret, so its "
                        "control endpoints need the API key (MILES_API_KEY)",
                    )
            return None
        needs = (
            "the engine secret (MILES_ENGINE_SECRET) or a window credential; only the controller that "
            "launched the engine, or a training window it opened, may call it"
        )
        if path.rstrip("/") == "/fence":
            needs = (
                "the engine secret (MILES_ENGINE_SECRET); only the controller that launched the engine "
                "may move its fence"
            )
        presented = bearer(authorization, path=path, needs=needs)
        if presents_one_of(presented, [self._secret]):
            return None
        if is_window_credential(presented):
            window = window_token(self._secret.get_secret_value(), presented)
            if window is not None and path.rstrip("/") in _WINDOW_ALLOWED:
                return window
            if window is not None:
                raise PermissionDeniedError(f"a window credential cannot call {path}: it needs {needs}")
        raise PermissionDeniedError(f"the credential presented for {path} is wrong: it needs {needs}")

    def _check_grant(self, grant: ControlGrant, *, activates: bool = False) -> None:
        window = grant.window
        if window is not None and (window != self._fence or self._window is WindowState.CLOSED):
            raise PermissionDeniedError(
                f"training window {window} is closed or superseded: this engine's fence is {self._fence} "
                f"(window {self._window.value}); ask the controller for a new window",
            )
        if window is not None and self._window is WindowState.STAGED:
            if grant.path.rstrip("/") not in _STAGING_ALLOWED:
                raise PermissionDeniedError(
                    f"training window {window} is staged (its servers serve meanwhile): its credential cannot "
                    f"call {grant.path}; push with activate=false, and the controller's commit activates the weights"
                )
            if activates:
                raise PermissionDeniedError(
                    f"training window {window} is staged (its servers serve meanwhile): a push with activate=true "
                    "would change the weights they serve; push with activate=false, and the controller's commit "
                    "activates them"
                )
        if grant.fence is not None:
            self._check_not_stale(grant.fence)

    def _check_not_stale(self, token: int) -> None:
        if token < self._fence:
            raise ConflictError(
                f"stale fencing token {token}: this engine has seen {self._fence}; a newer update owns it",
            )

    def check_first(self, scope: Scope) -> ControlGrant | None:
        """The check ``CheckFirst`` runs on every request before its body is read (``authorize``);
        what it grants is kept under ``GRANT_STATE_KEY``."""
        headers = Headers(scope=scope)
        authorization, fence = headers.get("authorization"), headers.get(FENCE_HEADER)
        return self.authorize(scope["path"], authorization=authorization, fence=fence)

    # --- changes (once the handler runs) ------------------------------------------------------

    def admit(self, grant: ControlGrant | None, *, activates: bool = False) -> None:
        """Let a control call through: checks again what may have changed since ``authorize`` (the
        body was read in between, and other calls ran) and raises the fence to the call's token.
        ``activates``: the call's body asks to change the served weights (a push with
        ``activate=true``), which a staged window's credential may not.

        Raises InvalidRequestError (409 stale, 403 window closed) like ``authorize``.
        """
        if grant is None or grant.fence is None:
            return
        self._check_grant(grant, activates=activates)
        if grant.fence > self._fence:
            # A newer owner: whatever window the old token had is over.
            self._fence, self._window = grant.fence, WindowState.CLOSED
            logger.info("fence raised to %d by a control call", grant.fence)

    def close_window(self) -> None:
        """End the open window, if any: its credential changes nothing from now on."""
        if self._window is not WindowState.CLOSED:
            self._window = WindowState.CLOSED
            logger.info("fence %d, window closed", self._fence)

    def move_fence(self, request: FenceRequest) -> FenceState:
        """``POST /fence``: raise the fence to ``request.token`` and record its window's state.

        Raises InvalidRequestError (409) for a token below the fence.
        """
        self._check_not_stale(request.token)
        self._fence = request.token
        if not request.window_open:
            self._window = WindowState.CLOSED
        else:
            self._window = WindowState.STAGED if request.staged else WindowState.OPEN
        logger.info("fence %d, window %s", self._fence, self._window.value)
        return self.state


def _parse_fence(raw: str | None) -> int | None:
    if raw is None:
        return None
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 19 or int(text) > MAX_FENCE:
        raise InvalidRequestError(
            f"the {FENCE_HEADER} header must be a fencing token, an integer in [0, {MAX_FENCE}]; got {raw[:40]!r}"
        )
    return int(text)


GRANT_STATE_KEY = "miles_control_grant"


def grant_of(request: Request) -> ControlGrant | None:
    """What ``check_first`` granted ``request`` (None: not a control call, or unchecked)."""
    grant = getattr(request.state, GRANT_STATE_KEY, None)
    return grant if isinstance(grant, ControlGrant) else None


def admit(access: EngineAccess, request: Request, *, activates: bool = False) -> None:
    """Admit the control call ``request`` (see ``EngineAccess.admit``); handlers call it first."""
    access.admit(grant_of(request), activates=activates)

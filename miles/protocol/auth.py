"""Engine credentials and fencing on the wire: the headers, the window credential, ``POST /fence``.

A launched engine holds a secret (``MILES_ENGINE_SECRET``). Control calls carry it as a bearer
token, or a *window credential* the controller mints for a training window: ``mw1.<T>.<hex>``,
``<hex>`` being HMAC-SHA256 over ``miles-window:<T>`` keyed with the secret, worth something only
while the engine's fence is ``T`` and window ``T`` is open. Both sides import the functions below.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from pydantic import Field, StrictBool, StrictInt

from miles.protocol.base import RequestModel, ResponseModel

FENCE_HEADER = "X-Miles-Fence"
WINDOW_CREDENTIAL_VERSION = "mw1"
# A fencing token is a counter; Python ints are unbounded, but no controller counts past this.
MAX_FENCE = 2**63 - 1


def window_credential(secret: str, token: int) -> str:
    """The bearer credential of training window ``token`` on engines holding ``secret``.

    Raises ValueError for a token outside ``[0, MAX_FENCE]`` or an empty secret.
    """
    if not secret:
        raise ValueError("a window credential needs the engine secret; it is empty")
    if not 0 <= token <= MAX_FENCE:
        raise ValueError(f"a fencing token lies in [0, {MAX_FENCE}], got {token}")
    return f"{WINDOW_CREDENTIAL_VERSION}.{token}.{_window_digest(secret, token)}"


def window_token(secret: str, credential: str) -> int | None:
    """The window token ``credential`` was minted for with ``secret``; None when it is not one."""
    parts = credential.split(".")
    if len(parts) != 3 or parts[0] != WINDOW_CREDENTIAL_VERSION:
        return None
    text = parts[1]
    # Only the canonical decimal form: "007" or "+7" would name the same window with other bytes.
    if not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0") or len(text) > 19:
        return None
    token = int(text)
    if token > MAX_FENCE:
        return None
    expected = _window_digest(secret, token).encode()
    # Constant time over the digest: a caller learns nothing from how long a refusal takes.
    return token if hmac.compare_digest(parts[2].encode("utf-8", "surrogateescape"), expected) else None


def is_window_credential(credential: str) -> bool:
    """Whether ``credential`` has the window credential's shape (it may still be invalid)."""
    return credential.startswith(f"{WINDOW_CREDENTIAL_VERSION}.")


def _window_digest(secret: str, token: int) -> str:
    return hmac.new(secret.encode(), f"miles-window:{token}".encode(), hashlib.sha256).hexdigest()


class FenceRequest(RequestModel):
    """``POST /fence`` (secret only): raise the engine's fence to ``token`` and record whether its
    window is open. A ``staged`` window's credential may only stage weights and read their
    checksum (its servers keep serving; the controller's commit activates them)."""

    token: Annotated[StrictInt, Field(ge=0, le=MAX_FENCE)]
    window_open: StrictBool
    staged: StrictBool = False


class FenceState(ResponseModel):
    """The highest fencing token the engine has seen, and whether that token's window is open."""

    fence: int
    window_open: bool

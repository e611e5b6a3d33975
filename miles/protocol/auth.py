"""Engine credentials and fencing on the wire: the headers, the window credential, ``POST /fence``.

An engine launched by a controller holds a secret (``MILES_ENGINE_SECRET``). Control calls carry
``Authorization: Bearer <secret>``, or a *window credential* that the controller mints for a
training window it opened: ``mw1.<T>.<hex>``, where ``<hex>`` is HMAC-SHA256 over
``miles-window:<T>`` keyed with the secret. The credential is only worth something while the
engine's fence is ``T`` and its window ``T`` is open, so a trainer whose window was closed or
superseded cannot change the weights any more, whatever it kept. Both sides import the two
functions below, so the format lives in one place.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from miles.protocol.base import RequestModel

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
    """The window token ``credential`` was minted for with ``secret``, or None when it is not a
    valid window credential for this secret (malformed, other secret, altered token)."""
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
    """``POST /fence`` (secret only): raise the engine's fence to ``token`` and record whether the
    training window with that token is open. A ``staged`` window's servers keep serving while it is
    open, so its credential may only stage weights (``activate=false``) and read their checksum:
    the controller's commit activates them."""

    token: Annotated[StrictInt, Field(ge=0, le=MAX_FENCE)]
    window_open: StrictBool
    staged: StrictBool = False


class FenceState(BaseModel):
    """The engine's fence: the highest fencing token it has seen, and whether that token's
    training window is open (only then do its window credentials work)."""

    model_config = ConfigDict(frozen=True)

    fence: int
    window_open: bool

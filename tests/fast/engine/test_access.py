"""Engine credentials and fencing as pure decisions (the engine process is tested in tests/engine)."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from pydantic import SecretStr

from miles.engine.access import ControlGrant, EngineAccess, Kind, kind_of
from miles.errors import MilesError
from miles.protocol.auth import FenceRequest, window_credential, window_token
from miles.utils.http import status_of

SECRET = "s3cret-controller"
KEY = "user-api-key"


def access(*, secret: str | None = SECRET, api_key: str | None = KEY) -> EngineAccess:
    return EngineAccess(secret=SecretStr(secret) if secret else None, api_key=SecretStr(api_key) if api_key else None)


def refused(call, status: int) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(MilesError) as caught:
        call()
    mapped = status_of(caught.value)
    assert mapped is not None and mapped[0] == status, str(caught.value)
    return str(caught.value)


def test_the_window_credential_is_hmac_sha256_of_its_token_keyed_by_the_secret() -> None:
    digest = hmac.new(SECRET.encode(), b"miles-window:7", hashlib.sha256).hexdigest()
    assert window_credential(SECRET, 7) == f"mw1.7.{digest}"
    assert window_token(SECRET, window_credential(SECRET, 7)) == 7
    assert window_token("other-secret", window_credential(SECRET, 7)) is None
    forged = window_credential(SECRET, 7).replace("mw1.7.", "mw1.8.")
    assert window_token(SECRET, forged) is None
    for bad in ("mw1.07." + digest, "mw1.+7." + digest, "mw2.7." + digest, "mw1.7", "", "mw1.7." + digest[:-1]):
        assert window_token(SECRET, bad) is None, bad
    with pytest.raises(ValueError):
        window_credential(SECRET, -1)
    with pytest.raises(ValueError):
        window_credential("", 1)


def test_paths_are_classified_and_unknown_ones_need_the_api_key() -> None:
    assert kind_of("/health") is Kind.OPEN
    assert kind_of("/update_weights_from_disk") is Kind.CONTROL
    assert kind_of("/fence/") is Kind.CONTROL
    assert kind_of("/v1/chat/completions") is Kind.INFERENCE
    assert kind_of("/server_info") is Kind.INFERENCE
    assert kind_of("/no-such-path") is Kind.INFERENCE


def test_inference_needs_the_api_key_or_the_secret() -> None:
    a = access()
    assert "MILES_API_KEY" in refused(lambda: a.authorize("/generate", authorization=None, fence=None), 401)
    refused(lambda: a.authorize("/generate", authorization="Basic abc", fence=None), 401)
    refused(lambda: a.authorize("/generate", authorization="Bearer nope", fence=None), 403)
    refused(lambda: a.authorize("/generate", authorization=f"Bearer {window_credential(SECRET, 0)}", fence=None), 403)
    assert a.authorize("/generate", authorization=f"Bearer {KEY}", fence=None) is None
    assert a.authorize("/get_server_info", authorization=f"bearer {SECRET}", fence=None) is None
    assert a.authorize("/health", authorization=None, fence=None) is None


def test_control_needs_the_secret_and_says_who_may_call() -> None:
    a = access()
    message = refused(lambda: a.authorize("/pause_generation", authorization=None, fence=None), 401)
    assert "MILES_ENGINE_SECRET" in message and "controller that launched the engine" in message
    refused(lambda: a.authorize("/pause_generation", authorization=f"Bearer {KEY}", fence=None), 403)
    assert a.authorize("/pause_generation", authorization=f"Bearer {SECRET}", fence=None) == ControlGrant(None, None)


def test_without_a_secret_the_api_key_guards_control_and_without_either_all_is_open() -> None:
    key_only = access(secret=None)
    refused(lambda: key_only.authorize("/update_weight_version", authorization=None, fence=None), 401)
    assert key_only.authorize("/update_weight_version", authorization=f"Bearer {KEY}", fence=None) is not None
    open_engine = access(secret=None, api_key=None)
    assert open_engine.authorize("/update_weight_version", authorization=None, fence=None) == ControlGrant(None, None)
    assert open_engine.authorize("/generate", authorization=None, fence=None) is None


def test_fencing_refuses_stale_tokens_and_remembers_the_highest() -> None:
    a = access()
    auth = f"Bearer {SECRET}"
    a.admit(a.authorize("/update_weight_version", authorization=auth, fence="5"))
    assert a.state.fence == 5
    message = refused(lambda: a.authorize("/pause_generation", authorization=auth, fence="3"), 409)
    assert message == "stale fencing token 3: this engine has seen 5; a newer update owns it"
    assert a.authorize("/pause_generation", authorization=auth, fence=None) == ControlGrant(None, None)
    assert a.authorize("/pause_generation", authorization=auth, fence="5") == ControlGrant(5, None)
    for bad in ("-1", "x", "1.5", "9" * 30):
        refused(lambda bad=bad: a.authorize("/pause_generation", authorization=auth, fence=bad), 400)
    # A grant checked before a newer token arrived is refused when it is admitted.
    late = a.authorize("/pause_generation", authorization=auth, fence="6")
    a.admit(a.authorize("/pause_generation", authorization=auth, fence="9"))
    refused(lambda: a.admit(late), 409)
    assert a.state.fence == 9
    # A refused call moves nothing.
    refused(lambda: a.authorize("/pause_generation", authorization="Bearer wrong", fence="50"), 403)
    assert a.state.fence == 9


def test_window_credentials_work_only_while_their_window_is_the_open_fence() -> None:
    a = access()
    auth = f"Bearer {SECRET}"
    window = f"Bearer {window_credential(SECRET, 4)}"
    refused(lambda: a.authorize("/update_weight_version", authorization=window, fence=None), 403)  # not open yet
    assert a.move_fence(FenceRequest(token=4, window_open=True)).model_dump() == {"fence": 4, "window_open": True}
    assert a.authorize("/update_weight_version", authorization=window, fence=None) == ControlGrant(4, 4)
    assert a.authorize("/update_weight_version", authorization=window, fence="4") == ControlGrant(4, 4)
    refused(lambda: a.authorize("/update_weight_version", authorization=window, fence="5"), 400)
    refused(lambda: a.authorize("/fence", authorization=window, fence=None), 403)  # only the secret moves the fence
    refused(lambda: a.authorize("/fence", authorization=f"Bearer {KEY}", fence=None), 403)
    # Closed: the credential is worthless; reopened: it works again.
    a.move_fence(FenceRequest(token=4, window_open=False))
    assert "closed or superseded" in refused(
        lambda: a.authorize("/update_weight_version", authorization=window, fence=None), 403
    )
    a.move_fence(FenceRequest(token=4, window_open=True))
    grant = a.authorize("/update_weight_version", authorization=window, fence=None)
    # Superseded by a newer fenced call before it was admitted.
    a.admit(a.authorize("/pause_generation", authorization=auth, fence="5"))
    assert a.state.model_dump() == {"fence": 5, "window_open": False}
    refused(lambda: a.admit(grant), 403)
    refused(lambda: a.move_fence(FenceRequest(token=4, window_open=True)), 409)


def test_a_staged_window_credential_may_only_stage() -> None:
    a = access()
    window = f"Bearer {window_credential(SECRET, 6)}"
    a.move_fence(FenceRequest(token=6, window_open=True, staged=True))
    for path in ("/update_weights_from_disk", "/update_weight_version", "/activate_weights", "/pause_generation"):
        assert "is staged" in refused(lambda path=path: a.authorize(path, authorization=window, fence=None), 403)
    push = a.authorize("/update_weights_from_tensor", authorization=window, fence=None)
    assert push == ControlGrant(6, 6)
    assert "activate=true" in refused(lambda: a.admit(push, activates=True), 403)
    a.admit(push, activates=False)
    assert a.authorize("/weights_checker", authorization=window, fence=None) == ControlGrant(6, 6)
    # The secret (the controller) is not limited by the window's kind.
    a.admit(a.authorize("/activate_weights", authorization=f"Bearer {SECRET}", fence="6"), activates=True)
    # Reopened as an ordinary window (its servers out of routing), the credential may load.
    a.move_fence(FenceRequest(token=6, window_open=True))
    a.admit(a.authorize("/update_weights_from_disk", authorization=window, fence=None), activates=True)
    # Closing ends the staged kind with the window.
    a.move_fence(FenceRequest(token=7, window_open=True, staged=True))
    a.close_window()
    a.move_fence(FenceRequest(token=7, window_open=True))
    later = f"Bearer {window_credential(SECRET, 7)}"
    assert a.authorize("/update_weight_version", authorization=later, fence=None) == ControlGrant(7, 7)

"""A typed async client for SGLang's native HTTP API, used for every rollout server type.

The embedded engine and a real SGLang server answer the same calls, so the rollout servers and the
controller talk to both through this one client (adapter: all engine HTTP calls are made here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from miles.errors import MilesError
from miles.protocol.sglang import (
    PauseMode,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
    UpdateWeightVersionRequest,
)


class EngineCallError(MilesError):
    """An engine answered with an error, or could not be reached."""

    def __init__(self, message: str, *, status_code: int | None = None, **context: Any) -> None:
        self.status_code = status_code
        super().__init__(message, status_code=status_code, **context)


@dataclass(frozen=True)
class WeightsChecksum:
    """What an engine reports about the weights it holds right now."""

    checksum: str
    algorithm: str
    weight_version: str


@dataclass(frozen=True)
class WeightsIdentity:
    """What an engine says it holds, without hashing anything: its version label and the
    checksum it computed when its weights last changed (None when it keeps none)."""

    weight_version: str
    checksum: str | None


@dataclass(frozen=True)
class WeightsExport:
    """A checkpoint an engine wrote of the weights it held."""

    path: Path
    checksum: str
    weight_version: str


class EngineClient:
    """Calls one engine at ``base_url`` (e.g. ``http://127.0.0.1:30001``)."""

    def __init__(self, base_url: str, *, http: httpx.AsyncClient, server_id: str, secret: str | None = None) -> None:
        """``secret``: the engine's control secret, sent as a bearer token on every call."""
        self.base_url = base_url.rstrip("/")
        self.server_id = server_id
        self._http = http
        self._headers = {"authorization": f"Bearer {secret}"} if secret else None

    async def _call(
        self, method: str, path: str, *, json: Any = None, timeout: float | None = None
    ) -> httpx.Response:
        try:
            response = await self._http.request(
                method,
                f"{self.base_url}{path}",
                json=json,
                headers=self._headers,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as exc:
            raise EngineCallError(
                f"{method} {path} failed: {type(exc).__name__}: {exc}", server_id=self.server_id, url=self.base_url
            ) from exc
        return response

    async def _ok_json(self, method: str, path: str, *, json: Any = None, timeout: float | None = None) -> Any:
        response = await self._call(method, path, json=json, timeout=timeout)
        if response.status_code >= 400:
            raise EngineCallError(
                f"{method} {path} answered {response.status_code}: {_error_text(response)}",
                status_code=response.status_code,
                server_id=self.server_id,
            )
        return response.json() if response.content else None

    async def health(self, *, timeout: float = 5.0) -> bool:
        """True when ``/health`` answers 200 (the process is up and its HTTP loop responsive)."""
        try:
            response = await self._call("GET", "/health", timeout=timeout)
        except EngineCallError:
            return False
        return response.status_code == 200

    async def health_generate(self, *, timeout: float = 30.0) -> str | None:
        """None when a one-token generation succeeds, else why it did not."""
        try:
            response = await self._call("GET", "/health_generate", timeout=timeout)
        except EngineCallError as exc:
            return str(exc)
        return None if response.status_code == 200 else _error_text(response)

    async def model_info(self) -> dict[str, Any]:
        return await self._ok_json("GET", "/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._ok_json("GET", "/get_server_info")

    async def weight_version(self) -> str:
        return (await self._ok_json("GET", "/get_weight_version"))["weight_version"]

    async def weight_identity(self, *, timeout: float | None = None) -> WeightsIdentity:
        """``/get_weight_version``: the version, and the checksum the engine keeps of its weights."""
        body = await self._ok_json("GET", "/get_weight_version", timeout=timeout)
        if not isinstance(body, dict) or not isinstance(body.get("weight_version"), str):
            raise EngineCallError(f"get_weight_version answered {body!r}", server_id=self.server_id)
        checksum = body.get("checksum")
        return WeightsIdentity(weight_version=body["weight_version"], checksum=checksum if isinstance(checksum, str) else None)

    async def fence(self, token: int, *, window_open: bool) -> None:
        """``/fence``: the engine refuses weight changes fenced below ``token`` from now on, and
        accepts the credential of window ``token`` while ``window_open``."""
        await self._ok_json("POST", "/fence", json={"token": token, "window_open": window_open})

    async def export_weights(self, *, step: int, timeout: float | None = None) -> WeightsExport:
        """``/export_weights``: the engine writes the weights it holds as a sealed checkpoint."""
        body = await self._ok_json("POST", "/export_weights", json={"step": step}, timeout=timeout)
        try:
            return WeightsExport(path=Path(body["path"]), checksum=body["checksum"], weight_version=body["weight_version"])
        except (KeyError, TypeError) as exc:
            raise EngineCallError(f"export_weights answered {body!r}", server_id=self.server_id) from exc

    async def generate(self, payload: dict[str, Any], *, timeout: float | None = None) -> Any:
        return await self._ok_json("POST", "/generate", json=payload, timeout=timeout)

    async def update_weights_from_disk(
        self, request: UpdateWeightsFromDiskRequest, *, timeout: float | None = None
    ) -> UpdateWeightsResponse:
        """Ask the engine to load a checkpoint; a refusal comes back as ``success=False``."""
        response = await self._call(
            "POST", "/update_weights_from_disk", json=request.model_dump(mode="json"), timeout=timeout
        )
        if response.status_code in (200, 400):
            body = response.json()
            if "success" in body:
                return UpdateWeightsResponse.model_validate(body)
        raise EngineCallError(
            f"update_weights_from_disk answered {response.status_code}: {_error_text(response)}",
            status_code=response.status_code,
            server_id=self.server_id,
        )

    async def update_weight_version(self, new_version: str) -> None:
        request = UpdateWeightVersionRequest(new_version=new_version, abort_all_requests=False)
        await self._ok_json("POST", "/update_weight_version", json=request.model_dump(mode="json"))

    async def pause_generation(self, mode: PauseMode, *, timeout: float | None = None) -> int:
        body = await self._ok_json("POST", "/pause_generation", json={"mode": mode.value}, timeout=timeout)
        return int((body or {}).get("num_paused_requests", 0))

    async def continue_generation(self) -> None:
        await self._ok_json("POST", "/continue_generation", json={})

    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        await self._ok_json("POST", "/abort_request", json={"rid": rid, "abort_all": abort_all})

    async def flush_cache(self) -> None:
        await self._ok_json("POST", "/flush_cache")

    async def weights_checksum(self, *, timeout: float | None = None) -> WeightsChecksum:
        """The checksum the engine computes now over the weights it holds (``/weights_checker``)."""
        body = await self._ok_json("POST", "/weights_checker", json={"action": "checksum"}, timeout=timeout)
        payload = (body or {}).get("payload") or {}
        if not body.get("success") or "checksum" not in payload:
            raise EngineCallError(
                f"weights_checker gave no checksum: {body.get('message')}", server_id=self.server_id
            )
        return WeightsChecksum(
            checksum=payload["checksum"],
            algorithm=payload.get("algorithm", "xxh3_128"),
            weight_version=payload.get("weight_version", ""),
        )


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]

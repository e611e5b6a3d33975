"""A typed async client for SGLang's native HTTP API, used for every server type (the embedded
engine and SGLang answer the same calls; adapter: all engine HTTP calls are made here)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from miles.errors import MilesError
from miles.protocol.auth import FENCE_HEADER, FenceRequest, FenceState
from miles.protocol.base import ResponseModel
from miles.protocol.sglang import AbortRequest, PauseGenerationRequest, PauseMode
from miles.protocol.sglang_weights import (
    ActivateWeightsRequest,
    ExportWeightsRequest,
    ExportWeightsResponse,
    PauseGenerationResponse,
    SGLangWeightsCheckerResponse,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
    WeightVersionResponse,
)

ModelT = TypeVar("ModelT", bound=BaseModel)


class EngineCallError(MilesError):
    """An engine answered with an error, or could not be reached."""

    def __init__(self, message: str, *, status_code: int | None = None, **context: Any) -> None:
        self.status_code = status_code
        super().__init__(message, status_code=status_code, **context)


# What a real SGLang server's weights checker reports: ``per_engine_checksum``, SHA-256 over its
# ranks' digests of the parameters as SGLang holds them (fused, sharded), not miles' canonical one.
SGLANG_ENGINE_DIGEST = "sglang_per_engine_sha256"


@dataclass(frozen=True)
class WeightsChecksum:
    """What an engine reports about the weights it holds right now."""

    checksum: str
    algorithm: str
    weight_version: str
    # For an SGLang digest: the parallel layout it was computed over ("tp2-dp1-pp1"); the same
    # weights hash alike only under the same layout.
    layout: str | None = None


# What an engine says it holds, without hashing (checksum, instance: None where it does not say):
# every server type's answer is read into the embedded engine's /get_weight_version answer.
WeightsIdentity = WeightVersionResponse


class WeightsExport(ResponseModel):
    """A checkpoint an engine wrote of the weights it held."""

    path: Path
    checksum: str


class EngineClient:
    """Calls one engine at ``base_url``. A call that changes its weights or generation may carry the
    update's lock token (``fence``): the engine refuses one below the highest it has seen."""

    def __init__(self, base_url: str, *, http: httpx.AsyncClient, server_id: str, secret: str | None = None) -> None:
        """``secret``: the engine's control secret, sent as a bearer token on every call."""
        self.base_url = base_url.rstrip("/")
        self.server_id = server_id
        self._http = http
        self._auth = {"authorization": f"Bearer {secret}"} if secret else {}
        # Learned on the first probe: the server has no /get_weight_version (SGLang 0.5.23).
        self._model_info_versions = False

    async def _call(
        self, method: str, path: str, *, json: Any = None, timeout: float | None = None, fence: int | None = None
    ) -> httpx.Response:
        headers = self._auth if fence is None else {**self._auth, FENCE_HEADER: str(fence)}
        try:
            return await self._http.request(
                method,
                f"{self.base_url}{path}",
                json=json,
                headers=headers,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as exc:
            raise EngineCallError(
                f"{method} {path} failed: {type(exc).__name__}: {exc}", server_id=self.server_id, url=self.base_url
            ) from exc

    async def _post(
        self,
        path: str,
        request: BaseModel,
        answer: type[ModelT],
        *,
        timeout: float | None = None,
        fence: int | None = None,
    ) -> ModelT:
        response = await self._call("POST", path, json=request.model_dump(mode="json"), timeout=timeout, fence=fence)
        return self._answer("POST", path, response, answer)

    async def _checked(
        self, method: str, path: str, *, json: Any = None, timeout: float | None = None, fence: int | None = None
    ) -> httpx.Response:
        response = await self._call(method, path, json=json, timeout=timeout, fence=fence)
        if response.status_code >= 400:
            raise self._refused(f"{method} {path}", response)
        return response

    def _refused(self, what: str, response: httpx.Response) -> EngineCallError:
        """The error for an answer that is not a success (``what``: the call, as the message names it)."""
        return EngineCallError(
            f"{what} answered {response.status_code}: {_error_text(response)}",
            status_code=response.status_code,
            server_id=self.server_id,
        )

    def _answer(self, method: str, path: str, response: httpx.Response, answer: type[ModelT]) -> ModelT:
        if response.status_code >= 400:
            raise self._refused(f"{method} {path}", response)
        try:
            return answer.model_validate_json(response.content)
        except ValidationError as exc:
            raise EngineCallError(
                f"{method} {path} answered something unexpected: {exc}", server_id=self.server_id
            ) from exc

    async def health(self, *, timeout: float = 5.0) -> bool:
        """True when ``/health`` answers 200 (the process is up and its HTTP loop responsive)."""
        return await self._answers_200("/health", timeout=timeout)

    async def _answers_200(self, path: str, *, timeout: float) -> bool:
        try:
            response = await self._call("GET", path, timeout=timeout)
        except EngineCallError:
            return False
        return response.status_code == 200

    async def weight_identity(self, *, timeout: float | None = None) -> WeightsIdentity:
        """``/get_weight_version``, or on SGLang 0.5.23 (no such route) the version in ``/model_info``, no checksum."""
        if not self._model_info_versions:
            response = await self._call("GET", "/get_weight_version", timeout=timeout)
            if response.status_code != 404:
                return self._answer("GET", "/get_weight_version", response, WeightsIdentity)
            self._model_info_versions = True
        return WeightsIdentity(weight_version=str((await self.model_info(timeout=timeout)).get("weight_version")))

    async def fence(self, token: int, *, window_open: bool, staged: bool = False) -> FenceState:
        """``/fence``: the engine refuses weight changes fenced below ``token`` from now on, and
        accepts window ``token``'s credential while ``window_open`` (only to stage when ``staged``)."""
        return await self._post("/fence", FenceRequest(token=token, window_open=window_open, staged=staged), FenceState)

    async def export_weights(
        self, *, step: int, timeout: float | None = None, fence: int | None = None
    ) -> WeightsExport:
        """``/export_weights``: the engine writes the weights it holds as a sealed checkpoint."""
        request = ExportWeightsRequest(step=step)
        body = await self._post("/export_weights", request, ExportWeightsResponse, timeout=timeout, fence=fence)
        return WeightsExport(path=Path(body.path), checksum=body.checksum)

    async def activate_weights(
        self, request: ActivateWeightsRequest, *, timeout: float | None = None, fence: int | None = None
    ) -> UpdateWeightsResponse:
        """Have the engine serve the pushed weights it staged; a refusal comes back as ``success=False``."""
        return await self._update("/activate_weights", request, timeout=timeout, fence=fence)

    async def update_weights_from_disk(
        self, request: UpdateWeightsFromDiskRequest, *, timeout: float | None = None, fence: int | None = None
    ) -> UpdateWeightsResponse:
        """Ask the engine to load a checkpoint; a refusal comes back as ``success=False``."""
        return await self._update("/update_weights_from_disk", request, timeout=timeout, fence=fence)

    async def _update(
        self, path: str, request: BaseModel, *, timeout: float | None, fence: int | None
    ) -> UpdateWeightsResponse:
        """A call that changes the weights: its ``UpdateWeightsResponse`` (a refusal included), else EngineCallError."""
        response = await self._call("POST", path, json=request.model_dump(mode="json"), timeout=timeout, fence=fence)
        if response.status_code in (200, 400):
            # A plain 400 (an invalid request) is no refusal: reported below.
            with contextlib.suppress(ValidationError):
                return UpdateWeightsResponse.model_validate_json(response.content)
        raise self._refused(path.lstrip("/"), response)

    async def update_weight_version(self, new_version: str, *, fence: int | None = None) -> None:
        request = UpdateWeightVersionRequest(new_version=new_version, abort_all_requests=False)
        await self._checked("POST", "/update_weight_version", json=request.model_dump(mode="json"), fence=fence)

    async def pause_generation(self, mode: PauseMode, *, timeout: float | None = None, fence: int | None = None) -> int:
        request = PauseGenerationRequest(mode=mode)
        body = await self._post("/pause_generation", request, PauseGenerationResponse, timeout=timeout, fence=fence)
        return body.num_paused_requests

    async def continue_generation(self, *, fence: int | None = None) -> None:
        await self._checked("POST", "/continue_generation", json={}, fence=fence)

    async def weights_checksum(self, *, timeout: float | None = None, fence: int | None = None) -> WeightsChecksum:
        """The checksum the engine computes now over its weights (``/weights_checker``): miles'
        canonical one, or SGLang's ``per_engine_checksum`` (``algorithm`` says which)."""
        request = WeightsCheckerRequest(action="checksum")
        body = await self._post("/weights_checker", request, SGLangWeightsCheckerResponse, timeout=timeout, fence=fence)
        payload = body.payload
        if body.success and payload is not None:
            return WeightsChecksum(
                checksum=payload.checksum, algorithm=payload.algorithm, weight_version=payload.weight_version
            )
        if body.success and body.per_engine_checksum:
            identity = await self.weight_identity(timeout=timeout)
            return WeightsChecksum(
                checksum=body.per_engine_checksum,
                algorithm=SGLANG_ENGINE_DIGEST,
                weight_version=identity.weight_version,
                layout=_layout(body.ranks or []),
            )
        raise EngineCallError(f"weights_checker gave no checksum: {body.message}", server_id=self.server_id)

    async def health_generate(self, *, timeout: float = 30.0) -> bool:
        """True when ``/health_generate`` answers 200: the server generated a token just now."""
        return await self._answers_200("/health_generate", timeout=timeout)

    async def model_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``/model_info`` (SGLang's newer name), or ``/get_model_info`` on servers without it."""
        return await self._info("/model_info", "/get_model_info", timeout=timeout)

    async def server_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``/server_info`` (SGLang's newer name), or ``/get_server_info`` on servers without it."""
        return await self._info("/server_info", "/get_server_info", timeout=timeout)

    async def _info(self, path: str, old_path: str, *, timeout: float | None) -> dict[str, Any]:
        response = await self._call("GET", path, timeout=timeout)
        if response.status_code == 404:
            response = await self._call("GET", old_path, timeout=timeout)
        if response.status_code >= 400:
            raise self._refused(f"GET {old_path}", response)
        body = response.json()
        if not isinstance(body, dict):
            raise EngineCallError(f"GET {path} answered something other than an object", server_id=self.server_id)
        return body

    async def abort_request(
        self, rid: str = "", *, abort_all: bool = False, abort_message: str | None = None, fence: int | None = None
    ) -> None:
        """``/abort_request``: end the request ``rid``, or every request with ``abort_all``."""
        request = AbortRequest(rid=rid, abort_all=abort_all, abort_message=abort_message)
        await self._checked("POST", "/abort_request", json=request.model_dump(mode="json"), fence=fence)

    async def flush_cache(self, *, fence: int | None = None) -> None:
        """``/flush_cache``: drop the server's prefix cache (SGLang refuses while requests run)."""
        await self._checked("POST", "/flush_cache", fence=fence)


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


def _layout(ranks: list[dict[str, Any]]) -> str | None:
    """The parallel layout an SGLang digest was computed over, from its ranks' ``parallelism_info``."""
    for rank in ranks:
        infos = rank.get("parallelism_info")
        info = infos[0] if isinstance(infos, list) and infos else infos
        if isinstance(info, dict):
            return f"tp{info.get('tp_size')}-dp{info.get('dp_size')}-pp{info.get('pp_size')}"
    return None

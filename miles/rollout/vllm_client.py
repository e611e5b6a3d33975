"""``EngineClient`` for a vLLM server: SGLang's calls, made with vLLM's routes.

The server runs in dev mode with miles' worker extension (``miles.vllm.extension``), whose
``/collective_rpc`` methods load, hash and write out the weights; docs/VLLM.md maps each call to
its routes. The prefix cache is reset after every load: vLLM keeps it across a reload, so a long
prompt would otherwise be answered from the old weights' KV cache. vLLM ignores fencing tokens (the
controller's lock orders the calls) and has no stage; a window's pushes do not pass here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from miles.protocol.auth import FenceState
from miles.protocol.sglang import PauseMode
from miles.protocol.sglang_weights import ActivateWeightsRequest, UpdateWeightsFromDiskRequest, UpdateWeightsResponse
from miles.rollout.engine_client import EngineCallError, EngineClient, WeightsChecksum, WeightsExport, WeightsIdentity

# miles' pause modes, as vLLM's ``/pause`` names them: ``drain`` lets running requests finish,
# ``retract`` keeps them to go on after the update.
VLLM_PAUSE_MODES = {PauseMode.DRAIN: "wait", PauseMode.ABORT: "abort", PauseMode.RETRACT: "keep"}


@dataclass(frozen=True)
class WorkerCadence:
    """How often a ``VLLMClient`` asks a vLLM worker, and how long it waits on one (seconds)."""

    # An identity probe asks the worker itself at most this often (and after every change of its
    # weights); ``/health`` answers for it between. A vLLM worker busy-polls for a second after
    # every call it gets: probes every 2 s kept a core busy (10.1 s of CPU per 10 s idle).
    identity_every_s: float = 30.0
    # A worker busy with one long step answers no probe while its server answers ``/health``:
    # its last identity stands for this long.
    busy_grace_s: float = 120.0
    # A call into the worker checks this often that the server still has an engine: when a
    # worker dies, vLLM's API server may hang in its shutdown with the call unanswered.
    watch_s: float = 2.0


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Identity(_Answer):
    checksum: str | None = None
    instance_id: str


class _Checksum(_Answer):
    checksum: str
    algorithm: str


class _Ended(_Answer):
    ended: bool
    left: str | None = None  # the torch.distributed group the push formed


class _Load(UpdateWeightsResponse):
    # Whether the worker's weights changed (even half a reload): then ``checksum`` is what it holds.
    changed: bool


class VLLMClient(EngineClient):
    """Calls one vLLM server at ``base_url``; see the module docstring."""

    def __init__(
        self,
        base_url: str,
        *,
        http: httpx.AsyncClient,
        server_id: str,
        cadence: WorkerCadence = WorkerCadence(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # No secret: vLLM checks none of miles' (its server is protected by its network).
        super().__init__(base_url, http=http, server_id=server_id)
        self.cadence, self._clock = cadence, clock
        # The worker's last answer to an identity probe (None: ask it; its weights changed), when
        # it came, and since when the worker answers none.
        self._identity: _Identity | None = None
        self._identity_at = 0.0
        self._busy_since: float | None = None

    async def _rpc(self, method: str, answer: type[BaseModel], *, timeout: float | None = None, **kwargs: str) -> Any:
        """``/collective_rpc``: the extension's answer on the (one) worker; fails once ``/health``
        fails twice in a row while it runs (checked every ``cadence.watch_s``: the engine died)."""
        if method != "miles_identity":
            self._identity = None  # what the worker holds may change: ask it again next time
        body = {"method": method, "kwargs": kwargs, "timeout": timeout}
        call = asyncio.ensure_future(self._call("POST", "/collective_rpc", json=body, timeout=timeout))
        try:
            failed = 0
            while not (await asyncio.wait({call}, timeout=self.cadence.watch_s))[0]:
                failed = 0 if await self.health(timeout=self.cadence.watch_s) else failed + 1
                if failed >= 2:
                    raise EngineCallError(
                        f"collective_rpc {method}: the vLLM server's engine died while it ran (its /health fails)",
                        server_id=self.server_id,
                    )
        finally:
            call.cancel()
        response = call.result()
        if response.status_code >= 400:
            raise self._refused(f"collective_rpc {method}", response)
        try:
            return answer.model_validate(response.json()["results"][0])
        except (ValueError, KeyError, IndexError, TypeError, ValidationError) as exc:
            raise EngineCallError(
                f"collective_rpc {method} answered something unexpected ({exc}); is the server running with "
                "--worker-extension-cls miles.vllm.extension.MilesWorkerExtension?",
                server_id=self.server_id,
            ) from exc

    async def _weight_version(self, *, timeout: float | None = None) -> str:
        response = await self._checked("GET", "/weight_info", timeout=timeout)
        return str(response.json().get("weight_version"))

    async def weight_identity(self, *, timeout: float | None = None) -> WeightsIdentity:
        """The worker's identity, asked as ``cadence`` says, and the API server's version; a busy worker's last
        identity stands in while ``/health`` answers (for at most ``cadence.busy_grace_s``)."""
        now = self._clock()
        if self._identity is None or now - self._identity_at >= self.cadence.identity_every_s:
            try:
                self._identity = await self._rpc("miles_identity", _Identity, timeout=timeout)
                self._identity_at, self._busy_since = now, None
            except EngineCallError:
                self._busy_since = self._busy_since if self._busy_since is not None else now
                grace_over = now - self._busy_since > self.cadence.busy_grace_s
                if self._identity is None or grace_over or not await self.health():
                    raise
        elif not await self.health(timeout=timeout or 5.0):
            raise EngineCallError("the vLLM server's /health fails", server_id=self.server_id, url=self.base_url)
        identity = self._identity
        version = await self._weight_version(timeout=timeout)
        return WeightsIdentity(weight_version=version, checksum=identity.checksum, instance_id=identity.instance_id)

    async def weights_checksum(self, *, timeout: float | None = None, fence: int | None = None) -> WeightsChecksum:
        held = await self._rpc("miles_checksum", _Checksum, timeout=timeout)
        version = await self._weight_version(timeout=timeout)
        return WeightsChecksum(checksum=held.checksum, algorithm=held.algorithm, weight_version=version)

    async def update_weights_from_disk(
        self, request: UpdateWeightsFromDiskRequest, *, timeout: float | None = None, fence: int | None = None
    ) -> UpdateWeightsResponse:
        """Verify and reload in the worker; a load that changed the weights (even half) reports what it now holds."""
        if request.expected_checksum is None:
            raise EngineCallError(
                "a vLLM server loads only checkpoints with an expected checksum",
                status_code=400,
                server_id=self.server_id,
            )
        answer = await self._rpc(
            "miles_load", _Load, timeout=timeout, path=request.model_path, expected_checksum=request.expected_checksum
        )
        if not answer.changed:
            return UpdateWeightsResponse(success=False, message=answer.message, timings=answer.timings)
        version = request.weight_version or "unverified"
        if answer.checksum != request.expected_checksum:
            version = f"unverified-{version}"  # never labelled as the version it failed to become
        await self.update_weight_version(version, fence=fence)
        await self.flush_cache(fence=fence)
        return UpdateWeightsResponse(
            **answer.model_dump(exclude={"changed"}) | {"success": True, "weight_version": version}
        )

    async def update_weight_version(self, new_version: str, *, fence: int | None = None) -> None:
        await self._checked("POST", "/update_weight_version", json={"new_version": new_version}, fence=fence)

    async def pause_generation(self, mode: PauseMode, *, timeout: float | None = None, fence: int | None = None) -> int:
        await self._checked("POST", f"/pause?mode={VLLM_PAUSE_MODES[mode]}", timeout=timeout, fence=fence)
        return 0  # vLLM does not say how many requests it held

    async def continue_generation(self, *, fence: int | None = None) -> None:
        await self._checked("POST", "/resume", fence=fence)

    async def flush_cache(self, *, fence: int | None = None) -> None:
        await self._checked("POST", "/reset_prefix_cache", fence=fence)

    async def warm_up(self, *, timeout: float) -> None:
        """Tokens with their logprobs, for one sequence and then several at once (torch compiles a
        graph for each on first use); EngineCallError unless they are answered."""
        for n in (1, 3):
            body = {"prompt": "a", "max_tokens": 2, "logprobs": 1, "n": n}
            response = await self._call("POST", "/v1/completions", json=body, timeout=timeout)
            if response.status_code != 200:
                raise self._refused("POST /v1/completions (warming up)", response)

    async def fence(self, token: int, *, window_open: bool, staged: bool = False) -> FenceState:
        """vLLM has no fence; closing a window ends a push it left unfinished (``miles_end_push``)."""
        if not window_open:
            await self._rpc("miles_end_push", _Ended)
        return FenceState(fence=token, window_open=window_open)

    async def activate_weights(
        self, request: ActivateWeightsRequest, *, timeout: float | None = None, fence: int | None = None
    ) -> UpdateWeightsResponse:
        raise EngineCallError(
            "a vLLM server cannot activate staged weights (it has no stage)", status_code=400, server_id=self.server_id
        )

    async def export_weights(
        self, *, step: int, timeout: float | None = None, fence: int | None = None
    ) -> WeightsExport:
        """The worker writes what it holds as a sealed checkpoint under the server's snapshot directory."""
        return await self._rpc("miles_export", WeightsExport, timeout=timeout, step=str(step))

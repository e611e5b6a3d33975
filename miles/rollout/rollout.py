"""Rollout: the servers of one model, run by one server type, each an explicit state machine.

It launches the engines (the server type says what an engine is, the runtime where it runs),
confirms each one's weights by checksum before it serves, and stops what it started; its
``Supervisor`` repairs them, and the controller's ``WeightUpdate`` drives its fenced update steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import ClassVar

import httpx

from miles.errors import MilesError
from miles.protocol.sglang import PauseMode
from miles.protocol.sglang_weights import ActivateWeightsRequest, UpdateWeightsFromDiskRequest, UpdateWeightsResponse
from miles.rollout.copies import ModelServers, peer_holding, source_of
from miles.rollout.engine_client import EngineCallError, EngineClient, WeightsChecksum, WeightsExport, WeightsIdentity
from miles.rollout.runtime import EngineCommand, runtime_for
from miles.rollout.spec import HealthSettings, RolloutSpec
from miles.rollout.state import (
    EngineApi,
    ProbeResult,
    RolloutError,
    RolloutObserver,
    ServerCell,
    ServerSnapshot,
    ServerState,
    VerifiedWeights,
    start_weights,
)
from miles.rollout.supervisor import Supervisor
from miles.weights.manifest import manifest_or_none

logger = logging.getLogger("miles.rollout")

# The section restarts and recoveries run in (the controller passes its lock), named by its
# holder; it yields the fencing token the engine calls made inside it carry (None: unfenced).
ExclusiveSection = Callable[[str], AbstractAsyncContextManager[int | None]]

# How long the runtime may take to learn that an engine exited once a call found its socket
# closed (a forked engine's exit reaches its launcher through the forkserver).
DEATH_NOTICE_S = 2.0


def refuse_miles_flags(engine_args: tuple[str, ...], where: Mapping[str, str], *, engine: str) -> None:
    """Refuse an extra flag that repeats one miles sets (``where``: each spelling -> where the spec sets it)."""
    for arg in engine_args:
        flag = arg.split("=", 1)[0]
        if flag in where:
            raise RolloutError(
                f"engine_args sets {flag}, which miles sets for every {engine} server; use {where[flag]}"
            )


class Rollout(ABC):
    """Base of every server type (``SFTRollout`` ...): one model's servers; see the module docstring."""

    # Whether the server type can take servers someone else runs (a spec's ``urls``), and
    # SGLang's or vLLM's launch arguments (a spec's ``sglang``, ``vllm``).
    can_attach: ClassVar[bool] = False
    takes_sglang_args: ClassVar[bool] = False
    takes_vllm_args: ClassVar[bool] = False
    # Whether its servers can stage a window's pushes while they serve; the API their engines
    # speak (a vLLM server answers no native /generate and takes pushes its own way).
    stages_pushes: ClassVar[bool] = True
    engine_api: ClassVar[EngineApi] = "sglang"

    def __init__(
        self, spec: RolloutSpec, *, exclusive: ExclusiveSection | None = None, observer: RolloutObserver | None = None
    ) -> None:
        self._prepare(spec)
        self.spec = spec
        # Restarts triggered by the health loop run inside this section (the controller passes
        # its lock) so a restart never interleaves with an update or a training window.
        self.exclusive = exclusive or (lambda _holder: contextlib.nullcontext())
        self.observer = observer
        manifest = manifest_or_none(spec.checkpoint)
        self.model_name = spec.model_name or (manifest.model_name if manifest else spec.checkpoint.name)
        self._cells = [
            ServerCell(f"{spec.name}-{i}", self.model_name, device, type(self).__name__, self.engine_api)
            for i, device in enumerate(spec.resolved_devices())
        ]
        self._clients: dict[str, EngineClient] = {}
        self._http: httpx.AsyncClient | None = None
        # The highest integer version an update committed here: no later update may commit one
        # at or below it, even while a version that is no integer ("abc") serves in between.
        self.committed_high: int | None = None
        # The weights to start every server on instead of the spec's checkpoint: what a controller
        # started again on its event log resumes (miles.controller.resume). Set before ``start``.
        self.resume_from: VerifiedWeights | None = None
        # All servers of the model, where peers holding the same weights are looked for and
        # written-out copies recorded: this rollout, or the MixedRollout it is part of.
        self.model_servers: ModelServers = self
        self._supervisor = Supervisor(self)
        self._supervising: asyncio.Task[None] | None = None
        # Where the engines run (local processes or Ray actors); an engine that ends wakes the
        # supervisor at once.
        self.runtime = runtime_for(spec, on_exit=self._engine_exited)

    # --- the server type's hook, and where its engines run --------------------------------

    def _prepare(self, spec: RolloutSpec) -> None:  # noqa: B027  # an optional hook
        """Refuse a spec this server type cannot run, and set up its state, before anything is built."""

    @abstractmethod
    def engine_command(self) -> EngineCommand:
        """How to run one engine of this server type (the runtime decides where)."""

    def new_client(self, url: str, *, server_id: str, http: httpx.AsyncClient, secret: str | None) -> EngineClient:
        """The client that speaks to one of this server type's engines (SGLang's HTTP API)."""
        return EngineClient(url, http=http, server_id=server_id, secret=secret)

    async def _launch(self, cell: ServerCell, checkpoint: Path) -> str:
        """Start an engine for ``cell`` serving ``checkpoint``; return its base URL once healthy."""
        launched = await self.runtime.launch(
            cell.server_id, self.engine_command(), checkpoint, device=cell.device, http=self.http
        )
        cell.pid, cell.placement = launched.pid, launched.placement
        # A launched server holds its start checkpoint; an attached one holds whatever it holds.
        self._holds_files(cell.server_id, None if self.attached else checkpoint)
        return launched.url

    def _holds_files(self, server_id: str, checkpoint: Path | None) -> None:  # noqa: B027  # an optional hook
        """The server's engine now holds ``checkpoint``'s weights (None: unknown)."""

    async def _terminate(self, cell: ServerCell) -> None:
        """Stop ``cell``'s engine (and reap it) and forget its client; does not raise if it already died."""
        await self.runtime.terminate(cell.server_id)
        cell.pid = None
        self._clients.pop(cell.server_id, None)

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def start_checkpoint(self) -> Path:
        return self.spec.checkpoint

    @property
    def attached(self) -> bool:
        """Whether the servers are someone else's (the spec's ``urls``)."""
        return bool(self.spec.urls)

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            # Loopback calls to our own engines: no proxies from the environment.
            self._http = httpx.AsyncClient(timeout=self.spec.request_timeout_s, trust_env=False)
        return self._http

    async def start(self) -> None:
        """Launch every engine, confirm its weights, and start the health loop. Raises RolloutError
        (with the log tail) if an engine fails to start or holds other weights; all is stopped again."""
        checkpoint = self.spec.checkpoint
        if self.resume_from is not None and self.resume_from.checkpoint is not None:
            checkpoint = self.resume_from.checkpoint
            for cell in self._cells:
                cell.verified = self.resume_from  # what each must confirm before it serves
        try:
            await self.runtime.start(self.server_ids)
            await asyncio.gather(*(self._bring_up(cell, checkpoint, restart=False) for cell in self._cells))
        except BaseException:
            await self.stop()
            raise
        self._supervising = asyncio.create_task(self._supervisor.run(), name=f"supervise-{self.spec.name}")

    async def stop(self) -> None:
        """Stop the health loop and every engine; safe to call twice."""
        if self._supervising is not None:
            self._supervising.cancel()
            await asyncio.gather(self._supervising, return_exceptions=True)
            self._supervising = None
        await asyncio.gather(*(self._stop_cell(cell) for cell in self._cells), return_exceptions=True)
        await self.runtime.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _stop_cell(self, cell: ServerCell) -> None:
        await self._terminate(cell)
        if cell.state is not ServerState.STOPPED:
            self.transition(cell, ServerState.STOPPED, "rollout stopped")

    # --- views -----------------------------------------------------------------------------

    @property
    def cells(self) -> list[ServerCell]:
        """The servers' records (for this package's supervisor; others use ``snapshot``)."""
        return list(self._cells)

    @property
    def probe_rounds(self) -> int:
        return self._supervisor.rounds

    def alive(self, cell: ServerCell) -> bool:
        return self.runtime.alive(cell.server_id)

    @property
    def health(self) -> HealthSettings:
        return self.spec.health

    def probed(self, cell: ServerCell, result: ProbeResult) -> None:
        cell.last_probe = result
        cell.consecutive_failures = 0 if result.ok else cell.consecutive_failures + 1
        if self.observer is not None:
            self.observer.probed(cell.server_id)

    def drifted(self, cell: ServerCell, *, verified: VerifiedWeights, reported: WeightsIdentity) -> None:
        """The serving engine reports other weights than ``verified``: record, report, quarantine."""
        reason = (
            f"weights changed outside the controller: the engine reports {reported.weight_version} "
            f"({reported.checksum}), verified was {verified.weight_version} ({verified.checksum})"
        )
        logger.error("%s: %s", cell.server_id, reason)
        cell.weight_version, cell.checksum = reported.weight_version, reported.checksum or cell.checksum
        if self.observer is not None:
            self.observer.drifted(cell.server_id, cell.model_name, expected=verified, actual=reported)
        self.transition(cell, ServerState.QUARANTINED, reason)

    async def died(self, server_id: str) -> bool:
        """Whether the server's engine process has ended, after a call to it found nobody there."""
        self.cell(server_id)  # raises for an id that is not ours
        return await self.runtime.ended(server_id, within_s=DEATH_NOTICE_S)

    def lost(self, server_id: str, *, reason: str) -> None:
        """The server's engine died: out of routing until it is restarted and verified again."""
        cell = self.cell(server_id)
        if cell.state is not ServerState.RESTARTING:
            self.transition(cell, ServerState.RESTARTING, reason)

    async def restart_on(self, server_id: str, verified: VerifiedWeights, *, reason: str, fence: int | None) -> None:
        """Restart a server on ``verified``, weights it never held (it died first); RolloutError when it cannot."""
        self.cell(server_id).verified = verified
        await self.restart(server_id, reason=reason, fence=fence)

    def snapshot(self) -> list[ServerSnapshot]:
        return [cell.snapshot() for cell in self._cells]

    @property
    def server_ids(self) -> list[str]:
        return [cell.server_id for cell in self._cells]

    def client(self, server_id: str) -> EngineClient:
        try:
            return self._clients[server_id]
        except KeyError:
            raise RolloutError("server has no running engine", server_id=server_id) from None

    def cell(self, server_id: str) -> ServerCell:
        for cell in self._cells:
            if cell.server_id == server_id:
                return cell
        raise RolloutError("no such server in this rollout", server_id=server_id)

    # --- the update steps the controller drives --------------------------------------------

    def begin_update(self, server_id: str, *, reason: str) -> None:
        """Take a serving (or quarantined) server out of routing to load new weights."""
        self.transition(self.cell(server_id), ServerState.UPDATING, reason)

    async def pause(self, server_id: str, mode: PauseMode, *, fence: int | None = None) -> int:
        """Stop the server's generation (running requests per ``mode``); returns how many there were."""
        return await self.client(server_id).pause_generation(mode, timeout=self.spec.update_timeout_s, fence=fence)

    async def resume(self, server_id: str, *, fence: int | None = None) -> None:
        await self.client(server_id).continue_generation(fence=fence)

    async def load(
        self, server_id: str, checkpoint: Path, *, weight_version: str, expected_checksum: str, fence: int | None = None
    ) -> UpdateWeightsResponse:
        """Ask the engine to load ``checkpoint``, whose weights must hash to ``expected_checksum``
        (checked before it touches its weights); a refusal is returned with ``success=False``."""
        self._holds_files(server_id, None)
        # Where the engine can read it: in place, or shipped to its node (the Ray runtime).
        readable = await self.runtime.readable(server_id, checkpoint, expected_checksum=expected_checksum)
        request = UpdateWeightsFromDiskRequest(
            model_path=str(readable), weight_version=weight_version, expected_checksum=expected_checksum
        )
        response = await self.client(server_id).update_weights_from_disk(
            request, timeout=self.spec.update_timeout_s, fence=fence
        )
        if response.success:
            self._holds_files(server_id, checkpoint)
        return response

    async def activate(
        self,
        server_id: str,
        *,
        weight_version: str,
        expected_checksum: str,
        pause_mode: PauseMode | None = None,
        fence: int | None = None,
    ) -> UpdateWeightsResponse:
        """Have the engine serve the weights a window staged (they must hash to ``expected_checksum``;
        it pauses per ``pause_mode`` around the swap); a refusal is returned with ``success=False``."""
        request = ActivateWeightsRequest(
            weight_version=weight_version, expected_checksum=expected_checksum, pause_mode=pause_mode
        )
        return await self.client(server_id).activate_weights(request, timeout=self.spec.update_timeout_s, fence=fence)

    async def confirm(self, server_id: str, *, fence: int | None = None) -> WeightsChecksum:
        """The checksum the engine computes now over the weights it holds."""
        result = await self.client(server_id).weights_checksum(timeout=self.spec.update_timeout_s, fence=fence)
        return self.record_checksum(server_id, result)

    def record_checksum(self, server_id: str, reported: WeightsChecksum) -> WeightsChecksum:
        """Note what a server reported it holds (from ``confirm`` or from its load's answer)."""
        cell = self.cell(server_id)
        cell.checksum, cell.weight_version = reported.checksum, reported.weight_version
        return reported

    async def fence(self, server_id: str, token: int, *, window_open: bool, staged: bool = False) -> None:
        """Tell the engine the newest fencing token, and whether a window holding it may push."""
        await self.client(server_id).fence(token, window_open=window_open, staged=staged)

    async def relabel(self, server_id: str, weight_version: str, *, fence: int | None = None) -> None:
        """Have the engine serve the weights it holds under ``weight_version`` (no reload)."""
        await self.client(server_id).update_weight_version(weight_version, fence=fence)
        self.cell(server_id).weight_version = weight_version

    async def identity(self, server_id: str) -> WeightsIdentity:
        """The version and checksum the engine says it holds (cheap: no hashing; for probes)."""
        return await self.client(server_id).weight_identity(timeout=self.spec.health.timeout_s)

    async def export(self, server_id: str, *, step: int, fence: int | None = None) -> WeightsExport:
        """Have the engine write the weights it holds as a checkpoint (for restarting a peer)."""
        return await self.client(server_id).export_weights(step=step, timeout=self.spec.update_timeout_s, fence=fence)

    def remember_checkpoint(self, checksum: str, checkpoint: Path) -> list[str]:
        """``record_copy``, and report the copy."""
        changed = self.record_copy(checksum, checkpoint)
        if self.observer is not None:
            self.observer.weights_written_out(self.model_name, checksum, checkpoint)
        return changed

    def copies_dirs(self) -> list[Path]:
        """Where this rollout's engines write weight copies the controller may remove."""
        return [] if self.runtime.copies_dir is None else [self.runtime.copies_dir]

    def record_copy(self, checksum: str, checkpoint: Path) -> list[str]:
        """Record ``checkpoint`` for every server verified on ``checksum`` without one; returns their ids."""
        changed = []
        for cell in self._cells:
            verified = cell.verified
            if verified is not None and verified.checkpoint is None and verified.checksum == checksum:
                cell.verified = dataclasses.replace(verified, checkpoint=checkpoint)
                changed.append(cell.server_id)
        return changed

    def admit(self, server_id: str, verified: VerifiedWeights, *, reason: str) -> None:
        """Mark the server as serving ``verified`` (its checksum was confirmed by the caller)."""
        cell = self.cell(server_id)
        cell.verified, cell.weight_version, cell.checksum = verified, verified.weight_version, verified.checksum
        self.transition(cell, ServerState.SERVING, reason)

    def quarantine(self, server_id: str, *, reason: str) -> None:
        self.transition(self.cell(server_id), ServerState.QUARANTINED, reason)

    async def rollback(self, server_id: str, *, reason: str, fence: int | None = None) -> None:
        """Reload and confirm the server's verified weights, else replace its process; RolloutError without any."""
        cell = self.cell(server_id)
        verified = cell.verified
        if verified is None:
            raise RolloutError("server has no verified weights to roll back to", server_id=server_id)
        if cell.state is not ServerState.UPDATING:
            self.transition(cell, ServerState.UPDATING, reason)
        try:
            confirmed: WeightsChecksum | None = await self.confirm(server_id, fence=fence)
            if confirmed is not None and confirmed.checksum != verified.checksum:
                source = await source_of(self.model_servers, verified, besides=server_id, fence=fence)
                if source is None:
                    self.quarantine(server_id, reason="its verified weights are on no disk and no peer holds them")
                    raise RolloutError(
                        "the verified weights are on no disk and no serving peer holds them; the server "
                        "stays quarantined until the next update",
                        server_id=server_id,
                        weight_version=verified.weight_version,
                        expected=verified.checksum,
                        actual=confirmed.checksum,
                    )
                confirmed = await self._reload(server_id, source, verified, fence=fence)
            elif confirmed is not None and confirmed.weight_version != verified.weight_version:
                # Never loaded the new weights (or loaded and restored them): only the label moved.
                await self.relabel(server_id, verified.weight_version, fence=fence)
        except EngineCallError:
            confirmed = None
        if confirmed is not None and confirmed.checksum == verified.checksum:
            try:
                await self.resume(server_id, fence=fence)
            except EngineCallError as exc:
                logger.warning("could not resume %s after rollback: %s", server_id, exc)
            self.admit(server_id, verified, reason=f"rolled back to {verified.weight_version}: {reason}")
            self._restored(cell, verified)
            return
        logger.warning("rollback of %s did not confirm; replacing the process", server_id)
        await self.restart(server_id, reason=f"rollback failed: {reason}", fence=fence)

    async def restart(self, server_id: str, *, reason: str, fence: int | None = None) -> None:
        """Replace the server's process and bring it back on its verified weights (in the exclusive section)."""
        cell = self.cell(server_id)
        self.lost(server_id, reason=reason)
        await self._terminate(cell)
        cell.restarts += 1
        # Where the verified weights can be read from; without any, the engine starts on the
        # spec's checkpoint and is quarantined by _bring_up (it holds other weights), never
        # admitted.
        source = await source_of(self.model_servers, cell.verified, besides=server_id, fence=fence)
        await self._bring_up(cell, source or self.spec.checkpoint, restart=True, fence=fence)

    # --- internals -------------------------------------------------------------------------

    def transition(self, cell: ServerCell, to: ServerState, reason: str) -> None:
        """Move ``cell`` to ``to`` (the table decides whether it may) and report the change."""
        change = cell.transition(to, reason=reason)
        logger.info("%s: %s -> %s (%s)", cell.server_id, change.from_state, change.to_state, reason)
        if self.observer is not None:
            self.observer.state_changed(change)

    async def _bring_up(self, cell: ServerCell, checkpoint: Path, *, restart: bool, fence: int | None = None) -> None:
        """Launch, wait healthy, confirm the checksum against what should be there, admit."""
        self.transition(cell, ServerState.STARTING, "restart" if restart else "start")
        try:
            url = await self._launch(cell, checkpoint)
        except MilesError as exc:
            self.transition(cell, ServerState.RESTARTING, f"launch failed: {exc.message}")
            raise RolloutError(f"engine failed to start: {exc}", server_id=cell.server_id) from exc
        cell.url = url
        cell.incarnation += 1
        # A new process: nothing of it probed yet, its instance asked for below.
        cell.consecutive_failures, cell.last_probe, cell.engine_instance = 0, None, None
        # A server someone else runs (attached) never sees the controller's secret: it does not
        # check it, and it would let that server change the weights of the engines launched here.
        secret = self.spec.engine_secret.get_secret_value() if self.spec.engine_secret and not self.attached else None
        self._clients[cell.server_id] = self.new_client(url, server_id=cell.server_id, http=self.http, secret=secret)
        self.transition(cell, ServerState.PENDING_WEIGHTS, "engine healthy")
        expected = cell.verified if cell.verified is not None else await asyncio.to_thread(start_weights, checkpoint)
        try:
            # Which process answers at the URL: a probe that meets another one knows the engine
            # was restarted behind the controller's back (SGLang does not say; then None).
            cell.engine_instance = (await self.identity(cell.server_id)).instance_id
            # Confirm first, rename after: a label is only moved onto weights proven to be the
            # verified ones, so an engine that came up on other weights reports its own version.
            confirmed = await self.confirm(cell.server_id, fence=fence)
            if confirmed.checksum != expected.checksum:
                confirmed = await self._adopt(cell, expected, confirmed, fence=fence)
            if confirmed.checksum == expected.checksum and confirmed.weight_version != expected.weight_version:
                # A checkpoint's manifest carries its own version; restore the one it was admitted as.
                await self.relabel(cell.server_id, expected.weight_version, fence=fence)
        except EngineCallError as exc:
            # Leave the cell restarting so the health loop tries again, rather than stuck pending.
            self.transition(cell, ServerState.RESTARTING, f"engine stopped answering after start: {exc.message}")
            raise RolloutError(f"engine failed after start: {exc}", server_id=cell.server_id) from exc
        if confirmed.checksum != expected.checksum:
            self.transition(
                cell,
                ServerState.QUARANTINED,
                f"started on {confirmed.weight_version} ({confirmed.checksum}), not the verified "
                f"{expected.weight_version} ({expected.checksum}): those weights could not be found",
            )
            raise RolloutError(
                "engine started on weights whose checksum differs from the verified one",
                server_id=cell.server_id,
                expected=expected.checksum,
                actual=confirmed.checksum,
            )
        self.admit(cell.server_id, expected, reason="weights confirmed after start")
        self._restored(cell, expected)

    async def _adopt(
        self, cell: ServerCell, expected: VerifiedWeights, confirmed: WeightsChecksum, *, fence: int | None
    ) -> WeightsChecksum:
        """What an engine that came up on other weights than ``expected`` holds after an attached
        one is told to load them (a launched one started on what it was given: nothing to do)."""
        if not self.attached or expected.checkpoint is None:
            return confirmed
        logger.info(
            "%s holds %s (%s); loading the verified %s from %s",
            cell.server_id,
            confirmed.weight_version,
            confirmed.checksum,
            expected.weight_version,
            expected.checkpoint,
        )
        # A load pauses nothing it has to resume here; the confirmation decides.
        return await self._reload(cell.server_id, expected.checkpoint, expected, fence=fence) or confirmed

    async def _reload(
        self, server_id: str, source: Path, verified: VerifiedWeights, *, fence: int | None
    ) -> WeightsChecksum | None:
        """Load ``verified`` from ``source`` and confirm it; None when the engine refused them."""
        response = await self.load(
            server_id, source, weight_version=verified.weight_version, expected_checksum=verified.checksum, fence=fence
        )
        if not response.success:
            logger.warning("%s refused the verified weights: %s", server_id, response.message)
            return None
        return await self.confirm(server_id, fence=fence)

    def _restored(self, cell: ServerCell, verified: VerifiedWeights) -> None:
        if self.observer is not None:
            self.observer.weights_restored(cell.server_id, cell.model_name, verified)

    def set_health(self, health: HealthSettings) -> None:
        """Apply new probe settings now: the supervisor's current wait ends and the next uses them."""
        self.spec = self.spec.model_copy(update={"health": health})
        self._supervisor.wake()

    def _engine_exited(self, server_id: str) -> None:
        logger.warning("the engine of %s ended", server_id)
        self._supervisor.wake()

    def suspect(self, server_id: str) -> None:
        """A request could not reach the server: probe every server now, not at the next tick."""
        self.cell(server_id)  # raises for an id that is not ours
        self._supervisor.wake()

    def peer_holding(self, cell: ServerCell) -> ServerSnapshot | None:
        """A serving server of the model (of any server type) verified on the same weights as ``cell``."""
        return peer_holding(self.model_servers, cell.verified, besides=cell.server_id)

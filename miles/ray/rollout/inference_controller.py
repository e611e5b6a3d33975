"""The InferenceController: verified weight updates under one lock, routing, one health report.

``AsyncInferenceController`` is the asyncio core; ``InferenceController`` is the blocking facade
the seed uses from a plain script (like httpx's ``Client`` beside ``AsyncClient``): it runs the core
and its HTTP API on an event loop in a background thread.

Every method of the core declares its relation to ``ContextLock("InferenceController")``: updates,
training windows, restarts, reconfiguration and shutdown take it; health, routing and event
intake never wait on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import uvloop

from miles.config import ControllerSettings, UpdatePauseMode, UpdateStrategy
from miles.errors import CheckpointError, InvalidRequestError, LockTimeoutError
from miles.ray.rollout.checksums import PublishedChecksums
from miles.ray.rollout.fleet import DEFAULT_SERVER_CLS, Fleet, health_from, normalize_specs
from miles.ray.rollout.health import FleetHealth, lock_health, model_health, overall, server_health
from miles.ray.rollout.router import Router
from miles.ray.rollout.server_state import ServerState, StateChange, VerifiedWeights
from miles.ray.rollout.update_protocol import UpdatePlan, UpdateRun, run_barrier, run_rolling
from miles.ray.rollout.update_types import (
    ChecksumSource,
    UpdateResult,
    UpdateStatus,
    UpdateWindow,
    WindowServer,
)
from miles.utils.audit_utils.event_logger.logger import EventLogger
from miles.utils.audit_utils.event_logger.models import (
    ChecksumMismatchEvent,
    ChecksumRole,
    InferenceEngineWeightChecksumEvent,
    LockAcquiredEvent,
    LockReleasedEvent,
    ServerStateChangedEvent,
    WeightUpdateAbortedEvent,
    WeightUpdateCommittedEvent,
    WeightUpdateStartedEvent,
)
from miles.utils.context_lock import (
    ContextLock,
    LockLease,
    LockTransition,
    LockTransitionKind,
    acquires_lock,
    enforce_lock_discipline,
    lock_exempt,
    releases_lock,
    requires_lock,
    with_lock,
)
from miles.weights.checkpoint import Manifest, verify_checkpoint

logger = logging.getLogger("miles.controller")

T = TypeVar("T")


class _Rejected(Exception):
    """Validation refused an update before any server was touched (internal control flow)."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


@enforce_lock_discipline(timeout_attribute="lock_timeout_s")
class AsyncInferenceController:
    """The controller core; see the module docstring. Create it, ``await start()``, use, ``close()``."""

    @lock_exempt
    def __init__(
        self,
        rollout_server_cls: str | type | Mapping[str, Any] = DEFAULT_SERVER_CLS,
        model_checkpoint: str | Path | None = None,
        *,
        num_servers: int = 1,
        settings: ControllerSettings | None = None,
        event_logger: EventLogger | None = None,
        **overrides: Any,
    ) -> None:
        self._settings = settings or ControllerSettings(**overrides)
        if settings is not None and overrides:
            self._settings = settings.model_copy(update=overrides)
        self.event_logger = event_logger or EventLogger(
            self._settings.events_dir, component="controller", fsync=self._settings.events_fsync
        )
        self.published = PublishedChecksums()
        self._subscription = self.event_logger.subscribe(self.published.observe)
        self._lock = ContextLock("InferenceController", on_transition=self._lock_event)
        self.fleet = Fleet(
            normalize_specs(rollout_server_cls, model_checkpoint, num_servers),
            settings=self._settings,
            exclusive=lambda holder: self._lock.hold(holder=holder),
            observer=self,
        )
        self.router: Router | None = None
        self._windows: dict[int, _Window] = {}
        self._last_update: UpdateResult | None = None
        self._update_listeners: list[Callable[[UpdateResult], None]] = []
        self._started_at = time.time()
        self._closed = False

    # --- settings ------------------------------------------------------------------------------

    @property
    @lock_exempt
    def settings(self) -> ControllerSettings:
        return self._settings

    @property
    @lock_exempt
    def lock_timeout_s(self) -> float:
        return self._settings.lock_timeout_s

    @with_lock
    async def reconfigure(self, patch: dict[str, Any]) -> ControllerSettings:
        """Apply runtime-changeable settings; raises InvalidRequestError naming refused fields."""
        self._settings = self._settings.changed(patch)
        self.fleet.set_health(health_from(self._settings))
        return self._settings

    # --- lifecycle -----------------------------------------------------------------------------

    @with_lock
    async def start(self) -> None:
        """Launch every server and wait until each serves verified weights."""
        self.router = Router(servers=self.fleet.snapshots, policy=lambda: self._settings.routing_policy)
        await self.fleet.start()

    @lock_exempt
    async def close(self) -> None:
        """Abort any open training window, stop every server; safe to call twice."""
        if self._closed:
            return
        for window in list(self._windows.values()):
            try:
                await self.abort_update_weights(window.token, reason="controller shutting down")
            except Exception:  # a stale window must not stop the shutdown; its lease ends anyway
                logger.exception("could not abort window %s at shutdown", window.window_id)
        await self._shutdown()
        self._subscription.close()
        self.event_logger.close()
        self._closed = True

    @with_lock
    async def _shutdown(self) -> None:
        await self.fleet.stop()

    # --- the seed's flow: an update driven from a checkpoint on disk ---------------------------

    @lock_exempt
    async def update_rollout_weights(
        self,
        new_checkpoint: str | Path,
        *,
        model_name: str | None = None,
        strategy: UpdateStrategy | str | None = None,
        pause_mode: UpdatePauseMode | str | None = None,
        timeout: float | None = None,
        weight_version: str | None = None,
    ) -> UpdateResult:
        """Run the whole update transaction (protocol steps 3-7) and report what happened.

        Waits at most ``lock_timeout_s`` for the lock (``timed_out`` result, nothing changed) and
        bounds the transaction by ``timeout`` (default ``update_timeout_s``); on timeout every
        server is put back on verified weights. Never raises for a failed update: the result says
        ``rejected``, ``rolled_back`` or ``partial`` with every server's version.
        """
        strategy = UpdateStrategy(strategy or self._settings.default_strategy)
        pause_mode = UpdatePauseMode(pause_mode or self._settings.default_pause_mode)
        server = self.fleet.server(model_name)
        started = time.monotonic()
        try:
            return await self._update_locked(
                Path(new_checkpoint),
                model_name=server.model_name,
                strategy=strategy,
                pause_mode=pause_mode,
                timeout=timeout or self._settings.update_timeout_s,
                weight_version=weight_version,
                started=started,
            )
        except LockTimeoutError as exc:
            stats = self._lock.statistics()
            return self._remember(
                UpdateResult(
                    update_id=uuid.uuid4().hex[:12],
                    status=UpdateStatus.TIMED_OUT,
                    model_name=server.model_name,
                    weight_version=weight_version,
                    previous_version=self._serving_version(server.model_name),
                    step=None,
                    checkpoint=str(new_checkpoint),
                    expected_checksum=None,
                    checksum_source=None,
                    strategy=strategy.value,
                    pause_mode=pause_mode.value,
                    servers=(),
                    message=f"the lock was not granted within {self.lock_timeout_s}s (held by {stats.holder}): {exc}",
                    duration_s=time.monotonic() - started,
                )
            )

    @with_lock
    async def _update_locked(
        self,
        checkpoint: Path,
        *,
        model_name: str,
        strategy: UpdateStrategy,
        pause_mode: UpdatePauseMode,
        timeout: float,
        weight_version: str | None,
        started: float,
    ) -> UpdateResult:
        timings = {"lock_wait": time.monotonic() - started}
        await self._heal(model_name)
        server = self.fleet.server(model_name)
        update_id = uuid.uuid4().hex[:12]
        previous = self._serving_version(model_name)
        phase = time.monotonic()
        try:
            path, manifest, expected, source = await asyncio.to_thread(
                self._validate, checkpoint, model_name, weight_version, previous
            )
        except _Rejected as rejected:
            result = UpdateResult(
                update_id=update_id,
                status=UpdateStatus.REJECTED,
                model_name=model_name,
                weight_version=weight_version,
                previous_version=previous,
                step=None,
                checkpoint=str(checkpoint),
                expected_checksum=None,
                checksum_source=None,
                strategy=strategy.value,
                pause_mode=pause_mode.value,
                servers=tuple(_unchanged(server.snapshot())),
                message=rejected.message,
                duration_s=time.monotonic() - started,
                timings={**timings, "validate": time.monotonic() - phase},
            )
            self._log_aborted(result)
            return self._remember(result)
        timings["validate"] = time.monotonic() - phase
        self.event_logger.log(
            WeightUpdateStartedEvent,
            {
                "update_id": update_id,
                "model_name": model_name,
                "weight_version": weight_version or manifest.weight_version,
                "step": manifest.step,
                "checkpoint": str(path),
                "strategy": strategy.value,
                "pause_mode": pause_mode.value,
                "server_ids": tuple(server.server_ids),
                "fencing_token": self._lock.current_lease().token,
            },
            print_log=False,
        )
        plan = UpdatePlan(
            update_id=update_id,
            model_name=model_name,
            weight_version=weight_version or manifest.weight_version,
            step=manifest.step,
            checkpoint=path,
            expected_checksum=expected,
            checksum_source=source,
            strategy=strategy,
            pause_mode=pause_mode,
            previous_version=previous,
        )
        assert self.router is not None
        run = UpdateRun(plan=plan, server=server, router=self.router, events=self)
        phase = time.monotonic()
        message = ""
        try:
            async with asyncio.timeout(timeout):
                if strategy is UpdateStrategy.ROLLING:
                    status = await run_rolling(run, path, batch_size=self._settings.rolling_batch_size)
                else:
                    status = await run_barrier(run, path)
        except TimeoutError:
            status = UpdateStatus.ROLLED_BACK
            message = f"the update did not finish within {timeout}s; servers were put back on verified weights. "
            await self._heal(model_name)
        timings["transaction"] = time.monotonic() - phase
        result = self._result(run, status=status, message=message, started=started, timings=timings)
        if status is UpdateStatus.COMMITTED:
            self._log_committed(result)
        else:
            self._log_aborted(result)
        return self._remember(result)

    @requires_lock
    def _validate(
        self, checkpoint: Path, model_name: str, weight_version: str | None, previous: str | None
    ) -> tuple[Path, Manifest, str, ChecksumSource]:
        """Protocol step 3: the checkpoint is allowed, well-formed, for this model, and the one published."""
        path = checkpoint.expanduser().resolve()
        roots = self._settings.allowed_checkpoint_roots
        if roots and not any(path.is_relative_to(root) for root in roots):
            raise _Rejected(
                f"checkpoint {path} is outside the allowed checkpoint roots ({', '.join(map(str, roots))}); "
                "move it under one of them or extend MILES_ALLOWED_CHECKPOINT_ROOTS"
            )
        if not path.is_dir():
            raise _Rejected(f"checkpoint {path} is not a directory")
        # Structure only (manifest, files, headers): every server hashes the bytes against the
        # manifest before it touches its weights, so a second full pass here would only add a
        # read of the whole checkpoint per update (minutes for large models on disk).
        report = verify_checkpoint(path, digests=False)
        if not report.ok or report.manifest is None:
            problems = "; ".join(f"{p.kind.value}: {p.message}" for p in report.problems[:5])
            raise _Rejected(f"checkpoint {path} failed verification: {problems}")
        manifest = report.manifest
        if manifest.model_name != model_name:
            raise _Rejected(
                f"checkpoint {path} is for model {manifest.model_name!r}, but these servers serve {model_name!r}"
            )
        published = self.published.expected(model_name, manifest.step)
        if published is not None:
            if published.checksum != manifest.checksum:
                raise _Rejected(
                    f"checksum mismatch: training published {published.checksum} for {model_name} step "
                    f"{manifest.step}, but checkpoint {path} holds {manifest.checksum}; it is not the "
                    "checkpoint training meant (stale, overwritten or corrupted before sealing)"
                )
            expected, source = published.checksum, ChecksumSource.PUBLISHED
        elif self._settings.require_published_checksum:
            raise _Rejected(
                f"no checksum was published for {model_name} step {manifest.step}; log an "
                "InferenceEngineWeightChecksumEvent first (require_published_checksum is on)"
            )
        else:
            expected, source = manifest.checksum, ChecksumSource.MANIFEST
        version = weight_version or manifest.weight_version
        if previous is not None and _not_newer(version, previous):
            raise _Rejected(
                f"weight version {version} is not newer than the serving version {previous}; "
                "pass a newer weight_version to republish older weights on purpose"
            )
        return path, manifest, expected, source

    # --- training-driven windows ---------------------------------------------------------------

    @acquires_lock
    async def start_update_weights(
        self, model_name: str | None = None, *, ttl_s: float | None = None, pause_mode: UpdatePauseMode | str | None = None
    ) -> UpdateWindow:
        """Open a window: hold requests, pause every server, and lease the lock to training.

        Training pushes weights to ``window.servers``, then calls ``end_update_weights`` (verify
        and commit) or ``abort_update_weights``. If the lease expires first the window is rolled
        back and its token refused.
        """
        server = self.fleet.server(model_name)
        await self._heal(server.model_name)
        update_id = uuid.uuid4().hex[:12]
        mode = UpdatePauseMode(pause_mode or self._settings.default_pause_mode)
        plan = UpdatePlan(
            update_id=update_id,
            model_name=server.model_name,
            weight_version="pending",
            step=0,
            checkpoint=None,
            expected_checksum=None,
            checksum_source=None,
            strategy=UpdateStrategy.BARRIER,
            pause_mode=mode,
            previous_version=self._serving_version(server.model_name),
        )
        assert self.router is not None
        run = UpdateRun(plan=plan, server=server, router=self.router, events=self)
        token = self._lock.current_lease().token
        self.event_logger.log(
            WeightUpdateStartedEvent,
            {
                "update_id": update_id,
                "model_name": server.model_name,
                "weight_version": "pending",
                "step": None,
                "checkpoint": None,
                "strategy": "window",
                "pause_mode": mode.value,
                "server_ids": tuple(server.server_ids),
                "fencing_token": token,
            },
            print_log=False,
        )
        self.router.close_gate(server.model_name)
        try:
            await run.take_out(server.server_ids)
        except BaseException:
            await run.restore(server.server_ids, reason="window could not open")
            self.router.open_gate(server.model_name)
            raise
        ttl = ttl_s or self._settings.lease_ttl_s
        lease = self._lock.detach(ttl_s=ttl, on_expire=self._window_expired)
        window = UpdateWindow(
            window_id=uuid.uuid4().hex[:12],
            update_id=update_id,
            model_name=server.model_name,
            token=lease.token,
            expires_at=lease.expires_at,
            ttl_s=ttl,
            pause_mode=mode.value,
            servers=tuple(
                WindowServer(server_id=s.server_id, url=s.url or "", weight_version=s.weight_version)
                for s in server.snapshot()
            ),
        )
        self._windows[lease.token] = _Window(window=window, run=run, started=time.monotonic())
        return window

    @releases_lock(token="window")
    async def end_update_weights(
        self,
        window: UpdateWindow | int,
        *,
        checksum: str,
        step: int,
        checkpoint: str | Path | None = None,
        weight_version: str | None = None,
    ) -> UpdateResult:
        """Verify what every server of the window now holds against ``checksum`` and commit.

        ``checkpoint`` (the directory training pushed from, if it pushed by disk) is recorded as
        the servers' verified weights, so a restart can reload them.
        """
        state = self._take_window(window)
        plan = state.run.plan
        version = weight_version or str(step)
        if _not_newer(version, plan.previous_version):
            await self._finish_window(state, reason=f"weight version {version} is not newer than {plan.previous_version}")
            return self._remember(
                self._result(
                    state.run,
                    status=UpdateStatus.ROLLED_BACK,
                    message=f"weight version {version} is not newer than the serving version {plan.previous_version}",
                    started=state.started,
                )
            )
        published = self.published.expected(plan.model_name, step)
        if published is None:
            self.event_logger.log(
                InferenceEngineWeightChecksumEvent,
                {"model_name": plan.model_name, "checksum": checksum, "step": step, "weight_version": version},
                print_log=False,
            )
        elif published.checksum != checksum:
            await self._finish_window(state, reason="training's checksum differs from the one it published")
            return self._remember(
                self._result(
                    state.run,
                    status=UpdateStatus.ROLLED_BACK,
                    message=f"the window's checksum {checksum} differs from the one published for step {step} "
                    f"({published.checksum}); nothing was admitted",
                    started=state.started,
                )
            )
        state.run.plan = plan = dataclasses.replace(
            plan,
            weight_version=version,
            step=step,
            checkpoint=Path(checkpoint).resolve() if checkpoint else None,
            expected_checksum=checksum,
            checksum_source=ChecksumSource.TRAINING,
        )
        ids = state.run.server.server_ids
        await state.run.confirm(ids, checksum)
        if state.run.failed(ids):
            await self._finish_window(state, reason=f"checksum not confirmed on {', '.join(state.run.failed(ids))}")
            result = self._result(state.run, status=UpdateStatus.ROLLED_BACK, message="", started=state.started)
            self._log_aborted(result)
            return self._remember(result)
        await state.run.admit(ids, checksum)
        assert self.router is not None
        self.router.open_gate(plan.model_name)
        result = self._result(state.run, status=UpdateStatus.COMMITTED, message="", started=state.started)
        self._log_committed(result)
        return self._remember(result)

    @releases_lock(token="window")
    async def abort_update_weights(self, window: UpdateWindow | int, *, reason: str = "aborted by training") -> UpdateResult:
        """Put every server of the window back on its last verified weights and resume serving."""
        state = self._take_window(window)
        await self._finish_window(state, reason=reason)
        result = self._result(state.run, status=UpdateStatus.ABORTED, message=reason, started=state.started)
        self._log_aborted(result)
        return self._remember(result)

    @lock_exempt
    def _window_expired(self, lease: LockLease) -> None:
        # Called by the lock when a window's lease runs out (the lock is already free again).
        state = self._windows.pop(lease.token, None)
        if state is not None:
            logger.warning("training window %s expired; rolling it back", state.window.window_id)
            asyncio.get_running_loop().create_task(self._expire_window(state))

    @with_lock
    async def _expire_window(self, state: _Window) -> None:
        await self._finish_window(state, reason="the window's lease expired before training ended it")
        result = self._result(
            state.run, status=UpdateStatus.ABORTED, message="lease expired; rolled back", started=state.started
        )
        self._log_aborted(result)
        self._remember(result)

    @requires_lock
    def _take_window(self, window: UpdateWindow | int) -> _Window:
        token = window if isinstance(window, int) else window.token
        state = self._windows.pop(token, None)
        if state is None:
            raise InvalidRequestError("no open window has this token", status_code=409, token=token)
        return state

    @requires_lock
    async def _finish_window(self, state: _Window, *, reason: str) -> None:
        await state.run.restore(state.run.server.server_ids, reason=reason)
        assert self.router is not None
        self.router.open_gate(state.run.plan.model_name)

    # --- recovery ------------------------------------------------------------------------------

    @requires_lock
    async def _heal(self, model_name: str) -> None:
        """Put back on verified weights any server a failed or expired operation left updating."""
        server = self.fleet.server(model_name)
        stuck = [s.server_id for s in server.snapshot() if s.state in (ServerState.UPDATING, ServerState.QUARANTINED)]
        if stuck:
            logger.warning("restoring %s left mid-update", ", ".join(stuck))
            await asyncio.gather(*(server.rollback(sid, reason="recovered mid-update") for sid in stuck), return_exceptions=True)
        if self.router is not None and not self.router.gate_open(model_name):
            self.router.open_gate(model_name)

    # --- health, events, observation -----------------------------------------------------------

    @lock_exempt
    def health(self) -> FleetHealth:
        """The aggregated health report; never waits on the lock."""
        now = time.time()
        models = {}
        servers = []
        for name in self.fleet.model_names:
            snapshots = self.fleet.snapshots(name)
            accepting = self.router.gate_open(name) if self.router else True
            models[name] = model_health(name, snapshots, accepting=accepting)
            for snap in snapshots:
                outstanding = self.router.outstanding(snap.server_id) if self.router else 0
                servers.append(server_health(snap, in_flight=outstanding, now=now))
        status, ok = overall(models)
        return FleetHealth(
            status=status,
            ok=ok,
            models=models,
            servers=servers,
            lock=lock_health(self._lock.statistics()),
            last_update=self._last_update,
            uptime_s=round(now - self._started_at, 3),
        )

    @property
    @lock_exempt
    def last_update(self) -> UpdateResult | None:
        return self._last_update

    @lock_exempt
    def state_changed(self, change: StateChange) -> None:
        self.event_logger.log(
            ServerStateChangedEvent,
            {
                "server_id": change.server_id,
                "model_name": change.model_name,
                "from_state": change.from_state.value,
                "to_state": change.to_state.value,
                "weight_version": change.weight_version,
                "reason": change.reason,
            },
            print_log=False,
        )
        if self.router is not None:
            self.router.fleet_changed()

    @lock_exempt
    def weights_restored(self, server_id: str, model_name: str, verified: VerifiedWeights) -> None:
        self.event_logger.log(
            InferenceEngineWeightChecksumEvent,
            {
                "model_name": model_name,
                "checksum": verified.checksum,
                "step": verified.step or 0,
                "weight_version": verified.weight_version,
                "server_id": server_id,
                "role": ChecksumRole.RESTORED,
            },
            print_log=False,
        )

    @lock_exempt
    def confirmed(self, plan: UpdatePlan, server_id: str, checksum: str) -> None:
        self.event_logger.log(
            InferenceEngineWeightChecksumEvent,
            {
                "model_name": plan.model_name,
                "checksum": checksum,
                "step": plan.step,
                "weight_version": plan.weight_version,
                "server_id": server_id,
                "role": ChecksumRole.CONFIRMED,
            },
            print_log=False,
        )

    @lock_exempt
    def mismatch(self, plan: UpdatePlan, server_id: str, actual: str) -> None:
        self.event_logger.log(
            ChecksumMismatchEvent,
            {
                "update_id": plan.update_id,
                "model_name": plan.model_name,
                "server_id": server_id,
                "step": plan.step,
                "weight_version": plan.weight_version,
                "expected": plan.expected_checksum or "",
                "actual": actual,
            },
            print_log=True,
        )

    @lock_exempt
    def _lock_event(self, transition: LockTransition) -> None:
        if transition.kind is LockTransitionKind.ACQUIRED:
            self.event_logger.log(
                LockAcquiredEvent,
                {
                    "lock_name": transition.lock_name,
                    "holder": transition.holder,
                    "token": transition.token,
                    "waited_s": transition.waited_s or 0.0,
                },
                print_log=False,
            )
        else:
            self.event_logger.log(
                LockReleasedEvent,
                {
                    "lock_name": transition.lock_name,
                    "holder": transition.holder,
                    "token": transition.token,
                    "held_s": transition.held_s or 0.0,
                    "reason": "lease_expired" if transition.kind is LockTransitionKind.LEASE_EXPIRED else "released",
                },
                print_log=False,
            )

    # --- results -------------------------------------------------------------------------------

    @lock_exempt
    def _serving_version(self, model_name: str) -> str | None:
        versions = {s.weight_version for s in self.fleet.snapshots(model_name) if s.state is ServerState.SERVING}
        return versions.pop() if len(versions) == 1 else None

    @lock_exempt
    def _result(
        self, run: UpdateRun, *, status: UpdateStatus, message: str, started: float, timings: dict[str, float] | None = None
    ) -> UpdateResult:
        plan = run.plan
        outcomes = run.outcomes()
        if not message:
            failures = [f"{o.server_id}: {o.error}" for o in outcomes if o.error]
            message = {
                UpdateStatus.COMMITTED: f"every server verified and serving {plan.weight_version}",
                UpdateStatus.REJECTED: "every server refused the checkpoint before touching its weights",
                UpdateStatus.ROLLED_BACK: "rolled back to verified weights",
                UpdateStatus.PARTIAL: "halted part-way; some servers serve the new version",
            }.get(status, status.value)
            if failures:
                message = f"{message}: " + "; ".join(failures)
        return UpdateResult(
            update_id=plan.update_id,
            status=status,
            model_name=plan.model_name,
            weight_version=plan.weight_version,
            previous_version=plan.previous_version,
            step=plan.step,
            checkpoint=str(plan.checkpoint) if plan.checkpoint else None,
            expected_checksum=plan.expected_checksum,
            checksum_source=plan.checksum_source,
            strategy=plan.strategy.value,
            pause_mode=plan.pause_mode.value,
            servers=outcomes,
            message=message,
            duration_s=time.monotonic() - started,
            timings=timings or {},
        )

    @lock_exempt
    def on_update(self, listener: Callable[[UpdateResult], None]) -> None:
        """Call ``listener`` with every update's result (metrics, progress displays)."""
        self._update_listeners.append(listener)

    @lock_exempt
    def _remember(self, result: UpdateResult) -> UpdateResult:
        self._last_update = result
        log = logger.info if result.ok else logger.error
        log("update %s %s: %s", result.update_id, result.status.value, result.message)
        for listener in self._update_listeners:
            listener(result)
        return result

    @lock_exempt
    def _log_committed(self, result: UpdateResult) -> None:
        self.event_logger.log(
            WeightUpdateCommittedEvent,
            {
                "update_id": result.update_id,
                "model_name": result.model_name,
                "weight_version": result.weight_version or "",
                "step": result.step,
                "checksum": result.expected_checksum or "",
                "server_ids": tuple(o.server_id for o in result.servers),
                "duration_s": result.duration_s,
            },
            print_log=False,
        )

    @lock_exempt
    def _log_aborted(self, result: UpdateResult) -> None:
        self.event_logger.log(
            WeightUpdateAbortedEvent,
            {
                "update_id": result.update_id,
                "model_name": result.model_name,
                "weight_version": result.weight_version or "",
                "step": result.step,
                "reason": f"{result.status.value}: {result.message}",
                "server_versions": {o.server_id: o.weight_version or "" for o in result.servers},
            },
            print_log=False,
        )


class _Window:
    """An open training window: its public description and the run that holds its servers."""

    def __init__(self, *, window: UpdateWindow, run: UpdateRun, started: float) -> None:
        self.window = window
        self.run = run
        self.started = started

    @property
    def token(self) -> int:
        return self.window.token

    @property
    def window_id(self) -> str:
        return self.window.window_id


def _unchanged(snapshots: list) -> list:  # noqa: ANN001 - ServerSnapshot -> ServerOutcome
    from miles.ray.rollout.update_types import ServerOutcome

    return [
        ServerOutcome(server_id=s.server_id, state=s.state.value, weight_version=s.weight_version, checksum=s.checksum)
        for s in snapshots
    ]


def _not_newer(version: str, previous: str | None) -> bool:
    """True when both versions are integers and ``version`` does not exceed ``previous``."""
    if previous is None:
        return False
    try:
        return int(version) <= int(previous)
    except ValueError:
        return False


class _LoopThread:
    """An asyncio event loop running in a daemon thread, for the blocking facade."""

    def __init__(self) -> None:
        # uvloop: the controller's loop carries every routed request; libuv halves its overhead.
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="miles-controller-loop", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class InferenceController:
    """The blocking facade: serves the checkpoint and answers HTTP on ``port`` once constructed.

    >>> controller = InferenceController(
    ...     rollout_server_cls="miles.rollout.sft_rollout.SFTRollout",
    ...     model_checkpoint="/path/to/checkpoint",
    ...     port=8000,
    ... )  # doctest: +SKIP
    """

    def __init__(
        self,
        rollout_server_cls: str | type | Mapping[str, Any] = DEFAULT_SERVER_CLS,
        model_checkpoint: str | Path | None = None,
        port: int | None = None,
        *,
        serve_http: bool = True,
        **kwargs: Any,
    ) -> None:
        if port is not None:
            kwargs["port"] = port
        self._runner = _LoopThread()
        self._http: Any = None
        try:
            self.core = self._runner.call(_build(rollout_server_cls, model_checkpoint, kwargs))
            self._runner.call(self.core.start())
            if serve_http:
                from miles.server.http_runner import HttpServer  # adapter: only the facade serves HTTP

                self._http = HttpServer(self.core)
                self._runner.call(self._http.start())
        except BaseException:
            self._teardown()
            raise

    @property
    def event_logger(self) -> EventLogger:
        return self.core.event_logger

    @property
    def port(self) -> int | None:
        return self._http.port if self._http else None

    @property
    def url(self) -> str | None:
        return self._http.url if self._http else None

    def update_rollout_weights(self, new_checkpoint: str | Path, **kwargs: Any) -> UpdateResult:
        """Blocking twin of ``AsyncInferenceController.update_rollout_weights``."""
        return self._runner.call(self.core.update_rollout_weights(new_checkpoint, **kwargs))

    def start_update_weights(self, model_name: str | None = None, **kwargs: Any) -> UpdateWindow:
        return self._runner.call(self.core.start_update_weights(model_name, **kwargs))

    def end_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateResult:
        return self._runner.call(self.core.end_update_weights(window, **kwargs))

    def abort_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateResult:
        return self._runner.call(self.core.abort_update_weights(window, **kwargs))

    def health(self) -> FleetHealth:
        return self._runner.call(_call_sync(self.core.health))

    def reconfigure(self, patch: dict[str, Any]) -> ControllerSettings:
        return self._runner.call(self.core.reconfigure(patch))

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the controller's loop (for callers mixing in async code)."""
        return self._runner.call(coro, timeout)

    def close(self) -> None:
        """Stop HTTP, abort open windows, stop every server; idempotent."""
        self._teardown()

    def _teardown(self) -> None:
        if self._runner is None:
            return
        try:
            if self._http is not None:
                self._runner.call(self._http.stop())
            core = getattr(self, "core", None)
            if core is not None:
                self._runner.call(core.close())
        finally:
            self._runner.stop()
            self._runner = None  # type: ignore[assignment]

    def __enter__(self) -> InferenceController:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _build(
    rollout_server_cls: str | type | Mapping[str, Any], model_checkpoint: str | Path | None, kwargs: dict[str, Any]
) -> AsyncInferenceController:
    # Built on the loop thread: the router and the lock bind to this loop.
    return AsyncInferenceController(rollout_server_cls, model_checkpoint, **kwargs)


async def _call_sync(func: Callable[[], T]) -> T:
    return func()

"""AsyncInferenceController: verified weight updates under one lock, routing, one health report.

The asyncio core of the InferenceController (the blocking facade the seed uses lives in
``inference_controller.py``). Every method declares its relation to
``ContextLock("InferenceController")``: updates, training windows, restarts, reconfiguration and
shutdown take it; health, routing and event intake never wait on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from miles.config import (
    LEASE_TTL_MAX_S,
    LEASE_TTL_MIN_S,
    UPDATE_TIMEOUT_MAX_S,
    UPDATE_TIMEOUT_MIN_S,
    ControllerSettings,
    UpdatePauseMode,
    UpdateStrategy,
    check_seconds,
)
from miles.controller.events import ControllerEvents
from miles.controller.fleet import DEFAULT_SERVER_CLS, Fleet, health_from, normalize_specs
from miles.controller.gate import CheckpointRejected, admit_checkpoint, refused_plain_message
from miles.controller.health import FleetHealth, lock_health, model_health, overall, server_health
from miles.controller.published import PublishedChecksums
from miles.controller.results import (
    ChecksumSource,
    UpdateResult,
    UpdateStatus,
    UpdateWindow,
    WindowServer,
)
from miles.controller.router import Router
from miles.controller.transaction import UpdatePlan, UpdateRun, run_barrier, run_rolling
from miles.errors import (
    CheckpointError,
    ConflictError,
    InvalidRequestError,
    LockTimeoutError,
    MilesError,
)
from miles.protocol.auth import window_credential
from miles.rollout.engine_client import EngineCallError
from miles.rollout.state import ServerState
from miles.utils.audit_utils.event_logger.logger import EventLogger
from miles.utils.context_lock import (
    ContextLock,
    LockLease,
    acquires_lock,
    enforce_lock_discipline,
    lock_exempt,
    releases_lock,
    requires_lock,
    with_lock,
)
from miles.utils.weight_version import is_newer, newest
from miles.weights.checkpoint import read_manifest
from miles.weights.paths import checked_path

logger = logging.getLogger("miles.controller")


@dataclasses.dataclass
class _Window:
    """An open training window: its public description and the run that holds its servers."""

    window: UpdateWindow
    run: UpdateRun
    started: float


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
        self.router: Router | None = None
        self._events = ControllerEvents(self.event_logger, fleet_changed=self._fleet_changed)
        self._lock = ContextLock("InferenceController", on_transition=self._events.lock_transition)
        # One secret per controller: its engines refuse weight-changing and pause calls without
        # it, so only this controller (and the windows it opens) can change their weights.
        self._engine_secret = secrets.token_urlsafe(32)
        self.fleet = Fleet(
            normalize_specs(rollout_server_cls, model_checkpoint, num_servers),
            settings=self._settings,
            exclusive=lambda holder: self._lock.hold(holder=holder),
            observer=self._events,
            engine_secret=self._engine_secret,
        )
        self._windows: dict[int, _Window] = {}
        # Copies of pushed weights being written to disk after a window committed them.
        self._snapshots: set[asyncio.Task[None]] = set()
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
    def engine_secret(self) -> str:
        """The secret this controller's engines require (for the HTTP adapter that proxies to them)."""
        return self._engine_secret

    @property
    @lock_exempt
    def lock_timeout_s(self) -> float:
        return self._settings.lock_timeout_s

    @with_lock
    async def reconfigure(self, patch: dict[str, Any]) -> ControllerSettings:
        """Apply runtime-changeable settings; raises InvalidRequestError naming refused fields.

        Every change is logged as a ``SettingsChangedEvent`` (printed when it touches a safety
        setting), so the audit trail shows who could have let unverified weights through.
        """
        before = self._settings
        self._settings = self._settings.changed(patch)
        self.fleet.set_health(health_from(self._settings))
        self._events.settings_changed(before, self._settings)
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
        self.stop_routing()
        for task in list(self._snapshots):
            task.cancel()
        await asyncio.gather(*self._snapshots, return_exceptions=True)
        for state in list(self._windows.values()):
            try:
                await self.abort_update_weights(state.window.token, reason="controller shutting down")
            except Exception:  # a stale window must not stop the shutdown; its lease ends anyway
                logger.exception("could not abort window %s at shutdown", state.window.window_id)
        await self._shutdown()
        self._subscription.close()
        self.event_logger.close()
        self._closed = True

    @lock_exempt
    def stop_routing(self) -> None:
        """End every request waiting for a server, and refuse new ones, with a 503: shutting down.

        Called before the HTTP server drains its connections, so that requests waiting for a
        server (an unsatisfiable ``min_weight_version``, a model with none serving) cannot hold
        the shutdown up for their whole timeout.
        """
        if self.router is not None:
            self.router.close("the controller is shutting down; retry against another controller")

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
        started = time.monotonic()
        server = self.fleet.rollout(model_name)
        if timeout is not None:
            timeout = check_seconds(timeout, name="timeout", low=UPDATE_TIMEOUT_MIN_S, high=UPDATE_TIMEOUT_MAX_S)
        plan = UpdatePlan(
            update_id=uuid.uuid4().hex[:12],
            model_name=server.model_name,
            weight_version=weight_version or "",
            step=0,
            checkpoint=Path(new_checkpoint),
            expected_checksum=None,
            checksum_source=None,
            strategy=_choice(UpdateStrategy, strategy or self._settings.default_strategy, "strategy"),
            pause_mode=_choice(UpdatePauseMode, pause_mode or self._settings.default_pause_mode, "pause_mode"),
            # Read under the lock by the update itself (_update_locked): a value read here could
            # be overtaken by an update queued ahead of this one.
            previous_version=None,
        )
        try:
            return await self._update_locked(plan, timeout=timeout or self._settings.update_timeout_s, started=started)
        except LockTimeoutError as exc:
            holder = self._lock.statistics().holder
            run = self._run(plan)
            message = f"the lock was not granted within {self.lock_timeout_s}s (held by {holder}): {exc}"
            return self._remember(run.result(UpdateStatus.TIMED_OUT, started=started, message=message))

    @with_lock
    async def _update_locked(self, plan: UpdatePlan, *, timeout: float, started: float) -> UpdateResult:
        timings = {"lock_wait": time.monotonic() - started}
        await self._heal(plan.model_name)
        plan = dataclasses.replace(plan, previous_version=self._committed_version(plan.model_name))
        assert plan.checkpoint is not None
        try:
            admitted = await asyncio.to_thread(
                admit_checkpoint,
                plan.checkpoint,
                model_name=plan.model_name,
                settings=self._settings,
                published=self.published,
                weight_version=plan.weight_version or None,
                serving_version=plan.previous_version,
            )
        except CheckpointRejected as rejected:
            timings["validate"] = time.monotonic() - started - timings["lock_wait"]
            return self._finish(
                self._run(plan).result(UpdateStatus.REJECTED, started=started, message=rejected.message, timings=timings)
            )
        timings["validate"] = time.monotonic() - started - timings["lock_wait"]
        plan = dataclasses.replace(
            plan,
            weight_version=admitted.weight_version,
            step=admitted.step,
            checkpoint=admitted.path,
            expected_checksum=admitted.expected_checksum,
            checksum_source=admitted.checksum_source,
        )
        run = self._run(plan)
        self._events.started(
            plan,
            server_ids=run.server.server_ids,
            fencing_token=self._lock.current_lease().token,
            strategy=plan.strategy.value,
        )
        phase = time.monotonic()
        message = ""
        try:
            async with asyncio.timeout(timeout):
                if plan.strategy is UpdateStrategy.ROLLING:
                    status = await run_rolling(run, admitted.path, batch_size=self._settings.rolling_batch_size)
                else:
                    status = await run_barrier(run, admitted.path)
        except TimeoutError:
            status = UpdateStatus.ROLLED_BACK
            message = f"the update did not finish within {timeout}s; servers were put back on verified weights"
            await self._heal(plan.model_name)
        except BaseException:
            # A failure nobody planned for (a bug in a server type, a cancelled caller): put every
            # server back on verified weights before the lock is released, then report it.
            await self._heal(plan.model_name)
            raise
        timings["transaction"] = time.monotonic() - phase
        actual = run.checkpoint_checksums()
        if status is UpdateStatus.REJECTED and admitted.manifest is None and len(actual) == 1:
            # A plain directory's weights were hashed by the servers; say which published step,
            # if any, they belong to.
            message = refused_plain_message(
                admitted, model_name=plan.model_name, published=self.published, actual=actual.pop()
            )
        return self._finish(run.result(status, started=started, message=message, timings=timings))

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
        # Everything that can be refused is checked before any server is touched.
        server = self.fleet.rollout(model_name)
        ttl = check_seconds(
            ttl_s if ttl_s is not None else self._settings.lease_ttl_s,
            name="ttl_s",
            low=LEASE_TTL_MIN_S,
            high=LEASE_TTL_MAX_S,
        )
        mode = _choice(UpdatePauseMode, pause_mode or self._settings.default_pause_mode, "pause_mode")
        await self._heal(server.model_name)
        plan = UpdatePlan(
            update_id=uuid.uuid4().hex[:12],
            model_name=server.model_name,
            weight_version="pending",
            step=0,
            checkpoint=None,
            expected_checksum=None,
            checksum_source=None,
            strategy=UpdateStrategy.BARRIER,
            pause_mode=mode,
            previous_version=self._committed_version(server.model_name),
        )
        run = self._run(plan)
        self._events.started(
            plan, server_ids=server.server_ids, fencing_token=self._lock.current_lease().token, strategy="window"
        )
        assert self.router is not None
        self.router.close_gate(server.model_name)
        token = self._lock.current_lease().token
        try:
            await run.take_out(server.server_ids)
            # The engines accept the window's credential from now until it is closed again.
            await asyncio.gather(*(server.fence(sid, token, window_open=True) for sid in server.server_ids))
            lease = self._lock.detach(ttl_s=ttl, on_expire=self._window_expired)
        except BaseException:
            # Whatever failed once the fleet was touched, put it back as it was: servers on their
            # verified weights and serving, the gate open. The lock is released by the caller's
            # declaration (@acquires_lock) when this raises.
            await self._close_on_engines(run, token)
            await run.restore(server.server_ids, reason="the window could not open")
            self.router.open_gate(server.model_name)
            raise
        window = UpdateWindow(
            window_id=uuid.uuid4().hex[:12],
            update_id=plan.update_id,
            model_name=server.model_name,
            token=lease.token,
            expires_at=lease.expires_at,
            ttl_s=ttl,
            pause_mode=plan.pause_mode.value,
            servers=tuple(
                WindowServer(server_id=s.server_id, url=s.url or "", weight_version=s.weight_version)
                for s in server.snapshot()
            ),
            credential=window_credential(self._engine_secret, lease.token),
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
        the servers' verified weights when its manifest holds ``checksum``, so a restart can reload
        them; otherwise one engine writes the committed weights to disk after the commit. Raises
        InvalidRequestError for a bad argument, after rolling the window back: the lock is released
        on return whatever happens, so a window can never outlive this call.
        """
        state = self._take_window(window)
        try:
            return await self._commit_window(
                state, checksum=checksum, step=step, checkpoint=checkpoint, weight_version=weight_version
            )
        except BaseException as exc:
            await self._finish_window(state, reason=f"ending the window failed: {exc}")
            self._finish(state.run.result(UpdateStatus.ROLLED_BACK, started=state.started, message=str(exc)))
            raise

    @requires_lock
    async def _commit_window(
        self, state: _Window, *, checksum: str, step: int, checkpoint: str | Path | None, weight_version: str | None
    ) -> UpdateResult:
        if not isinstance(checksum, str) or not checksum:
            raise InvalidRequestError(f"checksum must be a non-empty string, got {checksum!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidRequestError(f"step must be an integer >= 0, got {step!r}")
        if weight_version is not None and (not isinstance(weight_version, str) or not weight_version):
            raise InvalidRequestError(f"weight_version must be a non-empty string, got {weight_version!r}")
        holding = _checkpoint_holding(checkpoint, checksum)
        run = state.run
        version = weight_version or str(step)
        refusal = None
        published = self.published.expected(run.plan.model_name, step)
        if is_newer(version, run.plan.previous_version) is False:
            refusal = (
                f"weight version {version} is not newer than the version the fleet already serves "
                f"({run.plan.previous_version}); serving versions never go back"
            )
        elif published is not None and published.checksum != checksum:
            refusal = (
                f"the window's checksum {checksum} differs from the one published for step {step} "
                f"({published.checksum}); nothing was admitted"
            )
        if refusal is not None:
            await self._finish_window(state, reason=refusal)
            return self._finish(run.result(UpdateStatus.ROLLED_BACK, started=state.started, message=refusal))
        if published is None:
            self._events.published(run.plan.model_name, checksum, step, version)
        run.plan = dataclasses.replace(
            run.plan,
            weight_version=version,
            step=step,
            checkpoint=holding,
            expected_checksum=checksum,
            checksum_source=ChecksumSource.TRAINING,
        )
        ids = run.server.server_ids
        # Nothing may push once the weights are being confirmed: close the window on the engines.
        await self._close_on_engines(run, state.window.token)
        await run.confirm(ids, checksum)
        if run.failed(ids):
            await self._finish_window(state, reason=f"checksum not confirmed on {', '.join(run.failed(ids))}")
            return self._finish(run.result(UpdateStatus.ROLLED_BACK, started=state.started))
        await run.admit(ids, checksum)
        assert self.router is not None
        self.router.open_gate(run.plan.model_name)
        if run.plan.checkpoint is None:
            self._write_out(run.plan.model_name, checksum=checksum, step=step)
        return self._finish(run.result(UpdateStatus.COMMITTED, started=state.started))

    @releases_lock(token="window")
    async def abort_update_weights(self, window: UpdateWindow | int, *, reason: str = "aborted by training") -> UpdateResult:
        """Put every server of the window back on its last verified weights and resume serving."""
        state = self._take_window(window)
        await self._finish_window(state, reason=reason)
        return self._finish(state.run.result(UpdateStatus.ABORTED, started=state.started, message=reason))

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
        self._finish(state.run.result(UpdateStatus.ABORTED, started=state.started, message="lease expired; rolled back"))

    @requires_lock
    def _take_window(self, window: UpdateWindow | int) -> _Window:
        token = window if isinstance(window, int) else window.token
        state = self._windows.pop(token, None)
        if state is None:
            raise ConflictError("no open window has this token", token=token)
        return state

    @requires_lock
    async def _finish_window(self, state: _Window, *, reason: str) -> None:
        assert self.router is not None
        try:
            await self._close_on_engines(state.run, state.window.token)
            await state.run.restore(state.run.server.server_ids, reason=reason)
        finally:
            self.router.open_gate(state.run.plan.model_name)

    @lock_exempt
    async def _close_on_engines(self, run: UpdateRun, token: int) -> None:
        """Have every engine of the window refuse its credential from now on.

        An engine that cannot be told (it died) is restarted before it serves again, and a new
        process knows no window; so a failure here is logged, not raised.
        """

        async def close(server_id: str) -> None:
            try:
                await run.server.fence(server_id, token, window_open=False)
            except MilesError as exc:
                logger.warning("could not close window %d on %s: %s", token, server_id, exc)

        await asyncio.gather(*(close(sid) for sid in run.server.server_ids))

    # --- recovery ------------------------------------------------------------------------------

    @requires_lock
    async def _heal(self, model_name: str) -> None:
        """Put back on verified weights any server a failed or expired operation left updating."""
        server = self.fleet.rollout(model_name)
        stuck = [s.server_id for s in server.snapshot() if s.state in (ServerState.UPDATING, ServerState.QUARANTINED)]
        if stuck:
            logger.warning("restoring %s left mid-update", ", ".join(stuck))
            await asyncio.gather(*(server.rollback(sid, reason="recovered mid-update") for sid in stuck), return_exceptions=True)
        if self.router is not None and not self.router.gate_open(model_name):
            self.router.open_gate(model_name)

    # --- health and observation ----------------------------------------------------------------

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
    def on_update(self, listener: Callable[[UpdateResult], None]) -> None:
        """Call ``listener`` with every update's result (metrics, progress displays)."""
        self._update_listeners.append(listener)

    @lock_exempt
    def suspect(self, model_name: str, server_id: str) -> None:
        """A request could not reach ``server_id``: have its rollout server probe it now."""
        try:
            self.fleet.rollout(model_name).suspect(server_id)
        except MilesError:
            logger.warning("asked to probe %s of %s, which is not served", server_id, model_name)

    @lock_exempt
    def _fleet_changed(self) -> None:
        if self.router is not None:
            self.router.fleet_changed()

    @requires_lock
    def _committed_version(self, model_name: str) -> str | None:
        """The newest version any server of the model was verified on, read under the lock.

        An update or window must be newer than this: it is what the fleet already serves (or
        served last, for a server that is restarting), and serving versions never go back.
        """
        versions = [s.verified.weight_version for s in self.fleet.snapshots(model_name) if s.verified is not None]
        return newest(versions) or (versions[0] if len(set(versions)) == 1 else None)

    # --- copies of pushed weights --------------------------------------------------------------

    @lock_exempt
    def _write_out(self, model_name: str, *, checksum: str, step: int) -> None:
        """Have one serving engine write the weights a window pushed to disk, in the background,
        so any server (even the only one) that restarts can reload them."""
        task = asyncio.get_running_loop().create_task(
            self._write_out_now(model_name, checksum=checksum, step=step), name=f"write-out-{model_name}"
        )
        self._snapshots.add(task)
        task.add_done_callback(self._snapshots.discard)

    @lock_exempt
    async def _write_out_now(self, model_name: str, *, checksum: str, step: int) -> None:
        server = self.fleet.rollout(model_name)
        # The engine holds its weights still while it writes (an update waits for the copy), and
        # the copy is only recorded for servers still verified on the same checksum.
        holders = [
            s.server_id
            for s in server.snapshot()
            if s.state is ServerState.SERVING and s.verified is not None and s.verified.checksum == checksum
        ]
        for server_id in holders:
            try:
                exported = await server.export(server_id, step=step)
            except EngineCallError as exc:
                logger.warning("%s could not write out the pushed weights: %s", server_id, exc)
                continue
            if exported.checksum == checksum:
                recorded = server.remember_checkpoint(checksum, exported.path)
                logger.info("pushed weights %s written to %s for %s", checksum, exported.path, ", ".join(recorded))
                return
        logger.warning("no server could write out the pushed weights %s; restarts will copy them from a peer", checksum)

    @lock_exempt
    def _run(self, plan: UpdatePlan) -> UpdateRun:
        assert self.router is not None, "the controller was not started"
        return UpdateRun(plan=plan, server=self.fleet.rollout(plan.model_name), router=self.router, events=self._events)

    @lock_exempt
    def _finish(self, result: UpdateResult) -> UpdateResult:
        """Log the update's end, keep it as the last update, tell listeners; return it."""
        self._events.finished(result)
        return self._remember(result)

    @lock_exempt
    def _remember(self, result: UpdateResult) -> UpdateResult:
        self._last_update = result
        log = logger.info if result.ok else logger.error
        log("update %s %s: %s", result.update_id, result.status.value, result.message)
        for listener in self._update_listeners:
            listener(result)
        return result


def _choice(enum_type: type[Any], value: Any, name: str) -> Any:
    """``value`` as a member of ``enum_type``; InvalidRequestError naming the choices otherwise."""
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(member.value for member in enum_type)
        raise InvalidRequestError(f"{name} must be one of {choices}, got {value!r}") from None


def _checkpoint_holding(checkpoint: str | Path | None, checksum: str) -> Path | None:
    """``checkpoint`` when its manifest says it holds weights with ``checksum``; else None.

    A window's checkpoint is where restarts reload its weights from, so a directory that holds
    other weights (a stale path, a later save over it) must not be recorded as theirs.
    """
    if checkpoint is None:
        return None
    path = checked_path(str(checkpoint), field="checkpoint")
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        logger.warning("window checkpoint %s cannot serve restarts: %s", path, exc)
        return None
    if manifest.checksum != checksum:
        logger.warning("window checkpoint %s holds %s, not the committed %s", path, manifest.checksum, checksum)
        return None
    return path

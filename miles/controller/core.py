"""AsyncInferenceController: verified weight updates under one lock, routing, one health report.

Updates, training windows, restarts, reconfiguration and shutdown take the controller's lock;
health, routing and event intake never wait on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
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
    choice,
)
from miles.controller.events import ControllerEvents
from miles.controller.fleet import DEFAULT_SERVER_CLS, Fleet, health_from, normalize_specs
from miles.controller.gate import CheckpointRejected, refused_plain_message, vet_checkpoint
from miles.controller.health import FleetHealth, ResumedFrom, fleet_health, lock_health
from miles.controller.plans import Barrier, FromCheckpoint, FromWindow, Plan, Rolling
from miles.controller.published import PublishedChecksums
from miles.controller.results import ServerOutcome, UpdateMode, UpdateResult, UpdateStatus, UpdateWindow
from miles.controller.resume import resume_fleet
from miles.controller.router import Router
from miles.controller.transaction import WeightUpdate
from miles.controller.windows import (
    Abort,
    Commit,
    OpenWindow,
    WindowSlot,
    check_window_checkpoint,
    close_window,
    describe,
    refusal,
    set_window,
    window_target,
)
from miles.controller.write_outs import WriteOuts
from miles.errors import LockTimeoutError, MilesError
from miles.protocol.auth import window_credential
from miles.rollout.mixed import ModelRollout
from miles.utils.audit_utils.event_logger.logger import EventLogger
from miles.utils.context_lock import ContextLock, enforce_lock_discipline, lock_exempt, requires_lock, with_lock
from miles.utils.weight_version import version_number

logger = logging.getLogger("miles.controller")


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
        self.settings = settings.model_copy(update=overrides) if settings else ControllerSettings(**overrides)
        self.event_logger = event_logger or EventLogger(
            self.settings.events_dir, component="controller", fsync=self.settings.events_fsync
        )
        self.published = PublishedChecksums()
        self._subscription = self.event_logger.subscribe(self.published.observe)
        self.router: Router | None = None
        self._events = ControllerEvents(self.event_logger, fleet_changed=self._fleet_changed)
        self._lock = ContextLock("InferenceController", on_transition=self._events.lock_transition)
        # One secret per controller: its engines refuse weight-changing and pause calls without
        # it, so only this controller (and the windows it opens) can change their weights (the HTTP
        # adapter presents it when it proxies to them).
        self.engine_secret = secrets.token_urlsafe(32)
        self.fleet = Fleet(
            normalize_specs(rollout_server_cls, model_checkpoint, num_servers),
            settings=self.settings,
            exclusive=_fenced_section(self._lock),
            observer=self._events,
            engine_secret=self.engine_secret,
        )
        self._windows = WindowSlot()
        self._write_outs = WriteOuts(lambda: self.settings.write_out_interval_s)
        self.last_update: UpdateResult | None = None
        self._update_listeners: list[Callable[[UpdateResult], None]] = []
        self._started_at = time.time()
        self._closed = False
        # Per model, where it resumed from its event log (``_resume``), for /health.
        self._resumed: dict[str, ResumedFrom] = {}

    # --- settings ------------------------------------------------------------------------------

    @property
    @lock_exempt
    def lock_timeout_s(self) -> float:
        return self.settings.lock_timeout_s

    @with_lock
    async def reconfigure(self, patch: dict[str, Any]) -> ControllerSettings:
        """Apply runtime-changeable settings; raises InvalidRequestError naming refused fields."""
        before = self.settings
        # Validation resolves the checkpoint roots on the filesystem: off the loop.
        self.settings = await asyncio.to_thread(self.settings.changed, patch)
        self.fleet.set_health(health_from(self.settings))
        self._events.settings_changed(before, self.settings)
        return self.settings

    # --- lifecycle -----------------------------------------------------------------------------

    @with_lock
    async def start(self) -> None:
        """Launch every server and wait until each serves verified weights."""
        self.router = Router(
            servers=self.fleet.snapshots,
            policy=lambda: self.settings.routing_policy,
            max_waiting=lambda: self.settings.max_waiting_requests,
        )
        await self._resume()
        await self.fleet.start()

    @requires_lock
    async def _resume(self) -> None:
        if (directory := self.settings.events_dir) is None:
            return
        roots = self.settings.allowed_checkpoint_roots
        # Under roots, a copy an engine wrote out lies in the state directory (kept across
        # restarts when MILES_STATE_DIR names one), which engines may read too.
        readable = (*roots, self.fleet.state_dir) if roots else ()
        # Reads (and for the copies, hashes) files: off the loop.
        resumption = await asyncio.to_thread(resume_fleet, directory, self.fleet.all(), readable_roots=readable)
        for event in resumption.published:
            self.published.observe(event)
        for name, resumed in resumption.models.items():
            rollout = self.fleet.rollout(name)
            rollout.committed_high = resumed.committed_high
            rollout.resume_from = resumed.weights()
            self._resumed[name] = resumed
            logger.info(
                "%s resumes from its event log: version %s at %s%s",
                name,
                resumed.weight_version or "(start checkpoint)",
                resumed.checkpoint or rollout.start_checkpoint,
                f" ({resumed.note})" if resumed.note else "",
            )

    @lock_exempt
    async def close(self) -> None:
        """Abort any open training window, stop every server; safe to call twice."""
        if self._closed:
            return
        self.stop_routing()
        await self._write_outs.cancel()
        await self._windows.shut(reason="the controller is shutting down")
        await self._shutdown()
        self._subscription.close()
        self.event_logger.close()
        self._closed = True

    @lock_exempt
    def stop_routing(self) -> None:
        """End waiting requests and refuse new ones with a 503, before the HTTP server drains."""
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

        Waits at most ``lock_timeout_s`` for the lock (``timed_out``, nothing changed) and bounds
        the transaction by ``timeout``, after which every server is put back on verified weights.
        Never raises for a failed update; raises InvalidRequestError / NotFoundError for arguments
        that name nothing valid."""
        started = time.monotonic()
        rollout = self.fleet.rollout(model_name)
        if timeout is not None:
            timeout = check_seconds(timeout, name="timeout", low=UPDATE_TIMEOUT_MIN_S, high=UPDATE_TIMEOUT_MAX_S)
        mode = UpdateMode(choice(UpdateStrategy, strategy or self.settings.default_strategy, "strategy").value)
        pause = choice(UpdatePauseMode, pause_mode or self.settings.default_pause_mode, "pause_mode")
        try:
            return await self._update_from_disk(
                rollout,
                Path(new_checkpoint),
                mode=mode,
                pause_mode=pause,
                timeout=timeout or self.settings.update_timeout_s,
                weight_version=weight_version,
                started=started,
            )
        except LockTimeoutError as exc:
            # Never got the lock: nothing was touched, and nothing decided.
            result = UpdateResult(
                update_id=uuid.uuid4().hex[:12],
                status=UpdateStatus.TIMED_OUT,
                model_name=rollout.model_name,
                strategy=mode,
                pause_mode=pause,
                # Each server as it is: its id, state, version and checksum.
                servers=tuple(ServerOutcome.model_validate(s, from_attributes=True) for s in rollout.snapshot()),
                message=f"the lock was not granted within {self.lock_timeout_s}s: {exc}",
                duration_s=time.monotonic() - started,
            )
            return self._remember(result)

    @with_lock
    async def _update_from_disk(
        self,
        rollout: ModelRollout,
        checkpoint: Path,
        *,
        mode: UpdateMode,
        pause_mode: UpdatePauseMode,
        timeout: float,
        weight_version: str | None,
        started: float,
    ) -> UpdateResult:
        update = self._new_update(rollout, mode=mode, pause_mode=pause_mode, started=started)
        update.phases["lock_wait"] = time.monotonic() - started
        try:
            with update.timed("validate"):
                await update.heal()
                # Loading changes the live weights in place: the ones served now must be on disk first.
                await self._write_outs.flush(update.model_name)
                target = await asyncio.to_thread(
                    vet_checkpoint,
                    checkpoint,
                    model_name=update.model_name,
                    settings=self.settings,
                    published=self.published,
                    weight_version=weight_version,
                    serving_version=update.version_to_beat,
                    start_checkpoint=rollout.start_checkpoint,
                )
        except CheckpointRejected as rejected:
            return self._finish(update.result(UpdateStatus.REJECTED, message=rejected.message))
        update.set_target(target)
        self._events.started(update)
        message = ""
        with update.timed("transaction"):
            try:
                async with asyncio.timeout(timeout):
                    schedule = Rolling(self.settings.rolling_batch_size) if mode is UpdateMode.ROLLING else Barrier()
                    status = await update.run(Plan(source=FromCheckpoint(), schedule=schedule))
            except TimeoutError:
                status = UpdateStatus.ROLLED_BACK
                message = f"the update did not finish within {timeout}s; servers were put back on verified weights"
                await update.heal()
            except BaseException:
                # A failure nobody planned for (a bug in a server type, a cancelled caller): put every
                # server back on verified weights before the lock is released, then report it.
                await update.heal()
                raise
        actual = update.checkpoint_checksums()
        if status is UpdateStatus.REJECTED and target.num_bytes is None and len(actual) == 1:
            # A plain directory's (no manifest gives its size) weights were hashed by the servers;
            # say which published step, if any, they belong to.
            message = refused_plain_message(
                target, model_name=update.model_name, published=self.published, actual=actual.pop()
            )
        return self._finish(update.result(status, message=message))

    # --- training-driven windows ---------------------------------------------------------------

    @lock_exempt
    async def start_update_weights(
        self,
        model_name: str | None = None,
        *,
        ttl_s: float | None = None,
        pause_mode: UpdatePauseMode | str | None = None,
        staged: bool = False,
    ) -> UpdateWindow:
        """Open a window: hold requests, pause every server, and keep the lock for training.

        Training pushes weights to ``window.servers``, then ends or aborts the window; without
        either within ``ttl_s`` it is rolled back. ``staged``: the servers keep serving while
        training pushes into their engines' stages. Raises for invalid arguments before anything
        is touched, and re-raises (after putting every server back) a failure while opening."""
        rollout = self.fleet.rollout(model_name)
        # A server type that cannot stage (vLLM) gets a window with its servers out of routing;
        # the window's ``staged`` says which it is.
        staged = bool(staged) and rollout.stages_pushes
        ttl = _lease_ttl(ttl_s, self.settings.lease_ttl_s)
        pause = choice(UpdatePauseMode, pause_mode or self.settings.default_pause_mode, "pause_mode")
        return await self._windows.open(
            lambda opened: self._hold_window(rollout, ttl_s=ttl, pause_mode=pause, staged=staged, opened=opened)
        )

    @with_lock
    async def _hold_window(
        self,
        rollout: ModelRollout,
        *,
        ttl_s: float,
        pause_mode: UpdatePauseMode,
        staged: bool,
        opened: asyncio.Future[UpdateWindow],
    ) -> None:
        """The task that holds a window's lock: open it, wait for its ending, carry that out."""
        update = self._new_update(rollout, mode=UpdateMode.WINDOW, pause_mode=pause_mode)
        try:
            await update.heal()
            self._events.started(update)
            if not staged:
                # Training will change the live weights in place: the ones served now must be on
                # disk first, for a rollback.
                await self._write_outs.flush(update.model_name)
                update.router.close_gate(update.model_name)
                await update.take_out(update.server_ids)
            # The engines accept the window's credential from now until it is closed again (a
            # staged window's only to stage: its servers serve meanwhile).
            await set_window(update, open_=True, staged=staged)
        except BaseException as exc:  # noqa: BLE001  # handed to start_update_weights through ``opened``
            # Whatever failed once the fleet was touched, put it back as it was: servers on their
            # verified weights and serving, the gate open.
            await close_window(update, reason="the window could not open")
            self._finish(update.result(UpdateStatus.ROLLED_BACK, message=f"the window could not open: {exc}"))
            opened.set_exception(exc)
            return
        credential = window_credential(self.engine_secret, update.token)
        window = OpenWindow(public=describe(update, ttl_s=ttl_s, staged=staged, credential=credential))
        self._windows.current = window
        opened.set_result(window.public)
        with update.timed("transfer"):  # training pushing its weights, until it ends the window
            ending, answer = await window.wait()
        try:
            result = await self._end_window(update, ending, staged=staged)
        except BaseException as exc:
            self._windows.current = None
            await close_window(update, reason=f"ending the window failed: {exc}")
            self._finish(update.result(UpdateStatus.ROLLED_BACK, message=f"ending the window failed: {exc}"))
            if answer is not None and not answer.done():
                answer.set_exception(exc)
            raise
        self._windows.current = None
        self._finish(result)
        if answer is not None and not answer.done():
            answer.set_result(result)

    @requires_lock
    async def _end_window(self, update: WeightUpdate, ending: Commit | Abort, *, staged: bool) -> UpdateResult:
        if isinstance(ending, Abort):
            await close_window(update, reason=ending.reason)
            return update.result(UpdateStatus.ABORTED, message=ending.reason)
        # Nothing may push once the weights are being confirmed: close the window on the engines
        # (a staged window's engines close it as they activate, in the same call).
        if not staged:
            await set_window(update, open_=False)
        published = self.published.expected(update.model_name, ending.step)
        if refused := refusal(update, ending, published_checksum=published.checksum if published else None):
            await close_window(update, reason=refused)
            return update.result(UpdateStatus.ROLLED_BACK, message=refused)
        update.set_target(await window_target(update, ending, roots=self.settings.allowed_checkpoint_roots))
        source = FromWindow(staged=staged, close=lambda ids: set_window(update, open_=False, server_ids=ids))
        status = await update.run(Plan(source=source, schedule=Barrier()))
        if status is not UpdateStatus.COMMITTED:
            return update.result(status)
        if published is None:
            self._events.published(update.model_name, ending.checksum, ending.step, update.weight_version)
        if update.checkpoint is None:
            self._write_outs.start(update.rollout, checksum=ending.checksum, step=ending.step)
        return update.result(UpdateStatus.COMMITTED)

    @lock_exempt
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

        ``checkpoint``, when its manifest holds ``checksum``, is where restarts reload the weights
        from; otherwise one engine writes them to disk after the commit. Raises
        InvalidRequestError for a bad argument (the window stays open) and ConflictError for a
        token that names no open window."""
        # Commit checks its arguments, resolving the checkpoint's path on the filesystem: off the loop.
        ending = await asyncio.to_thread(
            Commit, checksum=checksum, step=step, checkpoint=checkpoint, weight_version=weight_version
        )
        await asyncio.to_thread(check_window_checkpoint, ending.checkpoint, self.settings.allowed_checkpoint_roots)
        return await asyncio.shield(self._windows.find(window).end(ending))

    @lock_exempt
    async def renew_update_weights(self, window: UpdateWindow | int, *, ttl_s: float | None = None) -> UpdateWindow:
        """Extend the window's lease to ``ttl_s`` (default: the window's own) from now; raises
        InvalidRequestError for a bad ``ttl_s``, ConflictError for no open window."""
        open_window = self._windows.find(window)
        return open_window.renew(_lease_ttl(ttl_s, open_window.public.ttl_s))

    @lock_exempt
    async def abort_update_weights(
        self, window: UpdateWindow | int, *, reason: str = "aborted by training"
    ) -> UpdateResult:
        """Put every server of the window back on its last verified weights and resume serving."""
        return await asyncio.shield(self._windows.find(window).end(Abort(reason=reason)))

    # --- updates and recovery ------------------------------------------------------------------

    @requires_lock
    def _new_update(
        self, rollout: ModelRollout, *, mode: UpdateMode, pause_mode: UpdatePauseMode, started: float | None = None
    ) -> WeightUpdate:
        assert self.router is not None, "the controller was not started"
        return WeightUpdate(
            token=self._lock.current().token,
            rollout=rollout,
            router=self.router,
            events=self._events,
            mode=mode,
            pause_mode=pause_mode,
            started=started,
        )

    # --- health and observation ----------------------------------------------------------------

    @lock_exempt
    def health(self) -> FleetHealth:
        """The aggregated health report; never waits on the lock."""
        router, window = self.router, self._windows.current
        return fleet_health(
            {name: self.fleet.snapshots(name) for name in self.fleet.model_names},
            accepting=router.gate_open if router else lambda _: True,
            in_flight=router.outstanding if router else lambda _: 0,
            resumed=self._resumed,
            lock=lock_health(self._lock.statistics(), window_expires_at=window.public.expires_at if window else None),
            last_update=self.last_update,
            uptime_s=round(time.time() - self._started_at, 3),
        )

    @lock_exempt
    def on_update(self, listener: Callable[[UpdateResult], None]) -> None:
        """Call ``listener`` with every update's result (metrics, progress displays)."""
        self._update_listeners.append(listener)

    @lock_exempt
    def suspect(self, model_name: str, server_id: str) -> None:
        """A request could not reach ``server_id``: have its rollout probe it now."""
        try:
            self.fleet.rollout(model_name).suspect(server_id)
        except MilesError:
            logger.warning("asked to probe %s of %s, which is not served", server_id, model_name)

    @lock_exempt
    def _fleet_changed(self) -> None:
        if self.router is not None:
            self.router.fleet_changed()

    @lock_exempt
    def _finish(self, result: UpdateResult) -> UpdateResult:
        if result.ok and (number := version_number(result.weight_version)) is not None:
            rollout = self.fleet.rollout(result.model_name)
            # Compared with None, not by truth: 0 is a version too.
            rollout.committed_high = max(n for n in (number, rollout.committed_high) if n is not None)
        self._events.finished(result)
        return self._remember(result)

    @lock_exempt
    def _remember(self, result: UpdateResult) -> UpdateResult:
        self.last_update = result
        log = logger.info if result.ok else logger.error
        log("update %s %s: %s", result.update_id, result.status.value, result.message)
        for listener in self._update_listeners:
            listener(result)
        return result


def _lease_ttl(ttl_s: float | None, default: float) -> float:
    return check_seconds(default if ttl_s is None else ttl_s, name="ttl_s", low=LEASE_TTL_MIN_S, high=LEASE_TTL_MAX_S)


def _fenced_section(lock: ContextLock) -> Callable[[str], contextlib.AbstractAsyncContextManager[int | None]]:
    """The controller's lock as the section the rollouts' restarts run in, yielding its token."""

    @contextlib.asynccontextmanager
    async def section(holder: str) -> AsyncIterator[int | None]:
        async with lock.hold(holder=holder) as grant:
            yield grant.token

    return section

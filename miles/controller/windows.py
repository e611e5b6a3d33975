"""Training windows: an update kept open while training pushes the weights itself.

A window is a ``WeightUpdate`` whose lock a task of the controller holds (the lock itself knows
nothing of windows). Training reaches the window's servers with the window's credential and ends
it with ``end_update_weights`` (verify and commit) or ``abort_update_weights``; those calls hand
an ``Ending`` to the task holding the window, which carries it out under the lock and answers.
If no ending arrives within the window's TTL, the task rolls the window back itself.

Weights a window pushed exist on no disk: after such a commit one engine writes them out in the
background (``WriteOuts``, at most one write-out per ``write_out_interval_s``), so that any
server, even the only one, can be restarted on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from miles.controller.gate import restart_point_problem, roots_problem
from miles.controller.results import ChecksumSource, UpdateResult, UpdateStatus, UpdateWindow
from miles.controller.transaction import Target, WeightUpdate
from miles.errors import CheckpointError, ConflictError, InvalidRequestError, MilesError, UnavailableError
from miles.rollout.engine_client import EngineCallError
from miles.rollout.rollout import Rollout
from miles.rollout.state import ServerState
from miles.utils.weight_version import is_newer
from miles.weights.checkpoint import read_manifest
from miles.weights.paths import checked_path

logger = logging.getLogger("miles.controller")


@dataclass(frozen=True)
class Commit:
    """Training ends its window: these servers now hold weights hashing to ``checksum``."""

    checksum: str
    step: int
    checkpoint: str | Path | None = None
    weight_version: str | None = None

    def __post_init__(self) -> None:
        # Checked before the window is touched: a bad argument is an error, not an ending.
        if not isinstance(self.checksum, str) or not self.checksum:
            raise InvalidRequestError(f"checksum must be a non-empty string, got {self.checksum!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or not 0 <= self.step < 2**63:
            raise InvalidRequestError(f"step must be an integer >= 0, got {self.step!r}")
        if self.weight_version is not None and (not isinstance(self.weight_version, str) or not self.weight_version):
            raise InvalidRequestError(f"weight_version must be a non-empty string, got {self.weight_version!r}")
        if self.checkpoint is not None:
            checked_path(str(self.checkpoint), field="checkpoint")


@dataclass(frozen=True)
class Abort:
    """Training gives its window up (or the controller does, shutting down)."""

    reason: str


@dataclass(frozen=True)
class Refused:
    """Why a window's commit admitted nothing: ``reason`` for the rollback, ``message`` for the
    result (empty: the result lists each server's failure)."""

    reason: str
    message: str


@dataclass(eq=False)
class OpenWindow:
    """A window held open: what training was told, and the way training ends it.

    Its lease runs ``public.ttl_s`` from when it opened and from each ``renew``: training renews it
    while it works, so a trainer that dies costs one short lease, not the longest push it could
    ever make."""

    update: WeightUpdate
    public: UpdateWindow
    _endings: asyncio.Queue[tuple[Commit | Abort, asyncio.Future[UpdateResult]]] = field(default_factory=asyncio.Queue)
    _closing: str | None = None  # why it no longer takes an ending
    # When the lease runs out (time.monotonic()); set when the window opens.
    _deadline: float = math.inf

    def end(self, ending: Commit | Abort) -> asyncio.Future[UpdateResult]:
        """Hand ``ending`` to the task holding the window; its result comes in the future.

        Raises ConflictError when the window is already ending or expired.
        """
        if self._closing is not None:
            raise ConflictError(
                f"window {self.public.window_id} is {self._closing}; start a new window", token=self.public.token
            )
        self._closing = "ending"
        result: asyncio.Future[UpdateResult] = asyncio.get_running_loop().create_future()
        self._endings.put_nowait((ending, result))
        return result

    def renew(self, ttl_s: float) -> UpdateWindow:
        """Extend the lease to ``ttl_s`` from now; the window as training now sees it.

        Raises ConflictError when the window is already ending or expired.
        """
        if self._closing is not None:
            raise ConflictError(
                f"window {self.public.window_id} is {self._closing}; start a new window", token=self.public.token
            )
        self._deadline = time.monotonic() + ttl_s
        self.public = self.public.model_copy(
            update={"ttl_s": ttl_s, "expires_at": datetime.now(UTC) + timedelta(seconds=ttl_s)}
        )
        return self.public

    async def wait(self) -> tuple[Commit | Abort, asyncio.Future[UpdateResult] | None]:
        """The ending training sends; once the lease runs out without one (renewals extend it),
        an Abort of its own."""
        self._deadline = time.monotonic() + self.public.ttl_s
        while True:
            try:
                return await asyncio.wait_for(self._endings.get(), timeout=max(0.0, self._deadline - time.monotonic()))
            except TimeoutError:
                if not self._endings.empty():  # it arrived as the timer fired: honour it
                    return self._endings.get_nowait()
                if time.monotonic() < self._deadline:  # renewed meanwhile
                    continue
                self._closing = "expired"
                return Abort(reason="the window's lease expired before training ended or renewed it"), None


def refusal(update: WeightUpdate, ending: Commit, *, published_checksum: str | None) -> Refused | None:
    """Why ``ending`` may not commit at all (checked before any server is touched), or None.

    ``published_checksum`` is what training published for that step, if it did.
    """
    version = ending.weight_version or str(ending.step)
    if is_newer(version, update.version_to_beat) is False:
        reason = (
            f"weight version {version} is not newer than the newest version the fleet has served "
            f"({update.version_to_beat}); serving versions never go back"
        )
        return Refused(reason=reason, message=reason)
    if published_checksum is not None and published_checksum != ending.checksum:
        reason = (
            f"the window's checksum {ending.checksum} differs from the one published for step {ending.step} "
            f"({published_checksum}); nothing was admitted"
        )
        return Refused(reason=reason, message=reason)
    return None


async def aim(update: WeightUpdate, ending: Commit, *, roots: tuple[Path, ...]) -> None:
    """Fix the window's target: the weights training says its servers now hold (or stage)."""
    # Reads the checkpoint's manifest: off the loop.
    holding = await asyncio.to_thread(
        _checkpoint_holding, ending.checkpoint, ending.checksum, update.rollout.spec.checkpoint, roots
    )
    update.aim(
        Target(
            weight_version=ending.weight_version or str(ending.step),
            step=ending.step,
            checksum=ending.checksum,
            source=ChecksumSource.TRAINING,
            checkpoint=holding,
        )
    )


async def commit(update: WeightUpdate) -> UpdateStatus | Refused:
    """Verify what every server of ``update`` holds against the target's checksum, and admit.

    Returns COMMITTED, or why nothing was admitted (the caller rolls the window back).
    """
    ids = update.server_ids
    await update.confirm(ids)
    if update.failed(ids) or not update.confirmed(ids):
        why = ", ".join(update.failed(ids)) or "any server: every server's engine died"
        return Refused(reason=f"checksum not confirmed on {why}", message="")
    await update.admit(update.confirmed(ids))
    # Servers whose engines died during the window come back on the committed weights (copied
    # from a peer that holds them when they are on no disk).
    await update.restart_crashed(update.crashed(ids))
    return UpdateStatus.COMMITTED


async def set_window(update: WeightUpdate, *, open_: bool, staged: bool = False) -> None:
    """Tell every engine of ``update`` whether its window's credential may push (``/fence``);
    a ``staged`` window's credential may only stage (its servers serve meanwhile).

    Closing cannot fail the caller: an engine that cannot be told (it died) is restarted before it
    serves again, and a new process knows no window. Opening skips servers whose engines died
    during the update (and records those that die now): the window is their peers'.
    """

    async def one(server_id: str) -> None:
        try:
            await update.rollout.fence(server_id, update.token, window_open=open_, staged=staged)
        except MilesError as exc:
            if not open_:
                logger.warning("could not close window %d on %s: %s", update.token, server_id, exc)
            elif not await update.record_failure(server_id, "opening the window", exc):
                raise

    await asyncio.gather(*(one(sid) for sid in update.live(update.server_ids)))
    if open_ and not update.live(update.server_ids):
        raise UnavailableError(
            f"every server of model {update.model_name!r} died while the window opened; open one once they are back",
            model=update.model_name,
        )


class WriteOuts:
    """Background copies, to disk, of weights windows pushed (see the module docstring).

    Per model, one write-out runs at a time and they start at least ``interval_s()`` apart; each
    writes the newest weights committed by then. Training that pushes every step would otherwise
    have an engine write every step's weights to disk while it serves: a restart between two
    write-outs copies the newer weights from a peer that holds them. An update about to change
    live weights in place (a disk update, an unstaged window) first ``flush``es: if it fails, every
    server must be able to go back to the weights they serve now, even if it changed them all.
    """

    def __init__(self, interval_s: Callable[[], float]) -> None:
        self._interval_s = interval_s
        # Per model: the newest weights to write (and the attempt it would be), and when the next
        # write-out may start.
        self._newest: dict[str, tuple[Rollout, str, int, int]] = {}
        self._not_before: dict[str, float] = {}
        self._writers: dict[str, asyncio.Task[None]] = {}
        self._hurry: dict[str, asyncio.Event] = {}

    def start(self, rollout: Rollout, *, checksum: str, step: int) -> None:
        """Write these weights out, or newer ones committed before the next write-out starts."""
        model = rollout.model_name
        self._newest[model] = (rollout, checksum, step, 1)
        writer = self._writers.get(model)
        if writer is None or writer.done():
            self._writers[model] = asyncio.get_running_loop().create_task(self._write(model), name=f"write-out-{model}")

    async def _write(self, model: str) -> None:
        while model in self._newest:
            wait = self._not_before.get(model, -math.inf) - time.monotonic()
            if wait > 0:
                hurry = self._hurry.setdefault(model, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(hurry.wait(), timeout=wait)
                hurry.clear()
            rollout, checksum, step, attempt = self._newest.pop(model)
            self._not_before[model] = time.monotonic() + self._interval_s()
            last = attempt >= _WRITE_OUT_ATTEMPTS
            if await _write_out(rollout, checksum=checksum, step=step, warn=last) or last:
                continue
            if model not in self._newest:
                # Its servers were in the next update's commit, or an engine could not write:
                # again shortly, unless newer weights come first.
                self._newest[model] = (rollout, checksum, step, attempt + 1)
                self._not_before[model] = time.monotonic() + _WRITE_OUT_RETRY_S

    async def flush(self, model: str) -> None:
        """Write out now the newest weights still waiting for their turn, and return once no
        write-out of ``model`` is pending or running."""
        writer = self._writers.get(model)
        if writer is None or writer.done():
            return
        self._not_before[model] = -math.inf
        self._hurry.setdefault(model, asyncio.Event()).set()
        try:
            await asyncio.shield(writer)
        except Exception as exc:  # noqa: BLE001  # the update goes on; its rollback may find no copy
            logger.warning("writing out %s's weights before an in-place update failed: %s", model, exc)

    async def cancel(self) -> None:
        writers = list(self._writers.values())
        for task in writers:
            task.cancel()
        await asyncio.gather(*writers, return_exceptions=True)


_WRITE_OUT_ATTEMPTS = 5
_WRITE_OUT_RETRY_S = 0.25


async def _write_out(rollout: Rollout, *, checksum: str, step: int, warn: bool) -> bool:
    """Have one server holding ``checksum`` write it out and record the copy; whether it did."""
    # An update that commits while the engine copies its weights ends the export (409, and the
    # next holder is asked), and the copy is only recorded for servers still verified on the same
    # checksum.
    holders = [
        s.server_id
        for s in rollout.snapshot()
        if s.state is ServerState.SERVING and s.verified is not None and s.verified.checksum == checksum
    ]
    for server_id in holders:
        try:
            exported = await rollout.export(server_id, step=step)
        except EngineCallError as exc:
            level = logging.WARNING if warn else logging.INFO
            logger.log(level, "%s could not write out %s: %s", server_id, checksum, exc)
            continue
        if exported.checksum == checksum:
            recorded = rollout.remember_checkpoint(checksum, exported.path)
            logger.info("pushed weights %s written to %s for %s", checksum, exported.path, ", ".join(recorded))
            return True
    if warn:
        logger.warning("no server could write out the pushed weights %s; restarts will copy them from a peer", checksum)
    return False


def check_window_checkpoint(checkpoint: str | Path | None, roots: tuple[Path, ...]) -> None:
    """Refuse a window's ``checkpoint`` outside the allowed checkpoint roots (InvalidRequestError),
    as a disk update's is refused: it would become its servers' restart point."""
    if checkpoint is None:
        return
    problem = roots_problem(checked_path(str(checkpoint), field="checkpoint"), roots)
    if problem is not None:
        raise InvalidRequestError(
            f"{problem}; or end the window without a checkpoint (an engine then writes the weights out)"
        )


def _checkpoint_holding(
    checkpoint: str | Path | None, checksum: str, start_checkpoint: Path, roots: tuple[Path, ...]
) -> Path | None:
    """``checkpoint`` when its manifest says it holds weights with ``checksum`` and servers could
    restart from it as they run now; else None (an engine then writes the weights out).

    A window's checkpoint is where restarts reload its weights from, so a directory that holds
    other weights (a stale path, a later save over it), that an engine could not start from, or
    that lies (or links) outside the allowed roots, must not be recorded as theirs.
    """
    if checkpoint is None:
        return None
    path = checked_path(str(checkpoint), field="checkpoint")
    outside = roots_problem(path, roots)  # checked when the window was ended; again, as it is read
    if outside is not None:
        logger.warning("window checkpoint %s cannot serve restarts: %s", path, outside)
        return None
    try:
        manifest = read_manifest(path)
        problem = restart_point_problem(path, start_checkpoint)
    except (CheckpointError, OSError) as exc:
        logger.warning("window checkpoint %s cannot serve restarts: %s", path, exc)
        return None
    if manifest.checksum != checksum:
        logger.warning("window checkpoint %s holds %s, not the committed %s", path, manifest.checksum, checksum)
        return None
    if problem is not None:
        logger.warning("window checkpoint %s cannot serve restarts: %s", path, problem)
        return None
    return path

"""Training windows: an update kept open while training pushes the weights itself.

A window is a ``WeightUpdate`` whose lock a task of the controller holds (the lock itself knows
nothing of windows); ending it hands that task a ``Commit`` or an ``Abort``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from miles.controller.gate import not_newer, restart_point_problem
from miles.controller.plans import Target
from miles.controller.results import ChecksumSource, UpdateResult, UpdateWindow, WindowServer
from miles.controller.transaction import WeightUpdate
from miles.errors import CheckpointError, ConflictError, InvalidRequestError, MilesError, UnavailableError
from miles.weights.checkpoint import read_manifest
from miles.weights.paths import checked_path, roots_problem

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


@dataclass(eq=False)
class OpenWindow:
    """A window held open: what training was told, and the way training ends it."""

    public: UpdateWindow
    _endings: asyncio.Queue[tuple[Commit | Abort, asyncio.Future[UpdateResult]]] = field(default_factory=asyncio.Queue)
    _closing: str | None = None  # why it no longer takes an ending
    # When the lease runs out (time.monotonic()); set when the window opens.
    _deadline: float = math.inf

    def end(self, ending: Commit | Abort) -> asyncio.Future[UpdateResult]:
        """Hand ``ending`` to the task holding the window; its result comes in the future.
        Raises ConflictError when the window is already ending or expired."""
        self._refuse_if_closing()
        self._closing = "ending"
        result: asyncio.Future[UpdateResult] = asyncio.get_running_loop().create_future()
        self._endings.put_nowait((ending, result))
        return result

    def renew(self, ttl_s: float) -> UpdateWindow:
        """Extend the lease to ``ttl_s`` from now; the window as training now sees it.
        Raises ConflictError when the window is already ending or expired."""
        self._refuse_if_closing()
        self._deadline = time.monotonic() + ttl_s
        self.public = self.public.model_copy(
            update={"ttl_s": ttl_s, "expires_at": datetime.now(UTC) + timedelta(seconds=ttl_s)}
        )
        return self.public

    def _refuse_if_closing(self) -> None:
        if self._closing is not None:
            raise ConflictError(
                f"window {self.public.window_id} is {self._closing}; start a new window", token=self.public.token
            )

    async def wait(self) -> tuple[Commit | Abort, asyncio.Future[UpdateResult] | None]:
        """The ending training sends, or an Abort of its own once the lease runs out."""
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


class WindowSlot:
    """The controller's one training window: the task holding its lock, and the window once open."""

    def __init__(self) -> None:
        self.current: OpenWindow | None = None
        self._task: asyncio.Task[None] | None = None

    async def open(self, hold: Callable[[asyncio.Future[UpdateWindow]], Coroutine[Any, Any, None]]) -> UpdateWindow:
        """Start ``hold`` (the task that takes the lock, opens the window and sets the future it
        is given) and return the window once open; raises what ended the task first."""
        opened: asyncio.Future[UpdateWindow] = asyncio.get_running_loop().create_future()
        self._task = task = asyncio.create_task(hold(opened))
        racers: set[asyncio.Future[Any]] = {opened, task}
        try:
            await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._abandon(task, opened)
            raise
        if not opened.done():
            task.result()  # the task ended first: this raises what ended it
        return opened.result()

    def _abandon(self, task: asyncio.Task[None], opened: asyncio.Future[UpdateWindow]) -> None:
        """The caller of ``open`` went away: nobody will push to its window or end it, so it must
        not hold the fleet for its lease. Not open yet, its task is cancelled; open, it is aborted."""
        if not opened.done():
            task.cancel()
            return
        if opened.cancelled() or opened.exception() is not None:
            return
        logger.warning("window %d was opened for a caller that went away; aborting it", opened.result().token)
        with contextlib.suppress(ConflictError):  # already ending, or ended
            aborted = self.find(opened.result()).end(Abort(reason="its caller went away"))
            aborted.add_done_callback(lambda f: f.cancelled() or f.exception())

    def find(self, window: UpdateWindow | int) -> OpenWindow:
        """The open window ``window`` (or its token) names; ConflictError when none does."""
        token = window.token if isinstance(window, UpdateWindow) else window
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidRequestError(f"a window is named by its integer token, got {token!r}")
        current = self.current
        if current is None or current.public.token != token:
            raise ConflictError(
                "no open window has this token: it ended, its lease expired, or it was never opened", token=token
            )
        return current

    async def shut(self, *, reason: str) -> None:
        """Abort the open window (or cancel the task still opening one) and wait for it to end."""
        window, task = self.current, self._task
        if window is not None:
            with contextlib.suppress(ConflictError):  # already ending: the task finishes it
                window.end(Abort(reason=reason))
        elif task is not None:
            task.cancel()  # still waiting for the lock, or opening: it puts everything back
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)


def describe(update: WeightUpdate, *, ttl_s: float, staged: bool, credential: str) -> UpdateWindow:
    """The window as training sees it: where to push, with which credential, until when."""
    live = update.live(update.server_ids)
    return UpdateWindow(
        **{name: getattr(update, name) for name in ("update_id", "model_name", "token", "pause_mode")},
        window_id=uuid.uuid4().hex[:12],
        expires_at=datetime.now(UTC) + timedelta(seconds=ttl_s),
        ttl_s=ttl_s,
        # Servers whose engines died while the window opened are not pushed to: they restart
        # on what the window commits.
        servers=tuple(
            WindowServer(server_id=s.server_id, url=s.url or "", weight_version=s.weight_version, engine=s.engine)
            for s in update.rollout.snapshot()
            if s.server_id in live
        ),
        credential=credential,
        staged=staged,
    )


def refusal(update: WeightUpdate, ending: Commit, *, published_checksum: str | None) -> str | None:
    """Why ``ending`` may not commit at all (checked before any server is touched), or None."""
    if problem := not_newer(ending.weight_version or str(ending.step), update.version_to_beat):
        return problem
    if published_checksum is not None and published_checksum != ending.checksum:
        return (
            f"the window's checksum {ending.checksum} differs from the one published for step {ending.step} "
            f"({published_checksum}); nothing was admitted"
        )
    return None


async def window_target(update: WeightUpdate, ending: Commit, *, roots: tuple[Path, ...]) -> Target:
    """The window's target: the weights training says its servers now hold (or stage)."""
    # Reads the checkpoint's manifest: off the loop.
    holding = await asyncio.to_thread(
        _checkpoint_holding, ending.checkpoint, ending.checksum, update.rollout.start_checkpoint, roots
    )
    return Target(
        weight_version=ending.weight_version or str(ending.step),
        step=ending.step,
        checksum=ending.checksum,
        source=ChecksumSource.TRAINING,
        checkpoint=holding,
    )


async def set_window(
    update: WeightUpdate, *, open_: bool, staged: bool = False, server_ids: list[str] | None = None
) -> None:
    """Tell every engine of ``update`` (or of ``server_ids``) whether its window's credential may
    push; a ``staged`` window's credential may only stage (its servers serve meanwhile).

    Closing cannot fail: an engine that cannot be told (it died) is restarted before it serves
    again, and a new process knows no window. Opening skips servers whose engines died."""

    async def one(server_id: str) -> None:
        try:
            await update.rollout.fence(server_id, update.token, window_open=open_, staged=staged)
        except MilesError as exc:
            if not open_:
                logger.warning("could not close window %d on %s: %s", update.token, server_id, exc)
            elif not await update.record_failure(server_id, "opening the window", exc):
                raise

    await asyncio.gather(*(one(sid) for sid in update.live(server_ids or update.server_ids)))
    if open_ and not update.live(update.server_ids):
        raise UnavailableError(
            f"every server of model {update.model_name!r} died while the window opened; open one once they are back",
            model=update.model_name,
        )


async def close_window(update: WeightUpdate, *, reason: str) -> None:
    """Refuse the window's credential on its engines, restore its servers, let requests through."""
    try:
        await set_window(update, open_=False)
        await update.roll_back(update.server_ids, reason=reason)
    finally:
        update.router.open_gate(update.model_name)


def check_window_checkpoint(checkpoint: str | Path | None, roots: tuple[Path, ...]) -> None:
    """Refuse (InvalidRequestError) a window's ``checkpoint`` outside the allowed checkpoint roots,
    as a disk update's is refused: it would become its servers' restart point."""
    if checkpoint is not None and (problem := roots_problem(checked_path(str(checkpoint), field="checkpoint"), roots)):
        raise InvalidRequestError(
            f"{problem}; or end the window without a checkpoint (an engine then writes the weights out)"
        )


def _checkpoint_holding(
    checkpoint: str | Path | None, checksum: str, start_checkpoint: Path, roots: tuple[Path, ...]
) -> Path | None:
    """``checkpoint`` if restarts can reload the window's weights from it, else None."""
    if checkpoint is None:
        return None
    path = checked_path(str(checkpoint), field="checkpoint")
    # The roots were checked when the window was ended; again, as it is read.
    problem = roots_problem(path, roots)
    if problem is None:
        try:
            manifest = read_manifest(path)
            problem = restart_point_problem(path, start_checkpoint)
        except (CheckpointError, OSError) as exc:
            problem = str(exc)
        else:
            if manifest.checksum != checksum:
                problem = f"it holds {manifest.checksum}, not the committed {checksum}"
    if problem is not None:
        logger.warning("window checkpoint %s cannot serve restarts: %s", path, problem)
        return None
    return path

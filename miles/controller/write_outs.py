"""Write-outs: background copies, to disk, of the weights training windows pushed, so that any
server, even the only one, can be restarted on them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from miles.rollout.copies import remove_stale_copies
from miles.rollout.engine_client import EngineCallError
from miles.rollout.mixed import ModelRollout
from miles.rollout.state import ServerState

logger = logging.getLogger("miles.controller")


class WriteOuts:
    """Per model, one write-out at a time, at least ``interval_s()`` apart, of the newest weights
    committed by then; an update about to change live weights in place ``flush``es first."""

    def __init__(self, interval_s: Callable[[], float]) -> None:
        self._interval_s = interval_s
        # Per model: the newest weights to write (and the attempt it would be), and when the next
        # write-out may start.
        self._newest: dict[str, tuple[ModelRollout, str, int, int]] = {}
        self._not_before: dict[str, float] = {}
        self._started: dict[str, float] = {}
        self._writers: dict[str, asyncio.Task[None]] = {}
        self._hurry: dict[str, asyncio.Event] = {}

    def start(self, rollout: ModelRollout, *, checksum: str, step: int) -> None:
        """Write these weights out, or newer ones committed before the next write-out starts."""
        model = rollout.model_name
        self._newest[model] = (rollout, checksum, step, 1)
        writer = self._writers.get(model)
        if writer is None or writer.done():
            self._writers[model] = asyncio.get_running_loop().create_task(self._write(model), name=f"write-out-{model}")

    async def _write(self, model: str) -> None:
        while model in self._newest:
            while (wait := self._wait_s(model)) > 0:
                hurry = self._hurry.setdefault(model, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    # In short waits: an interval lowered meanwhile (PATCH /config) holds at once.
                    await asyncio.wait_for(hurry.wait(), timeout=min(wait, _RECHECK_S))
                hurry.clear()
            rollout, checksum, step, attempt = self._newest.pop(model)
            self._started[model] = time.monotonic()
            self._not_before[model] = self._started[model] + self._interval_s()
            last = attempt >= _WRITE_OUT_ATTEMPTS
            if await _write_out(rollout, checksum=checksum, step=step, warn=last) or last:
                continue
            if model not in self._newest:
                # Its servers were in the next update's commit, or an engine could not write:
                # again shortly, unless newer weights come first.
                self._newest[model] = (rollout, checksum, step, attempt + 1)
                self._not_before[model] = time.monotonic() + _WRITE_OUT_RETRY_S

    def _wait_s(self, model: str) -> float:
        """How long the next write-out of ``model`` must still wait, by the interval as it is now."""
        now_due = self._started.get(model, -math.inf) + self._interval_s()
        return min(self._not_before.get(model, -math.inf), now_due) - time.monotonic()

    async def flush(self, model: str) -> None:
        """Write ``model``'s waiting weights out now; return once none is pending or running."""
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
_RECHECK_S = 0.5


async def _write_out(rollout: ModelRollout, *, checksum: str, step: int, warn: bool) -> bool:
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
            await remove_stale_copies(rollout, newest=exported.path)
            return True
    if warn:
        logger.warning("no server could write out the pushed weights %s; restarts will copy them from a peer", checksum)
    return False

"""Every change of the live weights, one sequence: stage, verify, swap (docs/ENGINE.md, "Staged
activation"); a load and a push differ only in where the bytes come from (``sources.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from miles.engine.scheduler import GenerationState, Pauser, Scheduler
from miles.engine.weights.buffers import StagingPolicy, StagingRefusedError
from miles.engine.weights.live import HeldWeights, LiveWeights, WeightsStatus
from miles.engine.weights.sources import (
    Signature,
    UnexpectedChecksumError,
    check_pushed,
    checkpoint_path,
    open_verified,
    signature,
)
from miles.engine.weights.stage import Stage
from miles.errors import CheckpointError, ConflictError, InvalidRequestError, Refusal
from miles.protocol.sglang import PauseMode
from miles.protocol.sglang_weights import (
    ActivateWeightsRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResponse,
    UpdateWeightVersionRequest,
)
from miles.weights.buckets import BucketTable, Received
from miles.weights.checksum import ModelChecksum

logger = logging.getLogger("miles.engine")

T = TypeVar("T")
PushRequest = UpdateWeightsFromTensorRequest | UpdateWeightsFromDistributedRequest
Write = Callable[[Stage], None]  # writes a change's bytes into a stage


@dataclass(frozen=True)
class Outcome:
    """How one call of a change ended: the fields of its answer that the change decides."""

    success: bool
    message: str
    checksum: str | None = None  # what the stage hashed to, when it was hashed
    num_paused_requests: int = 0  # in flight when generation paused for it


@dataclass(frozen=True)
class Target:
    """What a change's weights must hash to, and what they are once they do."""

    version: str
    checksum: str
    source: str  # where the bytes came from, for the answer
    mismatch: str  # what a stage hashing to something else means
    loaded_from: Path | None = None  # a load's checkpoint directory


@dataclass
class _Change:
    """One change: its stage and how far it came (a push's lives between its calls)."""

    stage: Stage
    verified: Target | None = None  # hashed to it beside the live weights: waits for /activate_weights


class WeightChanges:
    """Every change of the served weights: loads, pushes and their activation, renames."""

    def __init__(
        self, *, weights: LiveWeights, scheduler: Scheduler, staging: StagingPolicy, roots: tuple[Path, ...]
    ) -> None:
        self._weights = weights
        self._scheduler = scheduler
        self._staging = staging
        self._roots = roots
        self._lock = asyncio.Lock()  # one change at a time (the next waits)
        self._change: _Change | None = None  # a push taking buckets, or verified until activated
        # Loads in progress, held here so a load whose caller went away is not collected mid-way.
        self._loads: set[asyncio.Future[UpdateWeightsResponse]] = set()

    async def update_from_disk(self, request: UpdateWeightsFromDiskRequest) -> UpdateWeightsResponse:
        """Load a checkpoint into the live weights. Raises as ``checkpoint_path``; a checkpoint that
        fails validation is answered with ``success=False`` and leaves the old weights serving."""
        path = await asyncio.to_thread(checkpoint_path, request.model_path, roots=self._roots)
        # Once started, a load runs to its end even if its caller goes away: a worker thread still
        # writing a stage (or copying) for a cancelled task would race the next load for its memory.
        load = asyncio.ensure_future(self._load(path, request))
        self._loads.add(load)
        load.add_done_callback(self._loads.discard)
        return await asyncio.shield(load)

    async def _load(self, path: Path, request: UpdateWeightsFromDiskRequest) -> UpdateWeightsResponse:
        async with self._lock:
            self._drop()  # a push that never finished (or was never activated) is superseded
            opening = time.perf_counter()
            change = _Change(await asyncio.to_thread(self._open_stage))
            opened = time.perf_counter() - opening
            try:
                # Beside the live weights, the bytes are verified as they are staged (one read of
                # the checkpoint); in place, they are verified whole before anything is copied.
                checkpoint = await asyncio.to_thread(
                    open_verified,
                    self._weights.model(),
                    path,
                    expected_checksum=request.expected_checksum,
                    weight_version=request.weight_version,
                    defer=not change.stage.in_place,
                )
            except CheckpointError as exc:
                change.stage.discard()
                logger.warning("refused checkpoint %s: %s", path, exc)
                computed = exc.computed if isinstance(exc, UnexpectedChecksumError) else None
                return self._answer(Outcome(False, str(exc)), {}, checkpoint_checksum=computed)
            with checkpoint:
                reader, timings = checkpoint.reader, checkpoint.timings
                if not change.stage.in_place:
                    timings["stage_open"] = opened
                target = Target(
                    version=request.weight_version or reader.manifest.weight_version,
                    checksum=reader.manifest.checksum,
                    source=str(reader.directory),
                    mismatch="the files changed after they were verified",
                    loaded_from=Path(reader.directory),
                )
                try:
                    outcome = await self._run(
                        change,
                        checkpoint.write,
                        target=target,
                        what=f"checkpoint {reader.directory}",
                        timings=timings,
                        mode=_mode(abort=request.abort_all_requests),
                        source="update_weights_from_disk",
                        keep=request.keep_pause,
                        again=checkpoint.write,
                    )
                finally:
                    change.stage.discard()  # a no-op once activated
            return self._answer(outcome, timings, checkpoint_checksum=target.checksum)

    def check_table(self, table: BucketTable) -> None:
        """Raise InvalidRequestError unless the model holds every tensor of ``table`` as it is."""
        check_pushed(table.entries, self._signature)

    async def apply_pushed(self, bucket: Received, request: PushRequest, *, source: str) -> UpdateWeightsResponse:
        """Take one bucket of pushed tensors (its table passed ``check_table`` before it was received)
        into the stage of its change; the last one (``expected_checksum`` given) is verified over the
        whole model before the weights serve. Raises InvalidRequestError for bytes that differ from
        their digest (the push is dropped), ConflictError for ``activate=False`` on an engine that
        cannot stage now."""
        if request.expected_checksum is not None and request.weight_version is None:
            raise InvalidRequestError(
                "the last push of an update (with expected_checksum) must name its weight_version"
            )
        async with self._lock:
            change = self._change
            if change is None or change.verified is not None:
                self._drop()  # staged weights never activated are superseded by this push
                change = self._change = _Change(await asyncio.to_thread(self._open_stage))
            if change.stage.in_place and not request.activate:
                self._drop()
                why = self._staging.report().reason or "staging is off"
                raise ConflictError(
                    f"this engine cannot stage pushed weights now ({why}); push in a window whose servers "
                    "leave routing for the push, or raise --weight-staging-budget",
                    refusal=Refusal.CANNOT_STAGE,
                )
            target = None
            if request.expected_checksum is not None and request.weight_version is not None:
                missing = "a tensor is missing or differs"
                target = Target(request.weight_version, request.expected_checksum, source=source, mismatch=missing)
            timings: dict[str, float] = {}
            try:
                if change.stage.in_place:
                    # Checked before anything is copied: a bad tensor must never reach the live weights.
                    await asyncio.to_thread(bucket.verify)
                outcome = await self._run(
                    change,
                    lambda stage: stage.write_bucket(bucket),
                    target=target,
                    what=f"{len(bucket.entries)} tensors",
                    timings=timings,
                    mode=_mode(abort=request.abort_all_requests),
                    source=source,
                    activate=request.activate,
                )
            except InvalidRequestError:
                self._drop()
                raise
            return self._answer(outcome, timings)

    async def activate_staged(self, request: ActivateWeightsRequest) -> UpdateWeightsResponse:
        """Swap in the pushed weights staged and verified earlier (``activate=False``). Raises
        ConflictError when no staged weights hash to ``expected_checksum``."""
        async with self._lock:
            change = self._change
            staged = change.verified if change is not None else None
            if change is None or staged is None or staged.checksum != request.expected_checksum:
                have = "nothing is staged" if staged is None else f"the staged weights hash to {staged.checksum}"
                raise ConflictError(
                    f"no staged weights hash to {request.expected_checksum} ({have}); push them first with "
                    "activate=false"
                )
            target = replace(staged, version=request.weight_version, source="staged weights")
            timings: dict[str, float] = {}
            mode = request.pause_mode or _mode(abort=request.abort_all_requests)
            async with self._paused(mode, source=target.source, timings=timings) as requests:
                outcome = await self._swap(change, target, timings=timings, again=None)
                outcome = replace(outcome, num_paused_requests=requests)
            return self._answer(outcome, timings)

    async def discard_push(self) -> None:
        """Drop a push that never reached its last bucket (its window ended); staged and verified
        weights stay until activated or superseded (the window's commit activates them)."""
        async with self._lock:
            if self._change is not None and self._change.verified is None:
                self._drop()

    async def rename(self, request: UpdateWeightVersionRequest) -> None:
        """Serve the same weights under ``new_version`` (between two steps: the write side)."""
        if request.abort_all_requests:
            self._scheduler.abort(None, message="aborted by update_weight_version")

        def rename() -> None:
            with self._weights.lock.write():
                self._weights.record(replace(self._weights.held, version=request.new_version))

        await asyncio.to_thread(rename)

    async def _run(
        self,
        change: _Change,
        write: Write,
        *,
        target: Target | None,
        what: str,
        timings: dict[str, float],
        mode: PauseMode,
        source: str,
        keep: bool = False,
        activate: bool = True,
        again: Write | None = None,
    ) -> Outcome:
        """Write ``what`` into the change's stage; for its last write (``target``), hash it, refuse
        a mismatch and swap it in, generation paused in ``mode`` (``keep`` leaves it paused),
        unless it waits for /activate_weights. ``again`` writes every byte once more where the
        source can (a load): a refused swap then copies in place."""
        stage = change.stage
        if not stage.in_place:
            try:
                hashed = target is not None
                checksum = await asyncio.to_thread(self._write, stage, write, hashed=hashed, timings=timings)
            except (OSError, CheckpointError) as exc:
                # Bytes that differ from the manifest (verified as they were staged), or files that
                # became unreadable after they were opened: the live weights never changed.
                self._drop(change)
                logger.warning("refused staged update: %s could not be staged: %s", what, exc)
                return Outcome(False, f"{what} could not be staged: {exc}")
            served = self._weights.held.version
            if target is None or checksum is None:
                return Outcome(True, f"staged {what}; the engine serves {served} meanwhile")
            if checksum.checksum != target.checksum:
                self._drop(change)
                return self._judge(checksum, target, in_place=False)
            if not activate:
                change.verified = target
                message = f"staged and verified; the engine serves {served} until /activate_weights"
                return Outcome(True, message, checksum.checksum)
        async with self._paused(mode, source=source, timings=timings, keep=keep) as requests:
            if not stage.in_place:
                assert target is not None
                outcome = await self._swap(change, target, timings=timings, again=again)
            else:
                # The stage is the live weights: written, hashed and recorded in one section under
                # the write lock, generation paused.
                checksum = await self._locked(
                    lambda: self._write_in_place(stage, write, target=target, timings=timings), timings
                )
                if target is None or checksum is None:
                    waits = "generation stays paused until the last push is verified"
                    return Outcome(True, f"received {what}; {waits}", num_paused_requests=requests)
                self._drop(change)
                outcome = self._judge(checksum, target, in_place=True)
        return replace(outcome, num_paused_requests=requests)

    def _write(self, stage: Stage, write: Write, *, hashed: bool, timings: dict[str, float]) -> ModelChecksum | None:
        started = time.perf_counter()
        write(stage)
        written = time.perf_counter()
        timings[stage.phases[0]] = timings.get(stage.phases[0], 0.0) + written - started
        if not hashed:
            return None
        checksum = stage.checksum()
        timings[stage.phases[1]] = timings.get(stage.phases[1], 0.0) + time.perf_counter() - written
        return checksum

    def _write_in_place(
        self, stage: Stage, write: Write, *, target: Target | None, timings: dict[str, float]
    ) -> ModelChecksum | None:
        """Write into the live weights (write lock held) and, for the last write, hash them and
        record what they hash to whatever the outcome (a drift probe must see an unverified copy
        for what it is); the version moves only with a match."""
        held = self._weights.held
        self._weights.record(replace(held, status=WeightsStatus.UNVERIFIED))
        try:
            checksum = self._write(stage, write, hashed=target is not None, timings=timings)
        except (OSError, CheckpointError) as exc:
            # The files became unreadable after they were verified, part of the way through the
            # copy: what the model holds now is hashed, and cannot match.
            logger.error("copying into the live weights failed part of the way: %s", exc)  # noqa: TRY400
            checksum = stage.checksum() if target is not None else None
        if checksum is None or target is None:
            return None
        if checksum.checksum == target.checksum:
            self._serve(target, checksum)
        else:
            self._weights.record(replace(held, checksum=checksum.checksum, status=WeightsStatus.UNVERIFIED))
        return checksum

    async def _swap(
        self, change: _Change, target: Target, *, timings: dict[str, float], again: Write | None
    ) -> Outcome:
        """Swap a verified buffer stage in, generation paused. A swap the buffers refuse gives
        staging up; ``again`` then copies in place under the same lock."""

        def swap() -> ModelChecksum | None:
            locked = time.perf_counter()
            try:
                checksum = change.stage.activate()
            except StagingRefusedError as exc:
                self._staging.give_up(f"a swap was refused: {exc}")
                if again is None:
                    raise
                live = self._open_stage()
                try:
                    return self._write_in_place(live, again, target=target, timings=timings)
                finally:
                    live.discard()
            self._serve(target, checksum)
            timings["activate"] = time.perf_counter() - locked
            return checksum

        try:
            checksum = await self._locked(swap, timings)
        except StagingRefusedError as exc:
            message = f"the pushed weights could not be swapped in ({exc}); nothing changed, push them again"
            logger.warning("refused staged update: %s", message)
            return Outcome(False, message)
        finally:
            self._drop(change)
        assert checksum is not None
        return self._judge(checksum, target, in_place=True)

    def _serve(self, target: Target, checksum: ModelChecksum) -> None:  # write lock held
        held = HeldWeights(version=target.version, checksum=checksum.checksum, status=WeightsStatus.VERIFIED)
        self._weights.record(held, loaded_from=target.loaded_from)

    def _judge(self, checksum: ModelChecksum, target: Target, *, in_place: bool) -> Outcome:
        if checksum.checksum == target.checksum:
            return Outcome(True, f"Succeeded to update model weights from {target.source}.", checksum.checksum)
        then = "generation stays paused until good weights are loaded"
        if not in_place:
            then = f"nothing changed, the engine serves {self._weights.held.version}"
        message = (
            f"the weights from {target.source} hash to {checksum.checksum}, not the expected {target.checksum} "
            f"({target.mismatch}); {then}"
        )
        logger.warning("an update did not verify: %s", message)
        return Outcome(False, message, checksum.checksum)

    async def _locked(self, job: Callable[[], T], timings: dict[str, float]) -> T:
        """Run ``job`` on the scheduler thread between two steps, under the write lock. (Nothing
        else runs there first: a pre-check and cache warm-up before the lock took 0.4 ms of
        generation's time to save 0.2 ms of the swap's.)"""

        def run() -> T:
            taken = time.perf_counter()
            try:
                with self._weights.lock.write():
                    timings["write_lock_wait"] = time.perf_counter() - taken
                    return job()
            finally:
                # All the time generation waited for this change (the scheduler thread runs it
                # between two steps), the lock's release included.
                timings["generation_held"] = time.perf_counter() - taken

        return await asyncio.to_thread(self._scheduler.call, run)

    @asynccontextmanager
    async def _paused(
        self, mode: PauseMode, *, source: str, timings: dict[str, float], keep: bool = False
    ) -> AsyncIterator[int]:
        """Generation paused for a change in ``mode`` (yields the requests in flight), resumed after
        it only if the weights are verified and not ``keep`` (``keep_pause``). Generation the
        caller had paused stays paused; an aborting mode then only aborts what is queued."""
        message, requests, started = f"aborted by {source}", 0, time.perf_counter()
        if self._scheduler.state is GenerationState.SERVING:
            by = Pauser.CALLER if keep else Pauser.UPDATE
            requests = await asyncio.to_thread(self._scheduler.pause, mode, by=by, message=message)
        elif mode is PauseMode.ABORT:
            self._scheduler.abort(None, message=message)
        timings["pause"] = time.perf_counter() - started
        try:
            yield requests
        finally:
            if not keep and self._weights.held.status is WeightsStatus.VERIFIED:
                self._scheduler.resume(paused_by=Pauser.UPDATE)

    @cached_property
    def _signature(self) -> Signature:
        return signature(self._weights.model())  # the model never changes shape

    def _open_stage(self) -> Stage:
        """The stage of a change beginning now, announced to long reads (``WeightsLock.announce``)
        until it is closed."""
        self._weights.lock.announce()
        try:
            stage = self._staging.open_stage(self._weights.model())
        except BaseException:
            self._weights.lock.withdraw()
            raise
        stage.when_closed(self._weights.lock.withdraw)
        return stage

    def _drop(self, change: _Change | None = None) -> None:
        """Discard the stage of ``change`` (by default the unfinished one) and forget it."""
        change = change or self._change
        if change is not None:
            change.stage.discard()
        if change is self._change:
            self._change = None

    def _answer(
        self, outcome: Outcome, timings: dict[str, float], *, checkpoint_checksum: str | None = None
    ) -> UpdateWeightsResponse:
        return UpdateWeightsResponse(
            **asdict(outcome),
            weight_version=self._weights.held.version,
            checkpoint_checksum=checkpoint_checksum,
            timings=timings,
        )


def _mode(*, abort: bool) -> PauseMode:
    """How a change treats running requests (SGLang's ``abort_all_requests``)."""
    return PauseMode.ABORT if abort else PauseMode.DRAIN

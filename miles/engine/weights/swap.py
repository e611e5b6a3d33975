"""The weights an engine serves: what they are, and every operation that changes or reads them whole.

``LiveWeights`` owns the identity of the served weights (``HeldWeights``: version, checksum,
verified or not), replaced whole under the write side of the weights lock whenever the weights or
their name change, so a probe never reads a version paired with another version's checksum. The
checksum is never stale: it is computed once at start-up, by every load (over the memory it wrote,
whatever it hashes to: the live weights after a copy, the staged ones before they are swapped in),
and by every ``/weights_checker``; a rename keeps it.

A load follows the order that makes it safe: check the path, verify the whole checkpoint and match
it against the live model while generation goes on, then one of two ways (``staging.py`` picks):

- staged: write the new weights beside the live ones and hash them, still serving (a mismatch is
  refused here, nothing changed); pause as asked; swap them in under the write side of the lock
  on the scheduler thread, in a time that does not grow with the model (``weight_stage.py``);
  resume.
- in place: pause as asked; copy under the write side of the lock on the scheduler thread
  (between two steps), hashing what was written; confirm the checksum; resume.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from miles.engine.weights.lock import WeightsLock
from miles.engine.scheduler import GenerationState, Scheduler
from miles.engine.settings import EngineSettings
from miles.engine.weights.export import export_snapshot
from miles.engine.weights.stage import StagingReport, WeightStaging
from miles.engine.weights.sources import PreparedUpdate, UnexpectedChecksumError, apply_update, prepare_update
from miles.engine.weights.buffers import StagingRefusedError, WeightStage
from miles.errors import (
    CheckpointError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)
from miles.protocol.sglang import (
    ActivateWeightsRequest,
    ExportWeightsRequest,
    ExportWeightsResponse,
    PauseMode,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
    UpdateWeightVersionRequest,
    WeightVersionResponse,
)
from miles.weights.buckets import BucketEntry, BucketTable, Received
from miles.weights.checksum import ModelChecksum, checksum_module, saved_state_dict
from miles.weights.paths import checked_path, files_outside_roots

logger = logging.getLogger("miles.engine")


class WeightsStatus(Enum):
    """Whether the live weights are known to equal a verified checkpoint."""

    VERIFIED = "verified"
    # A copy finished but the weights hash to something other than the checkpoint's manifest:
    # generation stays paused until a good checkpoint is loaded.
    UNVERIFIED = "unverified"


@dataclass(frozen=True)
class _Paused:
    """How an update paused generation."""

    by_update: bool  # the update paused it (and resumes it); False when the caller had
    requests: int  # requests in flight when it paused


@dataclass(frozen=True)
class HeldWeights:
    """The identity of the weights the engine holds now (replaced whole, never torn)."""

    version: str
    # The model checksum of the weights held now; None only until the model has loaded.
    checksum: str | None
    status: WeightsStatus


class LiveWeights:
    """The served weights' identity and the operations on them; coroutines run on the event loop."""

    def __init__(
        self,
        *,
        settings: EngineSettings,
        scheduler: Scheduler,
        lock: WeightsLock,
        model: Callable[[], PreTrainedModel],
        tokenizer: Any,
        served_model_name: str,
        version: str,
        loaded_from: Path,
        manifest_checksum: str | None,
        staging: WeightStaging,
    ) -> None:
        self._settings = settings
        self._staging = staging
        self._scheduler = scheduler
        self._lock = lock
        self._model = model
        self._tokenizer = tokenizer
        self._served_model_name = served_model_name
        self._held = HeldWeights(version=version, checksum=None, status=WeightsStatus.VERIFIED)
        # This process's identity in every report of the weights: a restart makes a new one.
        self._instance_id = uuid.uuid4().hex
        self._start_manifest_checksum = manifest_checksum
        self._loaded_from = loaded_from
        # The served model's tensors by checkpoint name, as (dtype, shape): what every update must
        # match, computed once per model (updates never change either).
        self._signature_of: tuple[PreTrainedModel, dict[str, tuple[torch.dtype, tuple[int, ...]]]] | None = None
        # One update at a time (the next waits); one export at a time (two writing the same
        # snapshot would race for its directory).
        self._update_lock = asyncio.Lock()
        self._export_lock = asyncio.Lock()
        # Whether an update paused generation and left it paused: a push until its last bucket is
        # verified, a load whose copy did not match; the next good load or push resumes it.
        self._update_paused = False
        # The stage buckets of a push are written into, and pushed weights staged and verified,
        # waiting for /activate_weights (the live weights are untouched until then).
        self._push_stage: WeightStage | None = None
        self._staged_push: _StagedPush | None = None
        # Loads in progress, held here so a load whose caller went away is not collected mid-way.
        self._loads: set[asyncio.Future[UpdateWeightsResponse]] = set()

    @property
    def held(self) -> HeldWeights:
        return self._held

    @property
    def loaded_from(self) -> Path:
        """The checkpoint directory the weights were last loaded from."""
        return self._loaded_from

    def identity(self) -> WeightVersionResponse:
        """What the weights held now are (version and checksum), from one consistent record."""
        held = self._held
        return WeightVersionResponse(weight_version=held.version, checksum=held.checksum, instance_id=self._instance_id)

    @property
    def staging(self) -> StagingReport:
        """Whether updates are staged, and what staging holds (``/get_server_info``)."""
        return self._staging.report()

    def record_loaded(self, *, runner_tensors: list[torch.Tensor]) -> None:
        """Record the checksum of the weights just loaded at start-up, before serving begins, so
        the identity probes read is never without one (a hash pass at memory speed), and find
        the memory a staged update swaps (``runner_tensors``: ``ModelRunner.weight_views``)."""
        self._staging.attach(self._model(), runner_tensors=runner_tensors)
        checksum = checksum_module(self._model()).checksum
        self._held = replace(self._held, checksum=checksum)
        if self._start_manifest_checksum not in (None, checksum):
            logger.warning(
                "the weights loaded from %s hash to %s but its manifest says %s; the engine reports what it holds",
                self._loaded_from,
                checksum,
                self._start_manifest_checksum,
            )

    def require_verified(self, action: str) -> None:
        """Raises InvalidRequestError (409) while the weights are unverified."""
        if self._held.status is WeightsStatus.UNVERIFIED:
            raise ConflictError(
                "the engine holds unverified weights after a failed update; load a good checkpoint "
                f"with /update_weights_from_disk before {action}",
            )

    async def update_from_disk(self, request: UpdateWeightsFromDiskRequest) -> UpdateWeightsResponse:
        """Load a checkpoint into the live weights (see the module docstring for the order).

        Raises InvalidRequestError for a path that is not allowed or not a directory. A checkpoint
        that fails validation is answered with ``success=False`` and leaves the old weights serving.
        """
        path = await asyncio.to_thread(self._checkpoint_path, request.model_path)
        # Once started, a load runs to its end even if its caller goes away: a worker thread still
        # writing a stage (or copying) for a cancelled task would race the next load for the same
        # memory.
        load = asyncio.ensure_future(self._load(path, request))
        self._loads.add(load)
        load.add_done_callback(self._loads.discard)
        return await asyncio.shield(load)

    async def _load(self, path: Path, request: UpdateWeightsFromDiskRequest) -> UpdateWeightsResponse:
        async with self._update_lock:
            # A push that never finished (or was never activated) is superseded by this load.
            self._drop_staged_push()
            try:
                prepared = await asyncio.to_thread(
                    prepare_update,
                    self._model(),
                    path,
                    expected_checksum=request.expected_checksum,
                    weight_version=request.weight_version,
                )
            except CheckpointError as exc:
                logger.warning("refused checkpoint %s: %s", path, exc)
                return UpdateWeightsResponse(
                    success=False,
                    message=str(exc),
                    weight_version=self._held.version,
                    checkpoint_checksum=exc.computed if isinstance(exc, UnexpectedChecksumError) else None,
                )
            try:
                version = request.weight_version or prepared.weight_version
                opening = time.perf_counter()
                # Staged when the policy allows it (``staging.py``), else copied in place.
                stage = await asyncio.to_thread(self._staging.open_stage)
                if stage is None:
                    return await self._load_in_place(request, prepared, version)
                prepared.timings["stage_open"] = time.perf_counter() - opening
                try:
                    return await self._load_staged(request, prepared, stage, version)
                finally:
                    stage.discard()  # a no-op once activated
            finally:
                prepared.close()

    async def _load_in_place(
        self, request: UpdateWeightsFromDiskRequest, prepared: PreparedUpdate, version: str
    ) -> UpdateWeightsResponse:
        """Pause, copy into the live weights under the write lock, confirm, resume."""
        paused = await self._pause(request, prepared.timings)
        # The copy runs on the scheduler thread, between two steps (one torch thread).
        checksum = await asyncio.to_thread(self._scheduler.call, lambda: self._copy_in(prepared, version))
        return self._answer(request, prepared, paused=paused, checksum=checksum, version=version)

    async def _load_staged(
        self, request: UpdateWeightsFromDiskRequest, prepared: PreparedUpdate, stage: WeightStage, version: str
    ) -> UpdateWeightsResponse:
        """Write and hash the new weights beside the live ones while serving; only then pause and
        swap them in under the write lock (``weight_stage.py``)."""
        timings = prepared.timings
        started = time.perf_counter()
        try:
            await asyncio.to_thread(stage.write_all, prepared.reader.tensor)
        except (OSError, CheckpointError) as exc:
            # The files became unreadable after they were verified; the live weights never changed.
            return self._refused(prepared, f"checkpoint {prepared.reader.directory} could not be staged: {exc}")
        written = time.perf_counter()
        timings["stage_write"] = written - started
        staged = await asyncio.to_thread(stage.checksum)
        timings["stage_checksum"] = time.perf_counter() - written
        if staged.checksum != prepared.manifest_checksum:
            # The files changed after they were verified (or memory failed): refused before anything
            # paused, and the live weights never changed.
            return self._refused(
                prepared,
                f"weights staged from {prepared.reader.directory} hash to {staged.checksum} but the manifest "
                f"says {prepared.manifest_checksum}; the checkpoint changed while it was read. Nothing was "
                "changed; load it again once it is complete",
            )
        paused = await self._pause(request, timings)
        checksum = await asyncio.to_thread(self._scheduler.call, lambda: self._activate(stage, prepared, version))
        return self._answer(request, prepared, paused=paused, checksum=checksum, version=version)

    async def _pause(self, request: UpdateWeightsFromDiskRequest, timings: dict[str, float]) -> _Paused:
        """Pause generation for the change as the request asks (unless the caller paused it)."""
        by_update = self._scheduler.state is GenerationState.SERVING
        requests = 0
        started = time.perf_counter()
        if by_update:
            mode = _pause_mode(abort_all_requests=request.abort_all_requests)
            requests = await asyncio.to_thread(
                self._scheduler.pause, mode, message="aborted by update_weights_from_disk"
            )
        elif request.abort_all_requests:
            self._scheduler.abort(None, message="aborted by update_weights_from_disk")
        timings["pause"] = time.perf_counter() - started
        return _Paused(by_update=by_update, requests=requests)

    def _answer(
        self,
        request: UpdateWeightsFromDiskRequest,
        prepared: PreparedUpdate,
        *,
        paused: _Paused,
        checksum: ModelChecksum,
        version: str,
    ) -> UpdateWeightsResponse:
        """Resume (unless asked not to) and answer, once the weights changed to ``checksum``."""
        if checksum.checksum != prepared.manifest_checksum:
            # Paused here on weights no checkpoint has: the next good load or push resumes.
            self._update_paused = self._update_paused or paused.by_update
            return UpdateWeightsResponse(
                success=False,
                message=(
                    f"weights loaded from {prepared.reader.directory} hash to {checksum.checksum} but the manifest "
                    f"says {prepared.manifest_checksum}; generation stays paused until a good checkpoint is loaded"
                ),
                num_paused_requests=paused.requests,
                weight_version=self._held.version,
                checksum=checksum.checksum,
                checkpoint_checksum=prepared.checkpoint_checksum,
                timings=prepared.timings,
            )
        # A push that paused generation and never completed is superseded by this load.
        if (paused.by_update or self._update_paused) and not request.keep_pause:
            self._scheduler.resume()
            self._update_paused = False
        return UpdateWeightsResponse(
            success=True,
            message=f"Succeeded to update model weights from {prepared.reader.directory}.",
            num_paused_requests=paused.requests,
            weight_version=version,
            checksum=checksum.checksum,
            checkpoint_checksum=prepared.checkpoint_checksum,
            timings=prepared.timings,
        )

    def _signature(self) -> Mapping[str, tuple[torch.dtype, tuple[int, ...]]]:
        model = self._model()
        if self._signature_of is None or self._signature_of[0] is not model:
            tensors = saved_state_dict(model)
            self._signature_of = (model, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})
        return self._signature_of[1]

    def check_table(self, table: BucketTable) -> None:
        """Raise InvalidRequestError unless every tensor of ``table`` is one the model holds, with
        its dtype and shape (checked before anything is received or allocated)."""
        # Compared as numbers: a shape no tensor could have (2**40 x 2**40) is refused by the
        # comparison, never allocated, even on the meta device.
        _check_pushed(((e.name, e.torch_dtype(), e.shape) for e in table.entries), self._signature())

    async def apply_pushed(
        self,
        bucket: Received,
        *,
        weight_version: str | None,
        expected_checksum: str | None,
        abort_all_requests: bool,
        source: str,
        activate: bool = True,
    ) -> UpdateWeightsResponse:
        """Take one bucket of pushed tensors, each checked against the digest it was sent with (over
        the bytes staged, in the same pass as the copy; before anything is copied in place); the
        last push of an update (``expected_checksum`` given) is confirmed over the whole model before the
        weights serve.

        Staged when the staging policy allows (the engine keeps serving while buckets arrive, and
        only the swap blocks generation); with ``activate=False`` the verified stage waits for
        ``activate_staged`` (the controller's commit). Otherwise copied in place: generation
        pauses at the first push and stays paused, the weights marked unverified, until a last
        push's checksum matches. Raises InvalidRequestError for a tensor the model does not have,
        or of another dtype or shape, before anything is copied, and for a tensor whose bytes do
        not match their digest (the staged push is dropped: the live weights never changed);
        ConflictError for a push that must stage (``activate=False``) on an engine that cannot stage now.
        """
        if expected_checksum is not None and weight_version is None:
            raise InvalidRequestError(
                "the last push of an update (with expected_checksum) must name its weight_version"
            )
        async with self._update_lock:
            _check_pushed(((e.name, e.torch_dtype(), e.shape) for e in bucket.entries.values()), self._signature())
            if self._push_stage is None:
                self._drop_staged_push()
                self._push_stage = await asyncio.to_thread(self._staging.open_stage)
            if self._push_stage is not None:
                return await self._push_staged(
                    bucket,
                    weight_version=weight_version,
                    expected_checksum=expected_checksum,
                    abort_all_requests=abort_all_requests,
                    source=source,
                    activate=activate,
                )
            if not activate:
                why = self._staging.report().reason or "staging is off"
                raise ConflictError(
                    f"this engine cannot stage pushed weights now ({why}); push in a window whose servers "
                    "leave routing for the push, or raise --weight-staging-budget"
                )
            await asyncio.to_thread(bucket.verify)
            return await self._push_in_place(
                bucket.tensors,
                weight_version=weight_version,
                expected_checksum=expected_checksum,
                abort_all_requests=abort_all_requests,
                source=source,
            )

    async def activate_staged(self, request: ActivateWeightsRequest) -> UpdateWeightsResponse:
        """Serve the pushed weights staged and verified earlier (``activate=False``): drain or abort
        running requests as asked, swap, resume. Raises ConflictError when no staged weights
        hash to ``expected_checksum``."""
        async with self._update_lock:
            staged = self._staged_push
            if staged is None or staged.checksum != request.expected_checksum:
                have = "nothing is staged" if staged is None else f"the staged weights hash to {staged.checksum}"
                raise ConflictError(
                    f"no staged weights hash to {request.expected_checksum} ({have}); push them first with "
                    "activate=false"
                )
            self._staged_push = None
            return await self._activate_push(
                staged.stage,
                version=request.weight_version,
                mode=request.pause_mode or _pause_mode(abort_all_requests=request.abort_all_requests),
                timings={},
                source="staged weights",
            )

    async def discard_push(self) -> None:
        """Drop a push that never reached its last bucket (its window ended): the live weights
        never changed. Staged and verified weights stay until activated or superseded by the
        next push or load (the window's commit activates them after closing the window)."""
        async with self._update_lock:
            if self._push_stage is not None:
                self._push_stage.discard()
                self._push_stage = None

    def _drop_staged_push(self) -> None:
        if self._push_stage is not None:
            self._push_stage.discard()
            self._push_stage = None
        if self._staged_push is not None:
            self._staged_push.stage.discard()
            self._staged_push = None

    async def _push_staged(
        self,
        bucket: Received,
        *,
        weight_version: str | None,
        expected_checksum: str | None,
        abort_all_requests: bool,
        source: str,
        activate: bool,
    ) -> UpdateWeightsResponse:
        stage = self._push_stage
        assert stage is not None
        timings: dict[str, float] = {}

        def write() -> ModelChecksum | None:
            """Stage the bucket and, after the last one, hash the whole stage: one thread hop."""
            started = time.perf_counter()
            _stage_all(stage, bucket)
            timings["stage_write"] = time.perf_counter() - started
            if expected_checksum is None:
                return None
            hashed = time.perf_counter()
            checksum = stage.checksum()
            timings["stage_checksum"] = time.perf_counter() - hashed
            return checksum

        try:
            staged = await asyncio.to_thread(write)
        except InvalidRequestError:
            self._drop_staged_push()
            raise
        held = self._held
        if staged is None:
            return UpdateWeightsResponse(
                success=True,
                message=f"staged {len(bucket.entries)} tensors; the engine serves {held.version} meanwhile",
                weight_version=held.version,
                timings=timings,
            )
        self._push_stage = None
        if staged.checksum != expected_checksum:
            stage.discard()
            return UpdateWeightsResponse(
                success=False,
                message=(
                    f"the pushed weights hash to {staged.checksum}, not the expected {expected_checksum}: a tensor "
                    f"is missing or differs. Nothing changed; the engine serves {held.version}"
                ),
                weight_version=held.version,
                checksum=staged.checksum,
                timings=timings,
            )
        assert weight_version is not None
        if not activate:
            self._staged_push = _StagedPush(stage=stage, checksum=staged.checksum)
            return UpdateWeightsResponse(
                success=True,
                message=f"staged and verified; the engine serves {held.version} until /activate_weights",
                weight_version=held.version,
                checksum=staged.checksum,
                timings=timings,
            )
        return await self._activate_push(
            stage,
            version=weight_version,
            mode=_pause_mode(abort_all_requests=abort_all_requests),
            timings=timings,
            source=source,
        )

    async def _activate_push(
        self,
        stage: WeightStage,
        *,
        version: str,
        mode: PauseMode,
        timings: dict[str, float],
        source: str,
    ) -> UpdateWeightsResponse:
        """Swap a verified stage in between two steps; an engine still generating pauses first
        (running requests as ``mode`` says) and resumes after."""
        paused = 0
        by_push = self._scheduler.state is GenerationState.SERVING
        started = time.perf_counter()
        if by_push:
            paused = await asyncio.to_thread(self._scheduler.pause, mode, message=f"aborted by {source}")
        timings["pause"] = time.perf_counter() - started

        def refused(exc: StagingRefusedError) -> ModelChecksum:
            raise exc

        def swap() -> ModelChecksum:
            return self._swap(stage, version=version, timings=timings, refused=refused)

        try:
            checksum = await asyncio.to_thread(self._scheduler.call, swap)
        except StagingRefusedError as exc:
            stage.discard()
            self._staging.give_up(f"a swap was refused: {exc}")
            message = f"the pushed weights could not be swapped in ({exc}); nothing changed, push them again"
            ok = False
        else:
            message, ok = f"Succeeded to update model weights from {source}.", True
        if (by_push or self._update_paused) and ok:
            self._scheduler.resume()
            self._update_paused = False
        elif by_push:
            self._scheduler.resume()
        return UpdateWeightsResponse(
            success=ok,
            message=message,
            num_paused_requests=paused,
            weight_version=version if ok else self._held.version,
            checksum=checksum.checksum if ok else None,
            timings=timings,
        )

    async def _push_in_place(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        weight_version: str | None,
        expected_checksum: str | None,
        abort_all_requests: bool,
        source: str,
    ) -> UpdateWeightsResponse:
        """Copy one bucket into the live weights under the write lock (see ``apply_pushed``)."""
        live = saved_state_dict(self._model())
        timings: dict[str, float] = {}
        paused = 0
        started = time.perf_counter()
        if self._scheduler.state is GenerationState.SERVING:
            mode = _pause_mode(abort_all_requests=abort_all_requests)
            paused = await asyncio.to_thread(self._scheduler.pause, mode, message=f"aborted by {source}")
            self._update_paused = True
        elif abort_all_requests:
            self._scheduler.abort(None, message=f"aborted by {source}")
        timings["pause"] = time.perf_counter() - started

        def copy() -> ModelChecksum | None:
            waiting = time.perf_counter()
            with self._lock.write():
                timings["write_lock_wait"] = time.perf_counter() - waiting
                copied = time.perf_counter()
                with torch.no_grad():
                    for name, tensor in tensors.items():
                        live[name].copy_(tensor)
                timings["copy"] = time.perf_counter() - copied
                if expected_checksum is None:
                    self._held = replace(self._held, status=WeightsStatus.UNVERIFIED)
                    return None
                hashed = time.perf_counter()
                result = checksum_module(self._model())
                timings["checksum"] = time.perf_counter() - hashed
                if result.checksum == expected_checksum:
                    assert weight_version is not None
                    self._held = HeldWeights(
                        version=weight_version, checksum=result.checksum, status=WeightsStatus.VERIFIED
                    )
                else:
                    self._held = replace(self._held, checksum=result.checksum, status=WeightsStatus.UNVERIFIED)
                return result

        # On the scheduler thread, between two steps, like every copy into the live weights.
        checksum = await asyncio.to_thread(self._scheduler.call, copy)
        if checksum is None:
            return UpdateWeightsResponse(
                success=True,
                message=f"received {len(tensors)} tensors; generation stays paused until the last push is verified",
                num_paused_requests=paused,
                weight_version=self._held.version,
                timings=timings,
            )
        if checksum.checksum != expected_checksum:
            return UpdateWeightsResponse(
                success=False,
                message=(
                    f"the pushed weights hash to {checksum.checksum}, not the expected {expected_checksum}: a "
                    "tensor is missing or differs; generation stays paused until good weights are loaded"
                ),
                num_paused_requests=paused,
                weight_version=self._held.version,
                checksum=checksum.checksum,
                timings=timings,
            )
        if self._update_paused:
            self._scheduler.resume()
            self._update_paused = False
        return UpdateWeightsResponse(
            success=True,
            message=f"Succeeded to update model weights from {source}.",
            num_paused_requests=paused,
            weight_version=weight_version,
            checksum=checksum.checksum,
            timings=timings,
        )

    def _refused(self, prepared: PreparedUpdate, message: str) -> UpdateWeightsResponse:
        logger.warning("refused staged update: %s", message)
        return UpdateWeightsResponse(
            success=False,
            message=message,
            weight_version=self._held.version,
            checkpoint_checksum=prepared.checkpoint_checksum,
            timings=prepared.timings,
        )

    def _copy_in(self, prepared: PreparedUpdate, version: str) -> ModelChecksum:
        waiting = time.perf_counter()
        with self._lock.write():
            prepared.timings["write_lock_wait"] = time.perf_counter() - waiting
            return self._copy_locked(prepared, version)

    def _copy_locked(self, prepared: PreparedUpdate, version: str) -> ModelChecksum:
        checksum = apply_update(prepared, self._model())
        # Whatever the outcome, the record says what the weights hash to now (a drift probe
        # must see an unverified copy for what it is); the version moves only with a match.
        if checksum.checksum == prepared.manifest_checksum:
            self._held = HeldWeights(version=version, checksum=checksum.checksum, status=WeightsStatus.VERIFIED)
            self._loaded_from = Path(prepared.reader.directory)
        else:
            self._held = replace(self._held, checksum=checksum.checksum, status=WeightsStatus.UNVERIFIED)
        return checksum

    def _activate(self, stage: WeightStage, prepared: PreparedUpdate, version: str) -> ModelChecksum:
        """Swap the staged checkpoint in (scheduler thread); a swap the stage refuses (some tensor
        would have kept the old weights) becomes an in-place copy, under the same lock."""

        def refused(exc: StagingRefusedError) -> ModelChecksum:
            self._staging.give_up(f"a swap was refused: {exc}")
            return self._copy_locked(prepared, version)

        def swapped() -> None:
            self._loaded_from = Path(prepared.reader.directory)

        return self._swap(stage, version=version, timings=prepared.timings, refused=refused, swapped=swapped)

    def _swap(
        self,
        stage: WeightStage,
        *,
        version: str,
        timings: dict[str, float],
        refused: Callable[[StagingRefusedError], ModelChecksum],
        swapped: Callable[[], None] = lambda: None,
    ) -> ModelChecksum:
        """Swap a verified stage in under the write side of the lock (scheduler thread, between two
        steps): the staged checksum is the live one then, since activation moves no byte.
        ``refused`` answers, under the same lock, a swap the stage refused. ``activate`` in the
        timings is the time the write lock was held: what generation waited for."""
        _prepare(stage)
        waiting = time.perf_counter()
        with self._lock.write():
            locked = time.perf_counter()
            timings["write_lock_wait"] = locked - waiting
            try:
                checksum = stage.activate()
            except StagingRefusedError as exc:
                return refused(exc)
            self._held = HeldWeights(version=version, checksum=checksum.checksum, status=WeightsStatus.VERIFIED)
            swapped()
            timings["activate"] = time.perf_counter() - locked
            return checksum

    def _checkpoint_path(self, raw: str) -> Path:
        # Text from the request: checked (NUL bytes, lengths, loops) before any filesystem call.
        path = checked_path(raw, field="model_path")
        roots = self._settings.allowed_checkpoint_roots
        if roots and not any(path.is_relative_to(root) for root in roots):
            raise PermissionDeniedError(
                f"model_path {str(path)!r} is outside the allowed checkpoint roots; put the checkpoint "
                "under one of them or extend MILES_ALLOWED_CHECKPOINT_ROOTS",
                allowed=[str(r) for r in roots],
            )
        try:
            is_dir = path.is_dir()
        except OSError as exc:  # e.g. a resolved path longer than the system allows
            raise InvalidRequestError(f"model_path {str(path)[:200]!r} cannot be read: {exc.strerror}") from exc
        if not is_dir:
            raise NotFoundError(f"model_path {str(path)!r} is not a directory")
        # The directory is inside a root, but each file in it may be a symlink to anywhere: every
        # entry must resolve inside a root too, or reading it would leave them.
        outside = files_outside_roots(path, roots)
        if outside:
            raise PermissionDeniedError(
                f"checkpoint {str(path)!r} holds entries that resolve outside the allowed checkpoint roots: "
                f"{', '.join(outside[:10])}{' ...' if len(outside) > 10 else ''}; copy the files into the "
                "checkpoint instead of linking them, or extend MILES_ALLOWED_CHECKPOINT_ROOTS",
                allowed=[str(r) for r in roots],
            )
        return path

    async def rename(self, request: UpdateWeightVersionRequest) -> None:
        """Serve the same weights under ``new_version`` (between two steps: the write side)."""
        if request.abort_all_requests:
            self._scheduler.abort(None, message="aborted by update_weight_version")

        def rename() -> None:
            with self._lock.write():
                self._held = replace(self._held, version=request.new_version)

        await asyncio.to_thread(rename)

    async def checksum(self) -> ModelChecksum:
        """The checksum of the weights held right now (recomputed, and recorded as theirs)."""

        def compute() -> ModelChecksum:
            with self._lock.read():
                result = checksum_module(self._model())
                # Still under the read lock: no copy can change the weights before this is recorded.
                self._held = replace(self._held, checksum=result.checksum)
                return result

        return await asyncio.to_thread(compute)

    async def export(self, request: ExportWeightsRequest) -> ExportWeightsResponse:
        """Write the weights held now as a sealed checkpoint under ``--snapshot-dir``.

        Raises InvalidRequestError (409) when export is not enabled or the weights are unverified.
        """
        snapshot_dir = self._settings.snapshot_dir
        if snapshot_dir is None:
            raise ConflictError(
                "weight export is not enabled on this engine; start it with --snapshot-dir DIR "
                "(the directory exported checkpoints are written under)",
            )

        def export() -> ExportWeightsResponse:
            # A copy of the weights and their record, then written to disk without any lock (see
            # ``copy_weights``). A worker thread, not the scheduler's.
            with self._lock.read():
                self.require_verified("exporting")
                held = self._held
                assert held.checksum is not None, "the checksum is recorded before the engine serves"
                writes = self._lock.writes
            model = copy_weights(self._model(), self._lock, writes=writes, what=f"weights {held.version}")
            try:
                path = export_snapshot(
                    model,
                    tokenizer=self._tokenizer,
                    snapshot_dir=snapshot_dir,
                    model_name=self._served_model_name,
                    weight_version=held.version,
                    checksum=held.checksum,
                    step=request.step,
                )
            finally:
                del model
            return ExportWeightsResponse(
                success=True, path=str(path), checksum=held.checksum, weight_version=held.version
            )

        async with self._export_lock:
            return await asyncio.to_thread(export)


def copy_weights(model: PreTrainedModel, lock: WeightsLock, *, writes: int, what: str) -> PreTrainedModel:
    """A copy of ``model``, taken a slice at a time, each under the read side of ``lock``: an
    update that commits meanwhile waits for one slice, not for the whole copy (its swap runs
    between two generation steps, which would wait with it), and ends the copy, whose weights are
    no longer the ones served. Between two slices nothing here views the live weights (a staged
    swap refuses to leave a tensor it does not know on the old ones).

    ``writes``: ``lock.writes`` when the caller read the record of the weights (``what``).

    Raises ConflictError: the weights changed since (and the copy is dropped).
    """
    copied, pairs = _empty_copy(model)
    for live, target in pairs:
        # A tensor that is not contiguous is copied whole, in one section.
        step = _EXPORT_SLICE_BYTES // live.element_size() if live.is_contiguous() else live.numel()
        for start in range(0, max(live.numel(), 1), max(step, 1)):
            with lock.read():
                if lock.writes != writes:
                    raise ConflictError(
                        f"the weights changed while they were copied ({what} then); ask again to copy the ones "
                        "held now",
                    )
                with torch.no_grad():
                    if step >= live.numel():
                        target.copy_(live)
                    else:
                        target.view(-1)[start : start + step].copy_(live.view(-1)[start : start + step])
    return copied


# What one read section of an export copies: what an update's swap may wait for.
_EXPORT_SLICE_BYTES = 16 * 1024 * 1024


def _empty_copy(model: PreTrainedModel) -> tuple[PreTrainedModel, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A copy of ``model`` whose parameters and buffers are new, unfilled tensors (tied ones stay
    tied), and the (live, copy) pairs to fill them from: the model's own tensor objects, so that
    holding them adds no view of the live memory."""
    memo: dict[int, Any] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        empty = torch.empty_like(tensor)
        is_parameter = isinstance(tensor, torch.nn.Parameter)
        memo[id(tensor)] = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad) if is_parameter else empty
        pairs.append((tensor, empty))
    return copy.deepcopy(model, memo), pairs


def _shape_text(shape: Iterable[int]) -> str:
    """A shape as a list, cut short past 8 dimensions (a hostile one may have thousands)."""
    dims = list(shape)
    return str(dims) if len(dims) <= 8 else f"[{', '.join(map(str, dims[:8]))}, ... ({len(dims)} dimensions)]"


def _pause_mode(*, abort_all_requests: bool) -> PauseMode:
    """How a push that activates at once treats running requests (SGLang's ``abort_all_requests``)."""
    return PauseMode.ABORT if abort_all_requests else PauseMode.DRAIN


def _prepare(stage: WeightStage) -> None:
    """Warm the swap before the write lock is taken. A refusal here may be a reader holding the
    weights for a moment (an export writing them out, a checksum): ``activate`` checks again
    under the write lock, once every reader is gone, and only a refusal there is final."""
    try:
        stage.prepare_activation()
    except StagingRefusedError as exc:
        logger.info("the swap's check before the lock was refused (checked again under it): %s", exc)


@dataclass(frozen=True)
class _StagedPush:
    stage: WeightStage
    checksum: str


# Below this many bytes a bucket is staged on one thread: more cost more than they save.
_PARALLEL_STAGE_BYTES = 16 * 1024 * 1024


def _stage_all(stage: WeightStage, bucket: Received) -> None:
    """Stage every tensor of ``bucket``, each checked against its digest over the bytes staged.

    A large bucket is staged on as many threads as torch may use in this process (the cores the
    engine was given; the copy and the hash release the GIL), the largest tensors first; the
    first tensor that fails stops the others from taking more.
    """
    items = sorted(bucket.entries.values(), key=lambda entry: entry.nbytes, reverse=True)

    def one(entry: BucketEntry) -> None:
        copy = functools.partial(bucket.copy_into, entry.name)
        bucket.check(entry.name, stage.write_with(entry.name, entry.torch_dtype(), entry.shape, copy))

    threads = min(torch.get_num_threads(), len(items))
    if threads < 2 or sum(e.nbytes for e in items) < _PARALLEL_STAGE_BYTES:
        for entry in items:
            one(entry)
        return
    queue = iter(items)
    taking = threading.Lock()
    failed = threading.Event()

    def work() -> None:
        while not failed.is_set():
            with taking:
                item = next(queue, None)
            if item is None:
                return
            try:
                one(item)
            except BaseException:
                failed.set()
                raise

    with ThreadPoolExecutor(threads, thread_name_prefix="miles-stage") as pool:
        workers = [pool.submit(work) for _ in range(threads)]
    for worker in workers:
        worker.result()


def _check_pushed(
    pushed: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    live: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
) -> None:
    """Raise InvalidRequestError unless every pushed (name, dtype, shape) names a live tensor of
    that dtype and shape (``live``: the model's (dtype, shape) by name)."""
    for name, dtype, shape in pushed:
        target = live.get(name)
        if target is None:
            raise InvalidRequestError(f"the model has no tensor {name!r}; push the names its checkpoint has")
        if target[0] != dtype or target[1] != tuple(shape):
            raise InvalidRequestError(
                f"tensor {name!r} is pushed as {dtype}{_shape_text(shape)}, but the model holds "
                f"{target[0]}{list(target[1])}"
            )

"""The live record (what the served weights are) and the operations that read them whole: a
checksum, and an export (``POST /export_weights``), a copy read in sections and written at a path
named after its version and checksum. ``HeldWeights`` is replaced whole under the write lock, so a
probe never reads a version paired with another version's checksum.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import re
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from miles.engine.weights.lock import WeightsLock
from miles.errors import ChecksumMismatchError, ConflictError, InsufficientStorageError
from miles.protocol.sglang_weights import ExportWeightsRequest, ExportWeightsResponse, WeightVersionResponse
from miles.weights.checkpoint import save_checkpoint
from miles.weights.checksum import (
    ModelChecksum,
    TensorDigest,
    checksum_from_digests,
    checksum_module,
    saved_state_dict,
)
from miles.weights.digest import TensorHasher
from miles.weights.manifest import manifest_or_none
from miles.weights.safetensors_io import dtype_name

logger = logging.getLogger("miles.engine")

# How long an export waits for a change that opened its stage to swap or be dropped.
EXPORT_WAITS_FOR_CHANGE_S = 2.0

# Passes of a sectioned checksum that changes may end before it hashes in one section.
_SECTIONED_TRIES = 3

# What one section of a long read (an export, a checksum) reads: what a swap may wait for (~0.5 ms).
READ_SECTION_BYTES = 4 * 1024 * 1024

# Each part of a snapshot's directory name stays well inside NAME_MAX (255 bytes) in all.
_MAX_PART_CHARS = 96


class WeightsStatus(Enum):
    """Whether the live weights are known to equal a verified checkpoint."""

    VERIFIED = "verified"
    # Written in place but not hashing to what was expected (yet): generation stays paused.
    UNVERIFIED = "unverified"


@dataclass(frozen=True)
class HeldWeights:
    """The identity of the weights the engine holds now (replaced whole, never torn)."""

    version: str
    checksum: str | None  # the model checksum; None only until the model has loaded
    status: WeightsStatus


class LiveWeights:
    """The served weights' record and the operations that read them."""

    def __init__(
        self,
        *,
        lock: WeightsLock,
        model: Callable[[], PreTrainedModel],
        tokenizer: Any,
        served_model_name: str,
        snapshot_dir: Path | None,
        version: str,
        loaded_from: Path,
        manifest_checksum: str | None,
    ) -> None:
        self.lock = lock
        self.model = model
        self._tokenizer = tokenizer
        self._served_model_name = served_model_name
        self._snapshot_dir = snapshot_dir
        self.held = HeldWeights(version=version, checksum=None, status=WeightsStatus.VERIFIED)
        # This process's identity in every report of the weights: a restart makes a new one.
        self._instance_id = uuid.uuid4().hex
        self._start_manifest_checksum = manifest_checksum
        self.loaded_from = loaded_from  # the checkpoint directory the weights were last loaded from
        # One export at a time: two writing the same snapshot would race for its directory.
        self._export_lock = asyncio.Lock()

    def identity(self) -> WeightVersionResponse:
        """What the weights held now are (version and checksum), from one consistent record."""
        held = self.held
        return WeightVersionResponse(weight_version=held.version, checksum=held.checksum, instance_id=self._instance_id)

    def record(self, held: HeldWeights, *, loaded_from: Path | None = None) -> None:
        """Record what the weights are now (and the checkpoint they came from); write lock held."""
        self.held = held
        if loaded_from is not None:
            self.loaded_from = loaded_from

    def record_loaded(self) -> None:
        """Record the checksum of the weights loaded at start-up, before serving begins."""
        checksum = checksum_module(self.model()).checksum
        self.held = replace(self.held, checksum=checksum)
        if self._start_manifest_checksum not in (None, checksum):
            logger.warning(
                "the weights loaded from %s hash to %s but its manifest says %s; the engine reports what it holds",
                self.loaded_from,
                checksum,
                self._start_manifest_checksum,
            )

    def require_verified(self, action: str) -> None:
        """Raises ConflictError (409) while the weights are unverified."""
        if self.held.status is WeightsStatus.UNVERIFIED:
            raise ConflictError(
                "the engine holds unverified weights after a failed update; load a good checkpoint "
                f"with /update_weights_from_disk before {action}",
            )

    async def checksum(self) -> ModelChecksum:
        """The checksum of the weights held now, recomputed and recorded. Hashed in read sections
        (``read_in_sections``); a change that commits meanwhile makes it hash again, and after
        ``_SECTIONED_TRIES`` such passes it hashes in one section."""

        def compute() -> ModelChecksum:
            for _ in range(_SECTIONED_TRIES):
                with contextlib.suppress(ConflictError):  # a change committed meanwhile
                    return self._hash_in_sections()
            with self.lock.read():
                result = checksum_module(self.model())
                # Still under the read lock: no change can write the weights before this is recorded.
                self.held = replace(self.held, checksum=result.checksum)
                return result

        return await asyncio.to_thread(compute)

    def _hash_in_sections(self) -> ModelChecksum:
        """The checksum of the live weights, hashed in read sections, recorded unless a change
        committed meanwhile (ConflictError)."""
        model = self.model()
        writes = self.lock.writes
        with self.lock.read():
            layout = {name: (t.dtype, tuple(t.shape)) for name, t in saved_state_dict(model).items()}
        # The model's own tensor objects, not views: none is held between sections.
        own = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
        tensors = [own[name] for name in layout]
        hashers = [TensorHasher() for _ in layout]

        def hash_slice(index: int, start: int, chunk: torch.Tensor) -> None:
            hashers[index].update(chunk.numpy())

        read_in_sections(self.lock, tensors, writes=writes, what=f"weights {self.held.version}", each=hash_slice)
        digests = [
            TensorDigest(name, dtype_name(dtype), shape, hasher.hexdigest())
            for (name, (dtype, shape)), hasher in zip(layout.items(), hashers, strict=True)
        ]
        result = checksum_from_digests(digests, num_bytes=sum(t.numel() * t.element_size() for t in tensors))
        with self.lock.read():
            if self.lock.writes != writes:
                raise ConflictError("the weights changed while they were hashed")
            self.held = replace(self.held, checksum=result.checksum)
        return result

    async def export(self, request: ExportWeightsRequest) -> ExportWeightsResponse:
        """Write the weights held now as a sealed checkpoint under ``--snapshot-dir``. Raises
        ConflictError when export is not enabled, a change is under way, the weights are
        unverified, or they changed while they were read."""
        snapshot_dir = self._snapshot_dir
        if snapshot_dir is None:
            raise ConflictError(
                "weight export is not enabled on this engine; start it with --snapshot-dir DIR "
                "(the directory exported checkpoints are written under)",
            )

        def export() -> ExportWeightsResponse:
            # Copied in sections, then written without any lock. Not while a change is about to
            # swap: its swap would wait for the copy's read section, and end the copy.
            if not self.lock.wait_for_no_change(EXPORT_WAITS_FOR_CHANGE_S):
                raise ConflictError(
                    f"a weight change has been under way on this engine for over {EXPORT_WAITS_FOR_CHANGE_S:g}s "
                    "(its stage is open); ask again once it has been swapped in or dropped"
                )
            with self.lock.read():
                self.require_verified("exporting")
                held = self.held
                assert held.checksum is not None, "the checksum is recorded before the engine serves"
                writes = self.lock.writes
            names = (self._served_model_name, held.version)
            parts = [re.sub(r"[^A-Za-z0-9._-]", "_", part)[:_MAX_PART_CHARS] or "_" for part in names]
            target = snapshot_dir / "-".join([*parts, held.checksum[:16]])  # <model>-<version>-<checksum[:16]>
            answer = ExportWeightsResponse(
                success=True, path=str(target), checksum=held.checksum, weight_version=held.version
            )
            exported = manifest_or_none(target)
            if exported is not None and exported.checksum == held.checksum:
                return answer  # exported before: nothing to copy, and no room needed
            # Tied weights once, from the model's own tensor objects: a state dict's views of the live
            # memory, alive during a swap, would make the swap refuse.
            own = [*self.model().parameters(), *self.model().buffers()]
            needed = sum({t.data_ptr(): t.numel() * t.element_size() for t in own}.values())
            _require_room(snapshot_dir, needed)
            model = copy_weights(self.model(), self.lock, writes=writes, what=f"weights {held.version}")
            try:
                manifest = save_checkpoint(
                    target,
                    model=model,
                    tokenizer=self._tokenizer,
                    model_name=self._served_model_name,
                    step=request.step,
                    weight_version=held.version,
                    overwrite=target.exists(),
                )
            except Exception:
                _require_room(snapshot_dir, needed)  # a full disk is named as such, not as a bug
                raise
            finally:
                del model
            if manifest.checksum != held.checksum:
                # save_checkpoint already held the files to the live model; a difference here means the
                # engine's record of what it holds is wrong, and a snapshot named after it would lie.
                shutil.rmtree(target, ignore_errors=True)
                raise ChecksumMismatchError(
                    "the exported weights do not hash to the checksum the engine records for them",
                    expected=held.checksum,
                    actual=manifest.checksum,
                    path=str(target),
                )
            return answer

        async with self._export_lock:
            return await asyncio.to_thread(export)


def _require_room(directory: Path, needed: int) -> None:
    """Raises InsufficientStorageError when ``directory``'s file system has under ``needed`` bytes
    free (a checkpoint of the weights needs about as many as they hold)."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())  # made by the write
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise InsufficientStorageError(
            f"no room to write the weights ({needed / 2**20:.0f} MiB) under {directory}: {free / 2**20:.0f} MiB "
            "free; free space there, or start the engine with another --snapshot-dir",
            directory=str(directory),
        )


def copy_weights(model: PreTrainedModel, lock: WeightsLock, *, writes: int, what: str) -> PreTrainedModel:
    """A copy of ``model``, read in short sections of ``lock`` (``read_in_sections``): a change
    waits for one slice, not for the whole copy, and ends it. Raises ConflictError: the weights
    changed since ``writes``."""
    # New, unfilled parameters and buffers (tied ones stay tied), filled from the model's own
    # tensor objects, which add no view of live memory.
    memo: dict[int, Any] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        # Contiguous whatever the live layout: the copy is filled with the bytes in logical order.
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        is_parameter = isinstance(tensor, torch.nn.Parameter)
        memo[id(tensor)] = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad) if is_parameter else empty
        pairs.append((tensor, empty.reshape(-1).view(torch.uint8)))
    copied = copy.deepcopy(model, memo)

    def copy_slice(index: int, start: int, chunk: torch.Tensor) -> None:
        with torch.no_grad():
            pairs[index][1][start : start + chunk.numel()].copy_(chunk)

    read_in_sections(lock, [live for live, _ in pairs], writes=writes, what=what, each=copy_slice)
    return copied


def read_in_sections(
    lock: WeightsLock,
    tensors: Sequence[torch.Tensor],
    *,
    writes: int,
    what: str,
    each: Callable[[int, int, torch.Tensor], None],
) -> None:
    """Call ``each(index, start, chunk)`` for every slice of each tensor's bytes (``chunk`` a flat
    uint8 view of the live bytes from ``start``), each in a read section of its own: a change
    waits for one slice, never for the whole read. ``each`` must not keep ``chunk`` (a swap
    refuses to leave a viewer it does not know on the old weights). ``tensors`` are the model's
    own tensor objects, which a swap re-points: a write between two sections would tear the read.
    Raises ConflictError when ``lock.writes`` is no longer ``writes`` (read with ``what``).
    """
    for index, live in enumerate(tensors):
        nbytes = live.numel() * live.element_size()
        # A tensor that is not contiguous is read whole, in one section.
        step = READ_SECTION_BYTES if live.is_contiguous() else max(nbytes, 1)
        for start in range(0, nbytes, step):
            with lock.read():
                if lock.writes != writes:
                    raise ConflictError(
                        f"the weights changed while they were read ({what} then); ask again to read the ones held now"
                    )
                raw = live.detach().contiguous().reshape(-1).view(torch.uint8)
                each(index, start, raw[start : start + step])
                del raw

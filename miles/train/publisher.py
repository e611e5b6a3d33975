"""Publishing trained weights: the ``Publisher`` protocol and ``DiskPublisher``, its disk reference.

``DiskPublisher.publish`` writes the checkpoint, announces its checksum, waits until the serving
side is ready, then hands the checkpoint to an injected ``apply`` (docs/ARCHITECTURE.md, "The life
of an update").
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from miles.errors import CheckpointError, PublishError, PublishNotReadyError
from miles.utils.audit_utils.event_logger import EventLogger, InferenceEngineWeightChecksumEvent
from miles.weights.checkpoint import Manifest, save_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ApplyFn = Callable[[Path, Manifest], Awaitable[Any]]
"""Load the checkpoint at the path into the servers and verify it; raise on any failure."""

ReadyFn = Callable[[], Awaitable[bool]]
"""True when the serving side can take an update now (e.g. the controller's /health is 200)."""


class PublishResult(BaseModel):
    """One published checkpoint and what publishing it cost."""

    model_config = ConfigDict(frozen=True)

    step: Annotated[int, Field(ge=0)]
    weight_version: str
    checksum: str
    # Where the weights went through: a checkpoint on disk, or pushed from memory (None then, and
    # nothing saved or waited for).
    checkpoint_dir: Path | None = None
    path: str = "disk"
    save_s: float = 0.0
    ready_wait_s: float = 0.0
    apply_s: float
    # Wall time of the whole publish: save, announce, wait for ready, apply.
    latency_s: float


class Publisher(Protocol):
    """Makes the trainer's current weights the ones the servers serve."""

    async def publish(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, step: int) -> PublishResult:
        """Return once the servers serve ``model``'s weights (unchanged meanwhile) as version
        ``step``; PublishError when anything went wrong (they may serve the previous version)."""


async def always_ready() -> bool:
    return True


class DiskPublisher:
    """Publishes checkpoints written under ``root`` as ``step-000042`` directories (version = step),
    keeping the ``keep_last`` newest it wrote (at least two: the one serving and its rollback)."""

    def __init__(
        self,
        root: str | Path,
        *,
        model_name: str,
        event_logger: EventLogger,
        apply: ApplyFn,
        ready: ReadyFn = always_ready,
        keep_last: int = 2,
        ready_timeout_s: float = 120.0,
        ready_poll_s: float = 0.05,
    ) -> None:
        """Raises ``ValueError`` for ``keep_last`` < 2 or a non-positive timeout or poll interval."""
        if keep_last < 2:
            raise ValueError(f"keep_last must be at least 2 (serving + rollback target), got {keep_last}")
        if ready_timeout_s <= 0 or ready_poll_s <= 0:
            raise ValueError("ready_timeout_s and ready_poll_s must be positive")
        self.root = Path(root)
        self._model_name = model_name
        self._events = event_logger
        self._apply = apply
        self._ready = ready
        self._keep_last = keep_last
        self._ready_timeout_s = ready_timeout_s
        self._ready_poll_s = ready_poll_s
        self._written: deque[Path] = deque()

    def checkpoint_dir(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    async def publish(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, step: int) -> PublishResult:
        """Write, announce, wait for ready, apply, prune. Raises PublishError when the checkpoint
        could not be written or ``apply`` failed, PublishNotReadyError when ``ready()`` never said
        yes within ``ready_timeout_s``."""
        started = time.monotonic()
        target = self.checkpoint_dir(step)
        try:
            manifest = await asyncio.to_thread(
                save_checkpoint, target, model=model, tokenizer=tokenizer, model_name=self._model_name, step=step
            )
        except CheckpointError as exc:
            raise PublishError(f"writing the checkpoint failed: {exc.message}", step=step, path=str(target)) from exc
        self._written.append(target)
        saved = time.monotonic()
        # Announce before applying: the controller gates the update on this expected checksum.
        self._events.log(
            InferenceEngineWeightChecksumEvent,
            {
                "model_name": self._model_name,
                "checksum": manifest.checksum,
                "step": step,
                "weight_version": manifest.weight_version,
            },
            print_log=False,
        )
        await self._wait_ready(step=step)
        ready_at = time.monotonic()
        try:
            await self._apply(target, manifest)
        except Exception as exc:
            # ``apply`` is injected (controller, engines, a test double) and may raise anything;
            # re-raise it as one type that says which step and checksum failed.
            raise PublishError(
                f"applying the checkpoint failed: {exc}", step=step, checksum=manifest.checksum, path=str(target)
            ) from exc
        done = time.monotonic()
        while len(self._written) > self._keep_last:
            # A whole checkpoint to unlink: off the loop.
            await asyncio.to_thread(shutil.rmtree, self._written.popleft(), ignore_errors=True)
        return PublishResult(
            step=step,
            weight_version=manifest.weight_version,
            checksum=manifest.checksum,
            checkpoint_dir=target,
            save_s=saved - started,
            ready_wait_s=ready_at - saved,
            apply_s=done - ready_at,
            latency_s=done - started,
        )

    async def _wait_ready(self, *, step: int) -> None:
        deadline = time.monotonic() + self._ready_timeout_s
        while not await self._ready():
            if time.monotonic() >= deadline:
                raise PublishNotReadyError(
                    "the serving side did not become ready; nothing was pushed",
                    step=step,
                    waited_s=self._ready_timeout_s,
                )
            await asyncio.sleep(self._ready_poll_s)

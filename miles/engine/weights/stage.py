"""Whether an update is staged or copied in place (``--weight-staging``), and what the engine
reports about it.

Staging (``weight_stage.py``) costs a second copy of the weights, allocated when the first update
needs it and kept for every later one. ``on`` always stages; ``auto`` stages when that copy fits
in ``--weight-staging-budget`` of the memory available then (host RAM from ``/proc/meminfo``, or
the GPU's free memory), and otherwise copies in place and asks again at the next update; ``off``
always copies in place. A model whose weights cannot be staged, or twins that cannot be
allocated, fall back to the in-place copy too; ``/get_server_info`` says why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from miles.engine.settings import StagingMode
from miles.engine.weights.memory import StagingUnsupportedError
from miles.engine.weights.buffers import StagingBuffers, StagingRefusedError, WeightStage

logger = logging.getLogger("miles.engine")


@dataclass(frozen=True)
class StagingReport:
    """What ``/get_server_info`` says about staging (``weight_staging``)."""

    mode: StagingMode
    budget: float
    # Bytes of one copy of the weights (what staging costs); 0 when they cannot be staged or
    # staging is off.
    weight_bytes: int = 0
    # Bytes allocated for staging now: 0 until the first staged update, then the same for good.
    staging_bytes: int = 0
    # Whether the last update that passed verification was staged (None before any).
    last_update_staged: bool | None = None
    # Why updates are copied in place now, when they are.
    reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "budget": self.budget,
            "weight_bytes": self.weight_bytes,
            "staging_bytes": self.staging_bytes,
            "last_update_staged": self.last_update_staged,
            "reason": self.reason,
        }


class WeightStaging:
    """The staging policy of one engine. ``attach`` runs once on the scheduler thread, the rest
    on the updating worker thread (one update at a time); ``report`` from anywhere."""

    def __init__(self, *, mode: StagingMode, budget: float) -> None:
        self._mode = mode
        self._budget = budget
        self._buffers: StagingBuffers | None = None
        off = mode is StagingMode.OFF
        self._report = StagingReport(mode=mode, budget=budget, reason="--weight-staging off" if off else None)

    def attach(self, model: torch.nn.Module, *, runner_tensors: Iterable[torch.Tensor]) -> None:
        """Find the storages of the loaded model's weights (no memory is allocated yet)."""
        if self._mode is StagingMode.OFF:
            return
        try:
            buffers = StagingBuffers.build(model, runner_tensors=runner_tensors)
        except StagingUnsupportedError as exc:
            logger.warning("weight updates will be copied in place: %s", exc)
            self._report = replace(self._report, reason=f"the weights cannot be staged: {exc}")
            return
        self._buffers = buffers
        self._report = replace(self._report, weight_bytes=buffers.nbytes)

    def open_stage(self) -> WeightStage | None:
        """A stage for the next update, allocating the twins on first use; None means copy in
        place (the report says why)."""
        stage = self._open()
        self._report = replace(self._report, last_update_staged=stage is not None)
        return stage

    def give_up(self, reason: str) -> None:
        """Stop staging for good and free the twins (a swap was refused: see ``WeightStage.activate``)."""
        logger.error("weight updates will be copied in place from now on: %s", reason)
        if self._buffers is not None:
            self._buffers.release()
        self._buffers = None
        self._report = replace(self._report, staging_bytes=0, last_update_staged=False, reason=reason)

    def report(self) -> StagingReport:
        return self._report

    def _open(self) -> WeightStage | None:
        buffers = self._buffers
        if buffers is None:
            return None
        if not buffers.allocated:
            if self._mode is StagingMode.AUTO:
                available = available_memory(buffers.device)
                if available is None or buffers.nbytes > self._budget * available:
                    seen = "unknown" if available is None else f"{available} bytes"
                    self._report = replace(
                        self._report,
                        reason=f"a second copy of the weights ({buffers.nbytes} bytes) does not fit in "
                        f"{self._budget:g} of the available memory ({seen}); raise --weight-staging-budget "
                        "or free memory",
                    )
                    return None
            try:
                buffers.allocate()
            except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                buffers.release()
                logger.warning("could not allocate %d bytes to stage weights: %s", buffers.nbytes, exc)
                self._report = replace(
                    self._report,
                    reason=f"the staging copy ({buffers.nbytes} bytes) could not be allocated: {exc}",
                )
                return None
            self._report = replace(self._report, staging_bytes=buffers.allocated_bytes, reason=None)
        try:
            return buffers.open()
        except StagingRefusedError as exc:
            self.give_up(f"staging was given up: {exc}")
            return None


def available_memory(device: torch.device) -> int | None:
    """Bytes that can be allocated on ``device`` now without pushing anything out, or None when
    unknown: the GPU's free memory, else ``MemAvailable`` (which counts reclaimable page cache),
    else the free pages ``sysconf`` reports."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass  # not Linux, or an unexpected format: ask sysconf
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None

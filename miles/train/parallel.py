"""How one trainer's work is split over processes: ``Parallelism``, which ``Trainer`` is given.

Every rank must run the same steps in the same order: FSDP2's gathers, the gradient norm's
all-reduce and the publisher's collectives all wait for every rank.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from miles.errors import TrainerError
from miles.train.reports import StepReport

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Parallelism(Protocol):
    """Where this trainer process stands among the processes that train one model together."""

    @property
    def rank(self) -> int:
        """This process's index; rank 0 reports the steps."""

    @property
    def world_size(self) -> int:
        """How many processes train the model."""

    def shard(self, model: PreTrainedModel) -> PreTrainedModel:
        """The model this process trains, made from the whole freshly built one (in place)."""

    async def combine(self, report: StepReport) -> StepReport:
        """On rank 0, the whole step's report from every rank's; on the others, their own. Called
        by every rank after every step; TrainerError when a rank did not take part in time."""


def share(count: int, *, rank: int, world_size: int) -> int:
    """How many of ``count`` items (prompts, rows of a batch) rank ``rank`` takes: an equal share,
    the first ``count % world_size`` ranks one more."""
    return count // world_size + (1 if rank < count % world_size else 0)


@dataclass(frozen=True)
class SingleProcess:
    """One process trains the whole model on the whole batch."""

    rank: int = 0
    world_size: int = 1

    def shard(self, model: PreTrainedModel) -> PreTrainedModel:
        return model

    async def combine(self, report: StepReport) -> StepReport:
        return report


class FSDP2DataParallel:
    """This process is one FSDP2 data-parallel rank. Make it on every rank, at the same point,
    after ``torch.distributed`` is initialised (it forms a group of its own, bounded by ``timeout_s``)."""

    def __init__(self, *, timeout_s: float = 120.0) -> None:
        if not dist.is_initialized():
            raise TrainerError("FSDP2DataParallel needs torch.distributed initialised (torchrun, init_process_group)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def shard(self, model: PreTrainedModel) -> PreTrainedModel:
        # Each decoder layer is a unit of its own, so a rank holds one layer's full parameters at
        # a time in forward and backward; the root unit takes the rest (embeddings, norm, head).
        for layer in model.get_decoder().layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    async def combine(self, report: StepReport) -> StepReport:
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        try:
            await asyncio.to_thread(dist.gather_object, report, gathered, dst=0, group=self._group)
        except (RuntimeError, dist.DistError) as exc:
            raise TrainerError(
                f"rank {self.rank}: the trainer's ranks did not all report step {report.step} within "
                f"{self.timeout_s:g}s (a rank died or fell behind): {exc}"
            ) from None
        return report if gathered is None else StepReport.combined(gathered)

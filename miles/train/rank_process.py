"""``python -m miles.train.rank_process``: one rank of a trainer split over processes.

It finds its peers as ``torchrun`` tells them, so ``torchrun`` runs it too; ``TrainerRanks`` starts
it from a process that wants its reports (rank 0 writes them to ``--report-fd``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
from asyncio.streams import FlowControlMixin
from datetime import timedelta
from typing import Annotated

import httpx
import torch.distributed as dist
import typer

from miles.train.parallel import FSDP2DataParallel
from miles.train.ranks import RankFailed, RankSpec, RankStep, TrainingDone
from miles.train.sampling import HttpSampler
from miles.train.sharded import ShardedPublisher
from miles.train.trainer import Trainer
from miles.utils.lifetime import exit_when_gone
from miles.utils.progress_bars import disable_library_progress_bars

logger = logging.getLogger("miles.train")

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _client_headers() -> dict[str, str] | None:
    """The controller's API key, else its admin token (it reads both from this environment too)."""
    token = os.environ.get("MILES_API_KEY", "").strip() or os.environ.get("MILES_ADMIN_TOKEN", "").strip()
    return {"authorization": f"Bearer {token}"} if token else None


class _ReportPipe:
    """Rank 0's end of the report pipe: one JSON line per message, written without blocking the
    loop (a full pipe buffers here until the reader takes it)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.connect_write_pipe(FlowControlMixin, io.FileIO(self._fd, "wb"))
        # ``drain`` then waits until every byte is in the pipe, not just most of them.
        transport.set_write_buffer_limits(high=0)
        self._writer = asyncio.StreamWriter(transport, protocol, None, loop)

    def send(self, message: RankStep | TrainingDone | RankFailed) -> None:
        assert self._writer is not None, "connect first"
        self._writer.write(message.model_dump_json().encode() + b"\n")

    async def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()
            self._writer.transport.close()


async def _train(
    trainer: Trainer, *, http: httpx.AsyncClient, publisher: ShardedPublisher, report: _ReportPipe | None
) -> None:
    if report is not None:
        await report.connect()
    try:
        async with http:
            summary = await trainer.run()
        if report is not None:
            report.send(TrainingDone(summary=summary))
    except BaseException as exc:
        if report is not None:
            report.send(RankFailed(error=f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        await publisher.close()
        if report is not None:
            await report.close()


@cli.command()
def main(
    spec: Annotated[str, typer.Option(help="The RankSpec, as JSON (the same on every rank).")],
    parent_pid: Annotated[int | None, typer.Option(help="End when this process ends.")] = None,
    report_fd: Annotated[int | None, typer.Option(help="Rank 0: write its reports here, a JSON line each.")] = None,
) -> None:
    """Run one trainer rank to the end of its training."""
    if parent_pid is not None:
        exit_when_gone(parent_pid)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    disable_library_progress_bars()
    config = RankSpec.model_validate_json(spec)
    # Bounded like every collective of the trainer: a peer that died fails this rank in
    # ``timeout_s`` rather than the default half an hour.
    dist.init_process_group("gloo", timeout=timedelta(seconds=config.timeout_s))
    # Made before the event loop runs: the groups of their own that the parallelism and the
    # publisher form (in the same order on every rank) rendezvous through the store, and building
    # the model imports and reads files; none of it may block a running loop.
    parallel = FSDP2DataParallel(timeout_s=config.timeout_s)
    publisher = ShardedPublisher(
        config.controller_url, model_name=config.trainer.model_name, path=config.transfer, timeout_s=config.timeout_s
    )
    report = _ReportPipe(report_fd) if report_fd is not None and parallel.rank == 0 else None
    http = httpx.AsyncClient(trust_env=False, timeout=config.request_timeout_s, headers=_client_headers())
    trainer = Trainer(
        config.trainer,
        sampler=HttpSampler([config.controller_url], http=http, timeout_s=config.request_timeout_s),
        publisher=publisher,
        on_step=None if report is None else lambda step: report.send(RankStep(report=step)),
        parallel=parallel,
    )
    try:
        asyncio.run(_train(trainer, http=http, publisher=publisher, report=report))
    except BaseException:
        logger.exception("trainer rank %d failed", parallel.rank)
        raise SystemExit(1) from None
    dist.destroy_process_group()


if __name__ == "__main__":
    cli()

"""A trainer split over rank processes on this machine: ``TrainerRanks`` starts them, relays what
rank 0 reports (JSON lines, ``RankMessage``, on a pipe), and ends them (docs/ARCHITECTURE.md,
"Processes and threads", Trainer ranks).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from miles.config import TransferPath
from miles.errors import TrainerRankError
from miles.rollout.engine_process import free_port
from miles.train.config import TrainerConfig
from miles.train.reports import StepReport, TrainingSummary
from miles.train.trainer import OnStep

# The summary line carries every step's report: far longer than a step's.
_LINE_LIMIT = 64 * 1024 * 1024
_LOG_TAIL_LINES = 8


class RankSpec(BaseModel):
    """What every rank is told (the same on each): what to train, and where the fleet is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trainer: TrainerConfig
    # The controller's HTTP API: the ranks sample through it and publish to it.
    controller_url: str
    # How rank 0's buckets reach the engines (the sharded publisher pushes from memory).
    transfer: TransferPath = TransferPath.AUTO
    # Every collective of the ranks (training, reports, publishing) fails past this.
    timeout_s: Annotated[float, Field(gt=0)] = 120.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 300.0

    @field_validator("transfer")
    @classmethod
    def _from_memory(cls, value: TransferPath) -> TransferPath:
        if value is TransferPath.DISK:
            raise ValueError(
                "sharded ranks publish from memory (each rank pushes its own shards); choose auto, shm or distributed"
            )
        return value


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True)


class RankStep(_Message):
    """A whole step, as rank 0 combined it from every rank's share."""

    kind: Literal["step"] = "step"
    report: StepReport


class TrainingDone(_Message):
    """Every step is trained and published."""

    kind: Literal["done"] = "done"
    summary: TrainingSummary


class RankFailed(_Message):
    """Rank 0 stopped on an error (the other ranks stop with it)."""

    kind: Literal["failed"] = "failed"
    error: str


RankMessage = Annotated[RankStep | TrainingDone | RankFailed, Field(discriminator="kind")]
_MESSAGES: TypeAdapter[RankStep | TrainingDone | RankFailed] = TypeAdapter(RankMessage)


@dataclass
class _Rank:
    index: int
    process: asyncio.subprocess.Process
    log: Path
    exited: asyncio.Task[int] = field(init=False)

    def __post_init__(self) -> None:
        self.exited = asyncio.create_task(self.process.wait(), name=f"trainer-rank-{self.index}")

    def how_it_ended(self) -> str:
        code = self.process.returncode
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def log_tail(self) -> str:
        try:
            lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "(no log)"
        return "\n".join(f"  {line}" for line in lines[-_LOG_TAIL_LINES:]) or "  (empty)"


@dataclass
class _Launch:
    """The rendezvous port, the report pipe and each rank's log (descriptors this process closes
    once the ranks have theirs)."""

    port: int
    read_end: int
    write_end: int
    logs: list[tuple[Path, int]]

    @classmethod
    def prepare(cls, log_dir: Path, world_size: int) -> _Launch:
        log_dir.mkdir(parents=True, exist_ok=True)
        paths = [log_dir / f"trainer-rank-{index}.log" for index in range(world_size)]
        logs = [(log, os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)) for log in paths]
        read_end, write_end = os.pipe()
        return cls(port=free_port(), read_end=read_end, write_end=write_end, logs=logs)

    def close_write_end(self) -> None:
        if self.write_end >= 0:
            os.close(self.write_end)
            self.write_end = -1

    def take_read_end(self) -> io.FileIO:
        """The read end as a file, owned by the caller from now on."""
        pipe = io.FileIO(self.read_end, "rb")
        self.read_end = -1
        return pipe

    def close(self) -> None:
        self.close_write_end()
        if self.read_end >= 0:
            os.close(self.read_end)
            self.read_end = -1
        for _, fd in self.logs:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.logs = []


class TrainerRanks:
    """``world_size`` rank processes training ``spec.trainer`` together; ``run`` as ``Trainer.run``."""

    def __init__(
        self, spec: RankSpec, *, world_size: int, log_dir: Path, on_step: OnStep | None = None, grace_s: float = 5.0
    ) -> None:
        """``log_dir`` gets each rank's output; ``grace_s``: how long a rank has to end on SIGTERM,
        and a failure waits for rank 0 to say why. Raises ValueError for fewer than 2 ranks."""
        if world_size < 2:
            raise ValueError(f"TrainerRanks runs 2 or more ranks, got {world_size}; train in this process instead")
        self.spec, self.world_size, self.log_dir = spec, world_size, log_dir
        self._on_step = on_step
        self._grace_s = grace_s

    async def run(self) -> TrainingSummary:
        """Train to the end and return rank 0's summary, with ``on_step`` called for each step as
        rank 0 reports it; every rank has ended when this returns or raises. Raises
        TrainerRankError when a rank could not start, failed or died, or rank 0 gave no summary."""
        launch = await asyncio.to_thread(_Launch.prepare, self.log_dir, self.world_size)
        ranks: list[_Rank] = []
        transport: asyncio.BaseTransport | None = None
        try:
            for index in range(self.world_size):
                ranks.append(await self._start(index, launch))
            # Only rank 0 holds the write end now: the pipe ends when it does.
            launch.close_write_end()
            reader = asyncio.StreamReader(limit=_LINE_LIMIT)
            transport, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), launch.take_read_end()
            )
            return await self._follow(ranks, reader)
        finally:
            launch.close()
            await self._end(ranks)
            if transport is not None:
                transport.close()

    async def _start(self, index: int, launch: _Launch) -> _Rank:
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(launch.port),
            "RANK": str(index),
            "LOCAL_RANK": str(index),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "OMP_NUM_THREADS": str(self.spec.trainer.num_threads),
        }
        command = [sys.executable, "-m", "miles.train.rank_process", "--spec", self.spec.model_dump_json()]
        command += ["--parent-pid", str(os.getpid())]
        if index == 0:
            command += ["--report-fd", str(launch.write_end)]
        log, out = launch.logs[index]
        try:
            # A session of its own: a Ctrl-C in the terminal reaches this process, which ends the
            # ranks itself (they would otherwise die mid-collective in any order).
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                pass_fds=(launch.write_end,) if index == 0 else (),
                start_new_session=True,
            )
        except OSError as exc:
            raise TrainerRankError(f"could not start trainer rank {index}: {exc}", log=str(log)) from exc
        return _Rank(index, process, log)

    async def _follow(self, ranks: list[_Rank], reader: asyncio.StreamReader) -> TrainingSummary:
        """Relay rank 0's messages until every rank exited; raise as soon as one fails."""
        done: TrainingDone | None = None
        failed: RankFailed | None = None

        async def read() -> None:
            nonlocal done, failed
            while line := await reader.readline():
                try:
                    message = _MESSAGES.validate_json(line)
                except ValidationError as exc:
                    raise TrainerRankError(f"trainer rank 0 reported something unreadable: {exc}") from None
                if isinstance(message, RankStep):
                    if self._on_step is not None:
                        self._on_step(message.report)
                elif isinstance(message, TrainingDone):
                    done = message
                else:
                    failed = message

        reading = asyncio.create_task(read(), name="trainer-rank-0-reports")
        try:
            running = {rank.exited: rank for rank in ranks}
            pending: set[asyncio.Task[Any]] = {reading, *running}
            while running:
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if reading in finished:
                    reading.result()  # raises what made the reports unreadable
                dead = [running.pop(task) for task in finished if task in running]
                bad = [rank for rank in dead if rank.process.returncode != 0]
                if bad:
                    # Rank 0 may still be saying why (a rank that stops on its error makes the
                    # others stop too): give it a moment, then report.
                    await asyncio.wait([reading, *running], timeout=self._grace_s)
                    raise await asyncio.to_thread(self._failure, ranks, failed, first=bad[0])  # reads the logs
            # Every rank exited 0: rank 0's last lines are in the pipe, or on their way.
            await asyncio.wait_for(reading, timeout=self._grace_s)
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
        if done is None:
            raise TrainerRankError(
                "trainer rank 0 ended without reporting a summary" + (f": {failed.error}" if failed else ""),
                log=str(ranks[0].log),
            )
        return done.summary

    def _failure(self, ranks: list[_Rank], failed: RankFailed | None, *, first: _Rank) -> TrainerRankError:
        """Why the run failed, ``first`` being the first rank seen to end badly: a rank killed by a
        signal (the others fail because it left their collectives), else rank 0 when it said why."""
        ended = [r for r in ranks if r.process.returncode not in (None, 0)]
        killed = [r for r in ended if (r.process.returncode or 0) < 0]
        if killed:
            blamed = first if first in killed else killed[0]
        elif failed is not None:
            blamed = ranks[0]
        else:
            blamed = first
        others = [f"rank {r.index} {r.how_it_ended()}" for r in ended if r is not blamed]
        said = f' (rank 0 reported "{failed.error}")' if failed else ""
        return TrainerRankError(
            f"the trainer's rank {blamed.index} {blamed.how_it_ended()}"
            + (f"; then {', '.join(others)}" if others else "")
            + f"{said}; the other ranks were stopped. The end of {blamed.log}:\n{blamed.log_tail()}"
        )

    async def _end(self, ranks: list[_Rank]) -> None:
        alive = [r for r in ranks if r.process.returncode is None]
        for rank in alive:
            with contextlib.suppress(ProcessLookupError):
                rank.process.terminate()
        if alive:
            await asyncio.wait([r.exited for r in alive], timeout=self._grace_s)
        for rank in alive:
            if rank.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    rank.process.kill()
        # Reaped whatever happens, so no rank is left a zombie; shielded so that a second
        # cancellation (a second Ctrl-C) cannot leave one unreaped.
        await asyncio.shield(asyncio.gather(*(r.exited for r in ranks), return_exceptions=True))

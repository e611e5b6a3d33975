"""Continuous batching: one thread that admits requests, samples, and steps the running batch.

The scheduler thread is the only code that touches the running batch and, under the read side of
the ``WeightsLock``, the only code that runs the model. Other threads talk to it through
``submit``, ``abort``, ``pause`` and ``resume``, which change shared state under one condition
variable; actions on running sequences (abort, retract) are carried out by the scheduler thread at
the top of its next iteration, because it alone owns the batch.

New requests join the running batch at the next step (their prompts are prefilled as a group and
the KV caches merged), and finished requests leave it at once.

One torch thread: the scheduler thread also loads the model and runs every other parallel torch
operation of the engine (the weight copy, through ``call``). Each thread that runs a parallel
torch op gets its own OpenMP team, and once a second team exists the decode steps of the first
slow down by more than half on a small machine (measured: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, TypeVar

import torch

from miles.engine.model_runner import ModelRunner
from miles.engine.rwlock import WeightsLock
from miles.engine.sampling import RowSampler, sample_batch
from miles.protocol.sglang import FinishReason, GenerateMetaInfo, GenerateResponse, PauseMode

logger = logging.getLogger("miles.engine")

T = TypeVar("T")


class GenerationState(Enum):
    """Whether new requests start and whether running ones advance."""

    SERVING = "serving"  # admit and step
    PAUSED = "paused"  # no admission; the running batch (if any) steps to completion
    HELD = "held"  # no admission, no stepping: running requests wait in place


class ResultSink(Protocol):
    """Where a sequence's progress and final result go (called from the scheduler thread)."""

    def progress(self, snapshot: GenerateResponse) -> None: ...

    def finish(self, response: GenerateResponse) -> None: ...


class Detokenizer(Protocol):
    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str: ...


@dataclass(eq=False)
class Sequence:
    """One generation request as the scheduler tracks it (mutable; scheduler-owned once running)."""

    rid: str
    prompt_ids: list[int]
    sampler: RowSampler
    sink: ResultSink
    stream: bool = False
    top_logprobs: int = 0
    return_logprob: bool = False
    arrived: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)
    version_start: str | None = None
    version_end: str | None = None

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True)
class SchedulerStats:
    state: GenerationState
    waiting: int
    running: int
    steps: int
    tokens_generated: int


class Scheduler:
    """Owns the waiting queue and the running batch; see the module docstring for the threading."""

    def __init__(
        self,
        *,
        setup: Callable[[], ModelRunner],
        detokenizer: Detokenizer,
        weights_lock: WeightsLock,
        weight_version: Callable[[], str],
        max_running_requests: int,
    ) -> None:
        # Built on the scheduler thread: see "one torch thread" in the module docstring.
        self._setup = setup
        self._runner: ModelRunner | None = None
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._jobs: deque[tuple[Callable[[], object], Future[object]]] = deque()
        self._detokenizer = detokenizer
        self._weights_lock = weights_lock
        self._weight_version = weight_version
        self._max_running = max_running_requests
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._rows: list[Sequence] = []  # scheduler thread only
        self._running_count = 0  # len(self._rows), readable by other threads under _cond
        self._batch: object | None = None  # the runner's KV state of self._rows
        self._logits: torch.Tensor | None = None
        self._state = GenerationState.SERVING
        self._pending_aborts: list[tuple[str | None, str]] = []  # (rid or None for all, message)
        self._pending_retract = False
        self._in_step = False
        self._stopping = False
        self._steps = 0
        self._tokens = 0
        self._thread = threading.Thread(target=self._run, name="miles-scheduler", daemon=True)

    # --- control, called from other threads ------------------------------------------------

    def start(self, *, timeout: float | None = None) -> None:
        """Start the thread, which builds the model runner first; returns once it is built.

        Raises whatever building the runner raised (a missing or broken checkpoint).
        """
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the model was not loaded within {timeout}s")
        if self._setup_error is not None:
            raise self._setup_error

    def call(self, job: Callable[[], T]) -> T:
        """Run ``job`` on the scheduler thread between two steps and return its result.

        Blocks the calling thread; never call it from the scheduler thread itself.
        """
        future: Future[object] = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the scheduler is stopping")
            self._jobs.append((job, future))
            self._cond.notify_all()
        return future.result()  # type: ignore[return-value]

    def stop(self, *, message: str = "server shutting down") -> None:
        with self._cond:
            self._stopping = True
            self._pending_aborts.append((None, message))
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, sequence: Sequence) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the scheduler is stopping")
            self._waiting.append(sequence)
            self._cond.notify_all()

    def abort(self, rid: str | None, *, message: str) -> int:
        """Abort one request (or every one when ``rid`` is None); returns how many were found."""
        with self._cond:
            found = self._abort_waiting(rid, message)
            running = [s for s in self._rows if rid is None or s.rid == rid]
            if running:
                self._pending_aborts.append((rid, message))
                self._cond.notify_all()
            return found + len(running)

    def pause(
        self, mode: PauseMode, *, timeout: float | None = None, message: str = "aborted by pause_generation"
    ) -> int:
        """Stop admitting requests and deal with in-flight ones as ``mode`` says.

        Returns when the mode's promise holds: ``drain`` once the running batch finished,
        ``abort``/``retract`` once it was emptied, ``in_place`` once no step is running.
        Returns the number of requests that were in flight.
        """
        with self._cond:
            in_flight = self._running_count + len(self._waiting)
            if mode is PauseMode.IN_PLACE:
                self._state = GenerationState.HELD
                done = lambda: not self._in_step  # noqa: E731
            else:
                self._state = GenerationState.PAUSED
                if mode is PauseMode.ABORT:
                    self._abort_waiting(None, message)
                    self._pending_aborts.append((None, message))
                elif mode is PauseMode.RETRACT:
                    self._pending_retract = True
                done = lambda: self._running_count == 0 and not self._in_step  # noqa: E731
            self._cond.notify_all()
            if not self._cond.wait_for(done, timeout=timeout):
                raise TimeoutError(f"pause({mode.value}) did not complete within {timeout}s")
            return in_flight

    def resume(self) -> None:
        with self._cond:
            self._state = GenerationState.SERVING
            self._cond.notify_all()

    @property
    def state(self) -> GenerationState:
        with self._cond:
            return self._state

    def stats(self) -> SchedulerStats:
        with self._cond:
            return SchedulerStats(
                state=self._state,
                waiting=len(self._waiting),
                running=self._running_count,
                steps=self._steps,
                tokens_generated=self._tokens,
            )

    # --- the scheduler thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._runner = self._setup()
        except BaseException as exc:  # reported to start(), which re-raises it in the caller
            self._setup_error = exc
            self._ready.set()
            return
        self._ready.set()
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                jobs, self._jobs = list(self._jobs), deque()
            # Jobs (a weight copy) run between steps, on this thread, in any generation state.
            for job, future in jobs:
                try:
                    future.set_result(job())
                except BaseException as exc:  # handed to the caller waiting in call()
                    future.set_exception(exc)
            with self._cond:
                if self._stopping and not self._pending_aborts:
                    for _, future in self._jobs:
                        future.set_exception(RuntimeError("the scheduler stopped"))
                    self._jobs.clear()
                    return
                if not self._has_work():
                    continue
                aborts, self._pending_aborts = self._pending_aborts, []
                retract, self._pending_retract = self._pending_retract, False
                may_step = self._state is not GenerationState.HELD
                admitted: list[Sequence] = []
                if self._state is GenerationState.SERVING:
                    while self._waiting and len(self._rows) + len(admitted) < self._max_running:
                        admitted.append(self._waiting.popleft())
                self._in_step = True
            try:
                self._apply_actions(aborts, retract=retract)
                if may_step and (admitted or self._rows):
                    with self._weights_lock.read():
                        self._step(admitted)
            except Exception:
                # The loop must survive a failing forward (e.g. out of memory): fail the batch's
                # requests with the error instead of leaving their callers waiting forever.
                logger.exception("generation step failed; aborting the running batch")
                self._fail_all(admitted, "generation failed inside the engine; see the server log")
            finally:
                with self._cond:
                    self._in_step = False
                    self._running_count = len(self._rows)
                    self._cond.notify_all()

    def _has_work(self) -> bool:
        if self._stopping or self._pending_aborts or self._pending_retract or self._jobs:
            return True
        if self._state is GenerationState.HELD:
            return False
        admit = self._state is GenerationState.SERVING and bool(self._waiting)
        return admit or bool(self._rows)

    def _abort_waiting(self, rid: str | None, message: str) -> int:
        hits = [s for s in self._waiting if rid is None or s.rid == rid]
        for seq in hits:
            self._waiting.remove(seq)
            seq.version_start = seq.version_end = self._weight_version()
            self._finish(seq, FinishReason(type="abort", message=message), interrupted=True)
        return len(hits)

    def _apply_actions(self, aborts: list[tuple[str | None, str]], *, retract: bool) -> None:
        for rid, message in aborts:
            if rid is None:
                with self._cond:
                    self._abort_waiting(None, message)
            self._drop_rows(
                lambda s, rid=rid: rid is None or s.rid == rid,
                FinishReason(type="abort", message=message),
            )
        if retract:
            self._drop_rows(
                lambda s: True,
                FinishReason(type="abort", message="retracted by pause_generation; resubmit to continue"),
            )

    def _drop_rows(self, predicate: Callable[[Sequence], bool], reason: FinishReason) -> None:
        leaving = [s for s in self._rows if predicate(s)]
        for seq in leaving:
            self._finish(seq, reason, interrupted=True)
        self._keep([i for i, s in enumerate(self._rows) if s not in leaving])

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._batch, self._logits = [], None, None
            return
        assert self._runner is not None and self._batch is not None and self._logits is not None
        self._batch = self._runner.select(self._batch, keep)
        self._logits = self._logits[keep]
        self._rows = [self._rows[i] for i in keep]

    def _step(self, admitted: list[Sequence]) -> None:
        version = self._weight_version()
        if admitted:
            self._admit(admitted, version)
        if not self._rows:
            return
        assert self._logits is not None and self._batch is not None
        sampled = sample_batch(
            self._logits,
            [s.sampler for s in self._rows],
            histories=[s.history if s.sampler.needs_penalties else [] for s in self._rows],
            output_lengths=[len(s.output_ids) for s in self._rows],
            want_logprobs=[s.return_logprob for s in self._rows],
            top_logprobs=[s.top_logprobs for s in self._rows],
        )
        keep: list[int] = []
        for row, seq in enumerate(self._rows):
            seq.output_ids.append(sampled.tokens[row])
            logprob = sampled.logprobs[row]
            if logprob is not None:
                seq.logprobs.append(logprob)
            if seq.top_logprobs:
                seq.top.append(sampled.top[row])
            reason = self._stop_reason(seq)
            if reason is not None:
                self._finish(seq, reason)
            else:
                keep.append(row)
                if seq.stream:
                    seq.sink.progress(self._response(seq, None, interrupted=False))
        self._tokens += len(self._rows)
        next_tokens = [self._rows[i].output_ids[-1] for i in keep]
        self._keep(keep)
        if self._rows:
            assert self._runner is not None
            self._logits = self._runner.decode(self._batch, next_tokens)
            for seq in self._rows:
                seq.version_end = version
        self._steps += 1

    def _admit(self, admitted: list[Sequence], version: str) -> None:
        ready: list[Sequence] = []
        for seq in admitted:
            seq.version_start = seq.version_end = version
            if seq.sampler.params.max_new_tokens == 0:
                self._finish(seq, FinishReason(type="length", length=0))
            else:
                ready.append(seq)
        if not ready:
            return
        assert self._runner is not None
        batch, logits = self._runner.prefill([s.prompt_ids for s in ready])
        if self._batch is None:
            self._batch, self._logits = batch, logits
        else:
            assert self._logits is not None
            self._batch = self._runner.merge(self._batch, batch)
            self._logits = torch.cat([self._logits, logits], dim=0)
        self._rows.extend(ready)

    def _stop_reason(self, seq: Sequence) -> FinishReason | None:
        params = seq.sampler.params
        last = seq.output_ids[-1]
        if len(seq.output_ids) >= params.min_new_tokens:
            if last in seq.sampler.stop_ids:
                return FinishReason(type="stop", matched=last)
            if params.stop_strings:
                text = self._text(seq)
                for stop in params.stop_strings:
                    if stop in text:
                        return FinishReason(type="stop", matched=stop)
        if len(seq.output_ids) >= params.max_new_tokens:
            return FinishReason(type="length", length=len(seq.output_ids))
        return None

    def _text(self, seq: Sequence) -> str:
        return self._detokenizer.decode(seq.output_ids, skip_special_tokens=seq.sampler.params.skip_special_tokens)

    def _finish(self, seq: Sequence, reason: FinishReason, *, interrupted: bool = False) -> None:
        seq.sink.finish(self._response(seq, reason, interrupted=interrupted))

    def _response(self, seq: Sequence, reason: FinishReason | None, *, interrupted: bool) -> GenerateResponse:
        params = seq.sampler.params
        text = self._text(seq)
        if reason is not None and reason.type == "stop" and not params.no_stop_trim:
            # Like SGLang, the text excludes what stopped it (unless no_stop_trim); output_ids keep it.
            if isinstance(reason.matched, str):
                text = text[: text.index(reason.matched)]
            else:
                text = self._detokenizer.decode(seq.output_ids[:-1], skip_special_tokens=params.skip_special_tokens)
        start = seq.version_start or self._weight_version()
        end = seq.version_end or start
        logprobs = None
        top = None
        if seq.return_logprob:
            logprobs = [(lp, tok, None) for lp, tok in zip(seq.logprobs, seq.output_ids)]
            if seq.top_logprobs:
                top = [[(lp, tok, None) for lp, tok in pairs] for pairs in seq.top]
        return GenerateResponse(
            text=text,
            output_ids=list(seq.output_ids),
            meta_info=GenerateMetaInfo(
                id=seq.rid,
                finish_reason=reason,
                prompt_tokens=len(seq.prompt_ids),
                completion_tokens=len(seq.output_ids),
                e2e_latency=time.monotonic() - seq.arrived,
                weight_version=end,
                weight_version_start=start,
                weight_version_end=end,
                interrupted=interrupted,
                output_token_logprobs=logprobs,
                output_top_logprobs=top,
            ),
        )

    def _fail_all(self, admitted: list[Sequence], message: str) -> None:
        reason = FinishReason(type="abort", message=message)
        for seq in {id(s): s for s in [*self._rows, *admitted]}.values():
            self._finish(seq, reason, interrupted=True)
        self._rows, self._batch, self._logits = [], None, None

"""Continuous batching: one thread that admits requests, samples, and steps the running batch.

The scheduler thread is the only code that touches the running batch and, under the read side of
the ``WeightsLock``, the only code that runs the model. Other threads talk to it through
``submit``, ``abort``, ``pause`` and ``resume``, which change shared state under one condition
variable; actions on running sequences (abort, retract) are carried out by the scheduler thread at
the top of its next iteration, because it alone owns the batch. A failure inside a step fails
only the rows that cause it, and this thread runs every parallel torch operation of the engine
(the weight copy, through ``call``): docs/ENGINE.md, "One request never costs the others" and
"One torch thread".
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

import torch

from miles.engine.model_runner import ModelRunner
from miles.engine.sampling import SamplingFailure, sample_rows
from miles.engine.sequence import Detokenizer, Sequence
from miles.engine.weights.lock import WeightsLock
from miles.protocol.sglang import FinishReason, GenerateResponse, PauseMode

logger = logging.getLogger("miles.engine")

T = TypeVar("T")


class GenerationState(Enum):
    """Whether new requests start and whether running ones advance."""

    SERVING = "serving"  # admit and step
    PAUSED = "paused"  # no admission; the running batch (if any) steps to completion
    HELD = "held"  # no admission, no stepping: running requests wait in place


class Pauser(Enum):
    """Who paused generation, and so who gives it back."""

    CALLER = "caller"  # /pause_generation (or an update told to keep it paused); /continue_generation resumes
    # A weight change: the change that leaves the weights verified resumes (one that leaves them
    # unverified keeps generation paused for the next).
    UPDATE = "update"


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
        self._loaded: Future[None] = Future()  # done once the runner is built, or failed to build
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
        # True when the KV state was dropped after a failure: the next step rebuilds it from the
        # rows' histories before anything else runs (under the weights lock).
        self._needs_rebuild = False
        self._state = GenerationState.SERVING
        self._paused_by = Pauser.CALLER  # who moved _state off SERVING, while it is
        self._pending_aborts: list[tuple[str | None, str]] = []  # (rid or None for all, message)
        self._pending_retract = False
        self._in_step = False
        self._stopping = False
        self._steps = 0
        self._tokens = 0
        self._thread = threading.Thread(target=self._run, name="miles-scheduler", daemon=True)

    # --- control, called from other threads ------------------------------------------------

    def start(self, *, timeout: float | None = None) -> None:
        """Start the thread and return once it built the model runner; raises what building it
        raised (a missing or broken checkpoint)."""
        self._thread.start()
        if not wait([self._loaded], timeout).done:
            raise TimeoutError(f"the model was not loaded within {timeout}s")
        self._loaded.result()

    def call(self, job: Callable[[], T]) -> T:
        """Run ``job`` on the scheduler thread between two steps and return its result (blocking:
        never call it from the scheduler thread itself)."""
        future: Future[object] = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the scheduler is stopping")
            self._jobs.append((job, future))
            self._cond.notify_all()
        return future.result()  # type: ignore[return-value]

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._pending_aborts.append((None, "server shutting down"))
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, sequence: Sequence) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the scheduler is stopping")
            self._waiting.append(sequence)
            self._cond.notify_all()

    def abort(self, rid: str | None, *, message: str) -> int:
        """Abort one request (or every one when ``rid`` is None), running, waiting or retracted;
        returns how many were found. Each answers with its partial output, marked interrupted."""
        with self._cond:
            found = self._abort_waiting(rid, message)
            running = [s for s in self._rows if rid is None or s.rid == rid]
            if running:
                self._pending_aborts.append((rid, message))
                self._cond.notify_all()
            return found + len(running)

    def pause(
        self, mode: PauseMode, *, by: Pauser = Pauser.CALLER, message: str = "aborted by pause_generation"
    ) -> int:
        """Stop admitting requests and deal with in-flight ones as ``mode`` says; generation that
        was serving is paused ``by`` (whoever paused it first keeps it).

        Returns when the mode's promise holds: ``drain`` once the running batch finished,
        ``abort`` once it was emptied, ``retract`` once its rows went back to the front of the
        queue (to continue, re-prefilled, after ``resume``), ``in_place`` once no step is running.
        Returns the number of requests that were in flight.
        """
        with self._cond:
            in_flight = self._running_count + len(self._waiting)
            in_place = mode is PauseMode.IN_PLACE
            if self._state is GenerationState.SERVING:
                self._paused_by = by
            if in_place:
                self._state = GenerationState.HELD
            else:
                self._state = GenerationState.PAUSED
                if mode is PauseMode.ABORT:
                    self._abort_waiting(None, message)
                    self._pending_aborts.append((None, message))
                elif mode is PauseMode.RETRACT:
                    self._pending_retract = True
            self._cond.notify_all()
            # in_place waits for the running step only; the other modes for the batch to empty.
            self._cond.wait_for(lambda: not self._in_step and (in_place or self._running_count == 0))
            return in_flight

    def resume(self, *, paused_by: Pauser | None = None) -> None:
        """Serve again; with ``paused_by``, only if that is who paused generation."""
        with self._cond:
            if paused_by is None or self._paused_by is paused_by:
                self._state = GenerationState.SERVING
                self._cond.notify_all()

    @property
    def state(self) -> GenerationState:
        with self._cond:
            return self._state

    def waiting(self) -> int:
        """Sequences waiting for a row now (read without the lock: it is one length, and the event
        loop that asks must not wait for a step)."""
        return len(self._waiting)

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
        except BaseException as exc:  # noqa: BLE001  # reported to start(), which re-raises it in the caller
            self._loaded.set_exception(exc)
            return
        self._loaded.set_result(None)
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                jobs, self._jobs = list(self._jobs), deque()
            # Jobs (a weight copy) run between steps, on this thread, in any generation state.
            for job, future in jobs:
                try:
                    future.set_result(job())
                except BaseException as exc:  # noqa: BLE001  # handed to the caller waiting in call()
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
                # Last resort, should the isolation in _step itself fail: the loop must survive,
                # and no caller may be left waiting forever.
                logger.exception("generation step failed outside per-request isolation; aborting the running batch")
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
        return bool(self._rows) or (self._state is GenerationState.SERVING and bool(self._waiting))

    def _abort_waiting(self, rid: str | None, message: str) -> int:
        hits = [s for s in self._waiting if rid is None or s.rid == rid]
        for seq in hits:
            self._waiting.remove(seq)
            self._finish(seq, FinishReason(type="abort", message=message), interrupted=True)
        return len(hits)

    def _apply_actions(self, aborts: list[tuple[str | None, str]], *, retract: bool) -> None:
        for rid, message in aborts:
            # The queue too: a row retracted after abort() found it running is waiting now.
            with self._cond:
                self._abort_waiting(rid, message)
            leaving = [s for s in self._rows if rid is None or s.rid == rid]
            for seq in leaving:
                self._finish(seq, FinishReason(type="abort", message=message), interrupted=True)
            self._keep([i for i, s in enumerate(self._rows) if s not in leaving])
        if retract and self._rows:
            # Back to the front of the queue, in batch order, keeping what they generated; their
            # KV state is dropped and rebuilt from their history when they are admitted again.
            with self._cond:
                for seq in reversed(self._rows):
                    seq.logits_version = None
                    self._waiting.appendleft(seq)
                self._rows, self._batch, self._logits = [], None, None
                self._needs_rebuild = False

    def _keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (and their pending logits)."""
        if len(keep) == len(self._rows):
            return
        rows = [self._rows[i] for i in keep]
        if not rows or self._needs_rebuild:
            self._rows = rows
            if not rows:
                self._batch, self._logits, self._needs_rebuild = None, None, False
            return
        assert self._runner is not None and self._batch is not None
        try:
            batch = self._runner.select(self._batch, keep)
        except Exception:
            # The rebuild (a forward) needs the weights lock: a step runs it at once, an abort at the
            # next step.
            logger.exception("selecting %d rows out of the batch failed; rebuilding it row by row", len(rows))
            self._rows, self._batch, self._logits, self._needs_rebuild = rows, None, None, True
            return
        self._batch, self._rows = batch, rows
        if self._logits is not None:  # None after a step sampled them: no copy for the decode to replace
            self._logits = self._logits[keep]

    def _step(self, admitted: list[Sequence]) -> None:
        version = self._weight_version()
        if self._needs_rebuild:
            self._rebuild(version)
        if admitted:
            self._admit(admitted, version)
        if not self._rows:
            return
        assert self._logits is not None and self._batch is not None
        rows = self._rows
        selected = sample_rows(
            self._logits,
            [s.sampler for s in rows],
            histories=[s.history if s.sampler.needs_penalties else [] for s in rows],
            output_lengths=[len(s.output_ids) for s in rows],
            want_logprobs=[s.return_logprob for s in rows],
            top_logprobs=[s.top_logprobs for s in rows],
        )
        keep: list[int] = []
        for row, (seq, result) in enumerate(zip(rows, selected, strict=True)):
            if isinstance(result, SamplingFailure):
                self._fail(seq, result.error, stage="sampling")
                continue
            try:
                seq.record(result.token, logprob=result.logprob, top=result.top)
                self._tokens += 1
                reason = seq.stop_reason(self._detokenizer)
                if reason is not None:
                    self._finish(seq, reason)
                    continue
                if seq.stream:
                    seq.sink.progress(self._response(seq, None, interrupted=False))
            except Exception as exc:  # noqa: BLE001  # this request's bookkeeping broke; its neighbours go on
                self._fail(seq, exc, stage="recording the sampled token")
                continue
            keep.append(row)
        self._steps += 1
        self._logits = None  # sampled; the decode below (or a rebuild) computes the next
        self._keep(keep)
        # A rebuild (after a failed select, or a failed decode below) prefills each row's history,
        # which now ends with the token just sampled: the rebuilt logits are the ones this decode
        # would have produced.
        if self._needs_rebuild:
            self._rebuild(version)
            return
        if not self._rows:
            return
        assert self._runner is not None
        try:
            self._logits = self._runner.decode(self._batch, [s.output_ids[-1] for s in self._rows])
        except Exception:
            # The KV state may be half-advanced (decode writes in place).
            logger.exception("decoding a batch of %d rows failed; rebuilding it row by row", len(self._rows))
            self._rebuild(version)
            return
        for seq in self._rows:
            seq.logits_version = version

    def _admit(self, admitted: list[Sequence], version: str) -> None:
        ready: list[Sequence] = []
        for seq in admitted:
            if not seq.output_ids and seq.sampler.params.token_budget == 0:
                self._finish(seq, FinishReason(type="length", length=0))
            else:
                ready.append(seq)
        if not ready:
            return
        assert self._runner is not None
        try:
            # The history, not the prompt: a retracted request continues from what it generated.
            batch, logits = self._runner.prefill([s.history for s in ready])
        except Exception:
            logger.exception("prefilling %d admitted requests together failed; prefilling each alone", len(ready))
            group = self._prefill_alone(ready)
            if group is None:
                return
            batch, logits, ready = group.batch, group.logits, group.rows
        for seq in ready:
            seq.logits_version = version
        self._rows.extend(ready)
        if self._batch is None or self._logits is None:
            self._batch, self._logits = batch, logits
            return
        try:
            self._batch = self._runner.merge(self._batch, batch)
        except Exception:
            logger.exception("merging %d admitted requests into the batch failed; rebuilding it row by row", len(ready))
            self._rebuild(version)
            return
        self._logits = torch.cat([self._logits, logits], dim=0)

    def _rebuild(self, version: str) -> None:
        """Replace the KV state of ``self._rows`` by prefilling each row's history alone (then
        merging), failing only the rows that fail alone. Only failure paths call this."""
        group = self._prefill_alone(self._rows)
        self._needs_rebuild = False
        self._rows, self._batch, self._logits = (group.rows, group.batch, group.logits) if group else ([], None, None)
        for seq in self._rows:
            seq.logits_version = version

    def _prefill_alone(self, sequences: list[Sequence]) -> _Group | None:
        """Prefill each sequence's history on its own and merge the results into one group;
        a sequence whose prefill (or merge into the group) raises fails alone."""
        assert self._runner is not None
        group: _Group | None = None
        for seq in sequences:
            try:
                batch, logits = self._runner.prefill([seq.history])
                if group is None:
                    group = _Group(batch=batch, logits=logits, rows=[seq])
                else:
                    group = _Group(
                        batch=self._runner.merge(group.batch, batch),
                        logits=torch.cat([group.logits, logits], dim=0),
                        rows=[*group.rows, seq],
                    )
            except Exception as exc:  # noqa: BLE001  # this request fails alone (logged by _fail); the others go on
                self._fail(seq, exc, stage="prefill")
        return group

    def _fail(self, seq: Sequence, error: Exception, *, stage: str) -> None:
        """End one request that failed inside the engine, with its partial output."""
        logger.error("generation failed for request %s (%s)", seq.rid, stage, exc_info=error)
        detail = f"{type(error).__name__}: {error}"
        message = (
            f"generation failed inside the engine for this request ({stage}: {detail[:200]}); "
            "other requests were not affected; see the server log"
        )
        self._finish(seq, FinishReason(type="abort", message=message), interrupted=True)

    def _finish(self, seq: Sequence, reason: FinishReason, *, interrupted: bool = False) -> None:
        try:
            response = self._response(seq, reason, interrupted=interrupted)
        except Exception as exc:  # its caller must still be answered, and this thread live on
            # A tokenizer that cannot decode the output: raised again by the failure paths that end
            # the request, it would end this thread and leave every caller waiting.
            logger.exception("could not build the answer of request %s; it ends without its text", seq.rid)
            detail = f"{type(exc).__name__}: {exc}"
            message = f"the engine could not decode this request's output ({detail[:200]}); see the server log"
            failed = FinishReason(type="abort", message=message)
            response = seq.response(
                failed, interrupted=True, detokenizer=_NO_TEXT, current_version=self._weight_version()
            )
        seq.sink.finish(response)

    def _response(self, seq: Sequence, reason: FinishReason | None, *, interrupted: bool) -> GenerateResponse:
        return seq.response(
            reason, interrupted=interrupted, detokenizer=self._detokenizer, current_version=self._weight_version()
        )

    def _fail_all(self, admitted: list[Sequence], message: str) -> None:
        reason = FinishReason(type="abort", message=message)
        for seq in {id(s): s for s in [*self._rows, *admitted]}.values():
            self._finish(seq, reason, interrupted=True)
        self._rows, self._batch, self._logits, self._needs_rebuild = [], None, None, False


class _NoText:
    """Decodes nothing: the answer of a request whose output the tokenizer could not decode."""

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        return ""


_NO_TEXT = _NoText()


@dataclass(frozen=True)
class _Group:
    """Sequences prefilled together: their KV state, their next-token logits, and the rows."""

    batch: object
    logits: torch.Tensor
    rows: list[Sequence]

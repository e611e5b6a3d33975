"""The embedded inference engine: one Hugging Face causal LM served with continuous batching.

``Engine`` is the asyncio-facing core behind the HTTP server: it turns requests into scheduler
sequences, bridges results back from the scheduler thread, and runs weight updates with the
discipline that keeps them safe (validate everything first, pause as asked, copy under the write
side of the weights lock, confirm the checksum, resume).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from miles import __version__
from miles.engine.model_runner import ModelRunner, build_runner, load_model
from miles.engine.rwlock import WeightsLock
from miles.engine.sampling import RowSampler
from miles.engine.scheduler import GenerationState, Scheduler, Sequence
from miles.engine.settings import EngineSettings
from miles.engine.weight_loader import PreparedUpdate, apply_update, prepare_update
from miles.errors import CheckpointError, InvalidRequestError
from miles.protocol.sglang import (
    GenerateRequest,
    GenerateResponse,
    PauseMode,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
    UpdateWeightVersionRequest,
)
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import ModelChecksum, checksum_module

logger = logging.getLogger("miles.engine")

DEFAULT_WEIGHT_VERSION = "default"  # SGLang's version before any update


class WeightsStatus(Enum):
    """Whether the live weights are known to equal a verified checkpoint."""

    VERIFIED = "verified"
    # A copy finished but the weights hash to something other than the checkpoint's manifest:
    # generation stays paused until a good checkpoint is loaded.
    UNVERIFIED = "unverified"


class _Sink:
    """Carries one sequence's results from the scheduler thread to an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[tuple[bool, GenerateResponse]] = asyncio.Queue()
        self._finished = False
        self._guard = threading.Lock()

    def progress(self, snapshot: GenerateResponse) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, (False, snapshot))

    def finish(self, response: GenerateResponse) -> None:
        with self._guard:
            # A sequence can be finished twice on a failure path; the first result stands.
            if self._finished:
                return
            self._finished = True
        self._loop.call_soon_threadsafe(self.queue.put_nowait, (True, response))


@dataclass(frozen=True)
class _Pending:
    sequence: Sequence
    sink: _Sink


class Engine:
    """Serves one model; every public coroutine runs on the server's event loop."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.device = torch.device(settings.device)
        self.model_path = settings.model_path.resolve()
        self.config = AutoConfig.from_pretrained(str(self.model_path))
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(self.model_path))
        # Loaded on the scheduler thread by start(): all parallel torch work stays on one thread.
        self.model: PreTrainedModel | None = None
        self.forward_name = ""  # the runner serving the model (model_runner.build_runner), once loaded
        try:
            manifest = read_manifest(self.model_path)
        except CheckpointError:
            manifest = None  # a plain Hugging Face directory: served, but with no recorded version
        self.served_model_name = settings.served_model_name or (
            manifest.model_name if manifest else self.model_path.name
        )
        self._weight_version = manifest.weight_version if manifest else DEFAULT_WEIGHT_VERSION
        self._weights_status = WeightsStatus.VERIFIED
        self._loaded_from = self.model_path
        self.context_length = settings.context_length or int(getattr(self.config, "max_position_embeddings", 2048))
        self.vocab_size = int(self.config.vocab_size)
        self._eos_ids = _eos_ids(self.model_path, self.config, self.tokenizer)
        self._weights_lock = WeightsLock()
        self._scheduler = Scheduler(
            setup=self._build_runner,
            detokenizer=_Detokenizer(self.tokenizer),
            weights_lock=self._weights_lock,
            weight_version=lambda: self._weight_version,
            max_running_requests=settings.max_running_requests,
        )
        self._in_flight: set[str] = set()
        self._update_lock: asyncio.Lock | None = None
        self.started_at = time.time()

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (on the scheduler thread) and start serving; raises if loading fails."""
        self._update_lock = asyncio.Lock()
        await asyncio.to_thread(self._scheduler.start)

    def _build_runner(self) -> ModelRunner:
        self.model = load_model(self.model_path, device=self.device)
        pad = self.tokenizer.pad_token_id
        runner = build_runner(
            self.model, device=self.device, pad_token_id=pad if pad is not None else 0, forward=self.settings.forward
        )
        self.forward_name = runner.name
        return runner

    @property
    def _model(self) -> PreTrainedModel:
        assert self.model is not None, "Engine.start() has not loaded the model yet"
        return self.model

    def stop(self) -> None:
        self._scheduler.stop()

    # --- generation ------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._weight_version

    async def generate(self, request: GenerateRequest) -> GenerateResponse | list[GenerateResponse]:
        """Run a (batch) request to completion; a batch or ``n > 1`` returns a list."""
        pending = self._submit(request)
        try:
            results = [await _final(p.sink) for p in pending]
        except asyncio.CancelledError:
            self._abort_pending(pending, "the client went away")
            raise
        finally:
            self._release(pending)
        if request.is_batch or len(results) > 1:
            return results
        return results[0]

    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateResponse]:
        """Submit now (so a bad request raises here, before any byte is sent) and return an
        iterator of snapshots (cumulative text and ids) after every token, then the final response."""
        pending = self._submit(request)
        if len(pending) != 1:
            self._abort_pending(pending, "streaming supports a single sequence")
            self._release(pending)
            raise InvalidRequestError("streaming supports one prompt with n=1")
        return self._follow(pending)

    async def _follow(self, pending: list[_Pending]) -> AsyncIterator[GenerateResponse]:
        (item,) = pending
        try:
            while True:
                final, response = await item.sink.queue.get()
                yield response
                if final:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self._abort_pending(pending, "the client went away")
            raise
        finally:
            self._release(pending)

    def _submit(self, request: GenerateRequest) -> list[_Pending]:
        prompts = self._prompt_ids(request)
        params = _per_prompt(request.sampling_params, len(prompts), SamplingParams())
        rids = _per_prompt(request.rid, len(prompts), None)
        loop = asyncio.get_running_loop()
        pending: list[_Pending] = []
        for index, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
            self._check_length(prompt, sampling)
            base = rids[index] or uuid.uuid4().hex
            for sample in range(sampling.n):
                rid = base if sampling.n == 1 else f"{base}-{sample}"
                if rid in self._in_flight or any(p.sequence.rid == rid for p in pending):
                    raise InvalidRequestError(f"request id {rid!r} is already in flight; use unique rids")
                sink = _Sink(loop)
                seed = sampling.effective_seed
                row_params = (
                    sampling
                    if seed is None or sample == 0
                    else sampling.model_copy(update={"sampling_seed": seed + sample, "seed": None})
                )
                sequence = Sequence(
                    rid=rid,
                    prompt_ids=prompt,
                    sampler=RowSampler.create(row_params, eos_ids=self._eos_ids),
                    sink=sink,
                    stream=request.stream,
                    top_logprobs=request.top_logprobs_num if request.return_logprob else 0,
                    return_logprob=request.return_logprob,
                )
                pending.append(_Pending(sequence=sequence, sink=sink))
        for item in pending:
            self._in_flight.add(item.sequence.rid)
            self._scheduler.submit(item.sequence)
        return pending

    def _prompt_ids(self, request: GenerateRequest) -> list[list[int]]:
        if request.text is not None:
            texts = request.text if isinstance(request.text, list) else [request.text]
            prompts = [list(self.tokenizer.encode(t)) for t in texts]
        else:
            raw = request.input_ids or []
            prompts = raw if raw and isinstance(raw[0], list) else [raw]  # type: ignore[list-item]
        for prompt in prompts:
            if not prompt:
                raise InvalidRequestError("the prompt is empty; give at least one token")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"input_ids hold token ids outside the vocabulary [0, {self.vocab_size})", tokens=bad[:5]
                )
        return prompts  # type: ignore[return-value]

    def _check_length(self, prompt: list[int], sampling: SamplingParams) -> None:
        if len(prompt) + sampling.max_new_tokens > self.context_length:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"context length {self.context_length}; shorten the prompt or lower max_new_tokens"
            )

    def _abort_pending(self, pending: list[_Pending], message: str) -> None:
        for item in pending:
            self._scheduler.abort(item.sequence.rid, message=message)

    def _release(self, pending: list[_Pending]) -> None:
        for item in pending:
            self._in_flight.discard(item.sequence.rid)

    # --- control ---------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> int:
        return await asyncio.to_thread(self._scheduler.pause, mode)

    def resume(self) -> None:
        if self._weights_status is WeightsStatus.UNVERIFIED:
            raise InvalidRequestError(
                "the engine holds unverified weights after a failed update; load a good checkpoint "
                "with /update_weights_from_disk before continuing",
                status_code=409,
            )
        self._scheduler.resume()

    def abort(self, rid: str, *, abort_all: bool, message: str | None) -> int:
        text = message or "aborted by /abort_request"
        return self._scheduler.abort(None if abort_all else rid, message=text)

    @property
    def generation_state(self) -> GenerationState:
        return self._scheduler.state

    # --- weights ---------------------------------------------------------------------------

    async def update_weights_from_disk(self, request: UpdateWeightsFromDiskRequest) -> UpdateWeightsResponse:
        """Load a checkpoint into the live weights (see the module docstring for the order).

        Raises InvalidRequestError for a path that is not allowed or not a directory. A checkpoint
        that fails validation is answered with ``success=False`` and leaves the old weights serving.
        """
        path = self._checkpoint_path(request.model_path)
        assert self._update_lock is not None, "Engine.start() was not called"
        async with self._update_lock:
            try:
                prepared = await asyncio.to_thread(prepare_update, self._model, path)
            except CheckpointError as exc:
                logger.warning("refused checkpoint %s: %s", path, exc)
                return UpdateWeightsResponse(success=False, message=str(exc), weight_version=self._weight_version)
            try:
                version = request.weight_version or prepared.weight_version
                pausing = self._scheduler.state is GenerationState.SERVING
                paused = 0
                pause_started = time.perf_counter()
                if pausing:
                    mode = PauseMode.ABORT if request.abort_all_requests else PauseMode.DRAIN
                    paused = await asyncio.to_thread(
                        self._scheduler.pause, mode, message="aborted by update_weights_from_disk"
                    )
                elif request.abort_all_requests:
                    self._scheduler.abort(None, message="aborted by update_weights_from_disk")
                prepared.timings["pause"] = time.perf_counter() - pause_started
                # The copy runs on the scheduler thread, between two steps (one torch thread).
                checksum = await asyncio.to_thread(self._scheduler.call, lambda: self._copy_in(prepared, version))
                ok = checksum.checksum == prepared.manifest_checksum
                if pausing and ok and not request.keep_pause:
                    self._scheduler.resume()
            finally:
                prepared.close()
        if not ok:
            return UpdateWeightsResponse(
                success=False,
                message=(
                    f"weights loaded from {path} hash to {checksum.checksum} but the manifest says "
                    f"{prepared.manifest_checksum}; generation stays paused until a good checkpoint is loaded"
                ),
                num_paused_requests=paused,
                weight_version=self._weight_version,
                checksum=checksum.checksum,
                timings=prepared.timings,
            )
        return UpdateWeightsResponse(
            success=True,
            message=f"Succeeded to update model weights from {path}.",
            num_paused_requests=paused,
            weight_version=version,
            checksum=checksum.checksum,
            timings=prepared.timings,
        )

    def _copy_in(self, prepared: PreparedUpdate, version: str) -> ModelChecksum:
        waiting = time.perf_counter()
        with self._weights_lock.write():
            prepared.timings["write_lock_wait"] = time.perf_counter() - waiting
            checksum = apply_update(prepared)
            if checksum.checksum == prepared.manifest_checksum:
                self._weights_status = WeightsStatus.VERIFIED
                self._weight_version = version
                self._loaded_from = Path(prepared.reader.directory)
            else:
                self._weights_status = WeightsStatus.UNVERIFIED
            return checksum

    def _checkpoint_path(self, raw: str) -> Path:
        if not raw.strip():
            raise InvalidRequestError("model_path is empty; give a checkpoint directory")
        path = Path(raw).expanduser().resolve()
        roots = self.settings.allowed_checkpoint_roots
        if roots and not any(path.is_relative_to(root) for root in roots):
            raise InvalidRequestError(
                f"model_path {str(path)!r} is outside the allowed checkpoint roots; put the checkpoint "
                "under one of them or extend MILES_ALLOWED_CHECKPOINT_ROOTS",
                status_code=403,
                allowed=[str(r) for r in roots],
            )
        if not path.is_dir():
            raise InvalidRequestError(f"model_path {str(path)!r} is not a directory", status_code=404)
        return path

    async def update_weight_version(self, request: UpdateWeightVersionRequest) -> None:
        if request.abort_all_requests:
            self._scheduler.abort(None, message="aborted by update_weight_version")

        def rename() -> None:
            with self._weights_lock.write():
                self._weight_version = request.new_version

        await asyncio.to_thread(rename)

    async def checksum(self) -> ModelChecksum:
        """The checksum of the weights this process holds right now (recomputed, never cached)."""

        def compute() -> ModelChecksum:
            with self._weights_lock.read():
                return checksum_module(self._model)

        return await asyncio.to_thread(compute)

    @property
    def weights_status(self) -> WeightsStatus:
        return self._weights_status

    # --- health and info -------------------------------------------------------------------

    async def health_generate(self) -> str | None:
        """Generate one token; returns None when healthy, else why not."""
        if self._weights_status is WeightsStatus.UNVERIFIED:
            return "the engine holds unverified weights"
        if self._scheduler.state is not GenerationState.SERVING:
            return f"generation is {self._scheduler.state.value}"
        request = GenerateRequest(
            input_ids=[self._eos_or_first_token()],
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
            rid=f"health-{uuid.uuid4().hex}",
        )
        try:
            await asyncio.wait_for(self.generate(request), timeout=self.settings.health_generate_timeout_s)
        except TimeoutError:
            return f"no token within {self.settings.health_generate_timeout_s}s"
        return None

    def _eos_or_first_token(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else 0

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": str(self._loaded_from),
            "tokenizer_path": str(self.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self._weight_version,
            "served_model_name": self.served_model_name,
            "architectures": list(getattr(self.config, "architectures", None) or []),
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "dtype": str(self._model.dtype).removeprefix("torch."),
        }

    def server_info(self) -> dict[str, Any]:
        stats = self._scheduler.stats()
        return {
            "version": __version__,
            "engine": "miles-embedded",
            "model_path": str(self._loaded_from),
            "served_model_name": self.served_model_name,
            "host": self.settings.host,
            "port": self.settings.port,
            "device": str(self.device),
            "forward": self.forward_name,
            "max_running_requests": self.settings.max_running_requests,
            "context_length": self.context_length,
            "weight_version": self._weight_version,
            "weights_status": self._weights_status.value,
            "uptime_s": time.time() - self.started_at,
            "internal_states": [
                {
                    "generation_state": stats.state.value,
                    "waiting_requests": stats.waiting,
                    "running_requests": stats.running,
                    "decode_steps": stats.steps,
                    "tokens_generated": stats.tokens_generated,
                }
            ],
        }


class _Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


async def _final(sink: _Sink) -> GenerateResponse:
    while True:
        final, response = await sink.queue.get()
        if final:
            return response


def _per_prompt(value: Any, count: int, default: Any) -> list[Any]:
    if isinstance(value, list):
        return value
    return [value if value is not None else default] * count


def _eos_ids(model_path: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    try:
        generation = GenerationConfig.from_pretrained(str(model_path))
    except OSError:
        generation = None  # no generation_config.json: the model config and tokenizer decide
    for source in (generation, config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)

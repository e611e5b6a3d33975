"""The embedded inference engine: one Hugging Face causal LM served with continuous batching.

``Engine`` is the asyncio-facing core behind the HTTP server: it turns requests into scheduler
sequences (checking everything they carry against the model first, so nothing a client sends can
fail inside a step), and bridges results back from the scheduler thread. The weights live in
``Engine.weights`` (``weights.live``), every change to them in ``Engine.changes`` (``weights.swap``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import contextmanager
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
from miles.engine.metrics import EngineMetrics
from miles.engine.model_runner import ModelRunner, build_runner, load_model
from miles.engine.sampling import RowSampler
from miles.engine.scheduler import GenerationState, Scheduler
from miles.engine.sequence import Sequence
from miles.engine.settings import EngineSettings
from miles.engine.weights.buffers import StagingPolicy
from miles.engine.weights.live import LiveWeights, WeightsStatus
from miles.engine.weights.lock import WeightsLock
from miles.engine.weights.swap import WeightChanges
from miles.errors import InvalidRequestError, QueueFullError
from miles.protocol.compat import SGLANG_VERSION
from miles.protocol.sglang import GenerateRequest, GenerateResponse, PauseMode, SamplingParams, per_prompt
from miles.weights.manifest import manifest_or_none

logger = logging.getLogger("miles.engine")

DEFAULT_WEIGHT_VERSION = "default"  # SGLang's version before any update
# Texts of at least this many characters (a request's together) are tokenized on a worker thread,
# which the tokenizer releases the interpreter from, so no prompt holds up the event loop.
ENCODE_OFF_LOOP_CHARS = 4096


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


_Pending = tuple[Sequence, _Sink]  # a sequence submitted, and where its results arrive


class Engine:
    """Serves one model; every public coroutine runs on the server's event loop."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.device = torch.device(settings.resolved_device(cuda_available=torch.cuda.is_available()))
        self.model_path = settings.model_path.resolve()
        self.config = AutoConfig.from_pretrained(str(self.model_path))
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(self.model_path))
        # Loaded on the scheduler thread by start(): all parallel torch work stays on one thread.
        self.model: PreTrainedModel | None = None
        self.forward_name = ""  # the runner serving the model (model_runner.build_runner), once loaded
        # None for a plain Hugging Face directory: served, but with no recorded version.
        manifest = manifest_or_none(self.model_path)
        self.served_model_name = settings.served_model_name or (
            manifest.model_name if manifest else self.model_path.name
        )
        self.context_length = settings.context_length or int(getattr(self.config, "max_position_embeddings", 2048))
        self.vocab_size = int(self.config.vocab_size)
        # No token covers more characters than the vocabulary's longest entry, so a text longer
        # than this cannot fit the context however it tokenizes: refused without tokenizing it.
        self._token_chars = max((len(token) for token in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.context_length * self._token_chars
        self._eos_ids = _eos_ids(self.model_path, self.config, self.tokenizer, vocab_size=self.vocab_size)
        lock = WeightsLock()
        self._scheduler = Scheduler(
            setup=self._build_runner,
            detokenizer=_Detokenizer(self.tokenizer),
            weights_lock=lock,
            weight_version=lambda: self.weights.held.version,
            max_running_requests=settings.max_running_requests,
        )
        self.weights = LiveWeights(
            lock=lock,
            model=lambda: self._model,
            tokenizer=self.tokenizer,
            served_model_name=self.served_model_name,
            snapshot_dir=settings.snapshot_dir,
            version=manifest.weight_version if manifest else DEFAULT_WEIGHT_VERSION,
            loaded_from=self.model_path,
            manifest_checksum=manifest.checksum if manifest else None,
        )
        self._staging = StagingPolicy(mode=settings.weight_staging, budget=settings.weight_staging_budget)
        self.changes = WeightChanges(
            weights=self.weights,
            scheduler=self._scheduler,
            staging=self._staging,
            roots=settings.allowed_checkpoint_roots,
        )
        self._in_flight: set[str] = set()
        self.started_at = time.time()
        self.metrics = EngineMetrics(self.served_model_name, stats=self._scheduler.stats, weights=self._weights_info)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (on the scheduler thread) and start serving; raises if loading fails."""
        await asyncio.to_thread(self._scheduler.start)
        # Everything loaded so far (torch, transformers, the model's modules: ~400k objects) lives
        # as long as the engine: out of the collector's sight, a full collection scans only what
        # came after. Scanned, it held the GIL ~200 ms (500M preset, loaded machine) whenever it
        # ran, stalling generation and any swap under the weights' write lock for as long.
        gc.freeze()

    def _build_runner(self) -> ModelRunner:
        self.model = load_model(self.model_path, device=self.device)
        pad = self.tokenizer.pad_token_id or 0
        runner = build_runner(self.model, device=self.device, pad_token_id=pad, forward=self.settings.forward)
        self.forward_name = runner.name
        # Over the parameters the runner serves from (the fused decoder re-points them): the
        # memory a staged change swaps (``ModelRunner.weight_views``).
        self._staging.attach(self.model, runner_tensors=runner.weight_views())
        self.weights.record_loaded()
        return runner

    @property
    def _model(self) -> PreTrainedModel:
        assert self.model is not None, "Engine.start() has not loaded the model yet"
        return self.model

    async def stop(self) -> None:
        """Stop the scheduler thread and wait for it (off the loop: it may be finishing a step)."""
        await asyncio.to_thread(self._scheduler.stop)

    # --- generation ------------------------------------------------------------------------

    def _weights_info(self) -> dict[str, str]:
        held = self.weights.held
        return {"weight_version": held.version, "checksum": held.checksum or "", "status": held.status.value}

    async def generate(self, request: GenerateRequest) -> GenerateResponse | list[GenerateResponse]:
        """Run a (batch) request to completion; a batch or ``n > 1`` returns a list."""
        pending = await self._submit(request)
        with self._watched(pending):
            results = [await _final(sink) for _, sink in pending]
        for (sequence, _), result in zip(pending, results, strict=True):
            self.metrics.request_done(sequence, result)
        if request.is_batch or len(results) > 1:
            return results
        return results[0]

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateResponse]:
        """Submit now (so a bad request raises here, before any byte is sent) and return an
        iterator of snapshots (cumulative text and ids) after every token, then the final response."""
        return self._follow(await self._submit(request, single=True))

    async def _follow(self, pending: list[_Pending]) -> AsyncIterator[GenerateResponse]:
        ((sequence, sink),) = pending
        with self._watched(pending):
            while True:
                final, response = await sink.queue.get()
                if final:
                    self.metrics.request_done(sequence, response)
                yield response
                if final:
                    return

    @contextmanager
    def _watched(self, pending: list[_Pending]) -> Iterator[None]:
        """Abort ``pending`` if its client goes away meanwhile; release its rids at the end."""
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            for sequence, _ in pending:
                self._scheduler.abort(sequence.rid, message="the client went away")
            self.metrics.clients_left(len(pending))
            raise
        finally:
            self._in_flight.difference_update(sequence.rid for sequence, _ in pending)

    async def _submit(self, request: GenerateRequest, *, single: bool = False) -> list[_Pending]:
        params = [per_prompt(request.sampling_params, i) or SamplingParams() for i in range(request.batch_size)]
        sequences = sum(p.n for p in params)
        if single and sequences != 1:
            raise InvalidRequestError("streaming supports one prompt with n=1")
        self._check_room(sequences)  # before tokenizing: a request that cannot be queued costs nothing
        prompts = await self._prompt_ids(request)
        # Again: other requests may have queued while this one was tokenized on a worker thread;
        # from here to the scheduler nothing awaits, so the queue cannot pass its bound.
        self._check_room(sequences)
        loop = asyncio.get_running_loop()
        pending: list[_Pending] = []
        for index, (prompt, requested) in enumerate(zip(prompts, params, strict=True)):
            sampling = self._resolved(prompt, requested)
            self._check_vocab("sampling_params.stop_token_ids holds", sampling.stop_token_ids or ())
            self._check_vocab("sampling_params.logit_bias holds", sampling.bias)
            logprobs = request.logprobs_of(index)
            base = per_prompt(request.rid, index) or uuid.uuid4().hex
            for sample in range(sampling.n):
                rid = base if sampling.n == 1 else f"{base}-{sample}"
                if rid in self._in_flight or any(s.rid == rid for s, _ in pending):
                    raise InvalidRequestError(f"request id {rid!r} is already in flight; use unique rids")
                sink = _Sink(loop)
                sequence = Sequence(
                    rid=rid,
                    prompt_ids=prompt,
                    sampler=RowSampler.create(sampling.for_sample(sample), eos_ids=self._eos_ids),
                    sink=sink,
                    stream=request.stream,
                    top_logprobs=logprobs.top_logprobs,
                    return_logprob=logprobs.return_logprob,
                )
                pending.append((sequence, sink))
        for sequence, _ in pending:
            self._in_flight.add(sequence.rid)
            self._scheduler.submit(sequence)
        return pending

    def _check_room(self, sequences: int) -> None:
        """Refuse a request whose ``sequences`` the queue cannot take: 400 when it never could
        (split it), 429 when it is full now (SGLang's answer: another server may take it)."""
        limit = self.settings.max_queued_requests
        if sequences > limit:
            raise InvalidRequestError(
                f"the request makes {sequences} sequences (prompts x n), more than this engine queues "
                f"({limit}, --max-queued-requests); split it into smaller batches"
            )
        waiting = self._scheduler.waiting()
        if waiting + sequences > limit:
            raise QueueFullError(
                f"the queue is full ({waiting} sequences waiting, at most {limit}: --max-queued-requests); "
                "retry, or send the request to another server"
            )

    async def encode(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """The token ids of each text; InvalidRequestError for a text too long to fit the context
        whatever it tokenizes to (checked before any tokenizing)."""
        for text in texts:
            if len(text) > self.max_prompt_chars:
                raise InvalidRequestError(
                    f"the prompt has {len(text)} characters, more than fit the context length "
                    f"{self.context_length} however they tokenize (no token of this model covers more than "
                    f"{self._token_chars} characters, so at most {self.max_prompt_chars}); shorten the prompt"
                )

        def run() -> list[list[int]]:
            return [list(self.tokenizer.encode(t, add_special_tokens=add_special_tokens)) for t in texts]

        if sum(map(len, texts)) < ENCODE_OFF_LOOP_CHARS:
            return run()
        return await asyncio.to_thread(run)

    async def _prompt_ids(self, request: GenerateRequest) -> list[list[int]]:
        if request.text is not None:
            prompts = await self.encode(request.text if isinstance(request.text, list) else [request.text])
        else:
            raw = request.input_ids or []
            prompts = raw if raw and isinstance(raw[0], list) else [raw]
        for prompt in prompts:
            if not prompt:
                raise InvalidRequestError("the prompt is empty; give at least one token")
            self._check_vocab("input_ids hold", prompt)
        return prompts

    def _resolved(self, prompt: list[int], sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with its token budget fixed: null means what the context leaves after the
        prompt (SGLang's meaning); raises InvalidRequestError when the context cannot hold it."""
        room = self.context_length - len(prompt)
        if sampling.max_new_tokens is None:
            if room <= 0 or room < sampling.min_new_tokens:
                raise InvalidRequestError(
                    f"the prompt ({len(prompt)} tokens) leaves no room in the context length "
                    f"{self.context_length} for min_new_tokens ({sampling.min_new_tokens}); shorten the prompt"
                )
            return sampling.with_budget(room)
        if sampling.max_new_tokens > room:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"context length {self.context_length}; shorten the prompt or lower max_new_tokens"
            )
        return sampling

    def _check_vocab(self, what: str, ids: Iterable[int]) -> None:
        # An id outside the vocabulary would index past the embeddings or, in sampling params, the
        # logits inside a step (the stop mask of min_new_tokens, a logit bias): refused here,
        # before the request can join the batch.
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"{what} token ids outside the vocabulary [0, {self.vocab_size})", tokens=bad[:5])

    # --- control ---------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> int:
        return await asyncio.to_thread(self._scheduler.pause, mode)

    def resume(self) -> None:
        self.weights.require_verified("continuing")
        self._scheduler.resume()

    def abort(self, rid: str, *, abort_all: bool, message: str | None) -> int:
        return self._scheduler.abort(None if abort_all else rid, message=message or "aborted by /abort_request")

    # --- health and info -------------------------------------------------------------------

    async def health_generate(self) -> str | None:
        """Generate one token; returns None when healthy, else why not."""
        if self.weights.held.status is WeightsStatus.UNVERIFIED:
            return "the engine holds unverified weights"
        if self._scheduler.state is not GenerationState.SERVING:
            return f"generation is {self._scheduler.state.value}"
        request = GenerateRequest(
            input_ids=[self.tokenizer.bos_token_id or 0],
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
            rid=f"health-{uuid.uuid4().hex}",
        )
        try:
            await asyncio.wait_for(self.generate(request), timeout=self.settings.health_generate_timeout_s)
        except TimeoutError:
            return f"no token within {self.settings.health_generate_timeout_s}s"
        return None

    def model_info(self) -> dict[str, Any]:
        """``/model_info``: SGLang's fields (at the pinned version), then ours."""
        return {
            "model_path": str(self.weights.loaded_from),
            "served_model_name": self.served_model_name,
            "tokenizer_path": str(self.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weights.held.version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.config, "model_type", None),
            "architectures": list(getattr(self.config, "architectures", None) or []),
            # miles additions
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "dtype": str(self._model.dtype).removeprefix("torch."),
        }

    def server_info(self) -> dict[str, Any]:
        """``/server_info``: the SGLang server arguments and scheduler facts that describe this
        engine (SGLang dumps all of its several hundred; these are the ones a router or client
        reads), then ours."""
        stats = self._scheduler.stats()
        held = self.weights.held
        return {
            # SGLang's server arguments, as this engine runs.
            "model_path": str(self.weights.loaded_from),
            "tokenizer_path": str(self.model_path),
            "served_model_name": self.served_model_name,
            "host": self.settings.host,
            "port": self.settings.port,
            "device": str(self.device),
            "base_gpu_id": self.settings.base_gpu_id,
            "dtype": str(self._model.dtype).removeprefix("torch."),
            "load_format": "auto",
            "context_length": self.context_length,
            "max_running_requests": self.settings.max_running_requests,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "load_balance_method": "round_robin",
            "disaggregation_mode": "null",
            "is_embedding": False,
            "skip_tokenizer_init": False,
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,
            "page_size": 1,
            "kv_cache_dtype": "auto",
            # SGLang's scheduler facts.
            "max_total_num_tokens": self.settings.max_running_requests * self.context_length,
            "max_req_input_len": self.context_length - 1,
            "startup_time": self.started_at,
            "frontend": "python",
            "sglang_api_version": SGLANG_VERSION,
            # miles additions
            "version": __version__,
            "engine": "miles-embedded",
            "forward": self.forward_name,
            "node_id": self.settings.node_id,
            "gpu_ids": list(self.settings.gpu_ids),
            "weight_version": held.version,
            "checksum": held.checksum,
            "weights_status": held.status.value,
            "weight_staging": self._staging.report().as_dict(),
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
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text


async def _final(sink: _Sink) -> GenerateResponse:
    while True:
        final, response = await sink.queue.get()
        if final:
            return response


def _eos_ids(
    model_path: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, *, vocab_size: int
) -> frozenset[int]:
    ids: set[int] = set()
    try:
        generation = GenerationConfig.from_pretrained(str(model_path))
    except OSError:
        generation = None  # no generation_config.json: the model config and tokenizer decide
    for source in (generation, config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    # An id the model cannot produce cannot end generation, and masking it (min_new_tokens) would
    # index past the logits inside every step.
    inside = frozenset(i for i in ids if 0 <= i < vocab_size)
    if ids - inside:
        logger.warning("ignoring EOS token ids outside the vocabulary [0, %d): %s", vocab_size, sorted(ids - inside))
    return inside

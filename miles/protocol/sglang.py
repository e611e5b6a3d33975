"""Typed requests and responses of SGLang's native HTTP API (the subset miles serves and uses).

Names and defaults follow SGLang's ``GenerateReqInput`` and ``SamplingParams`` (differences:
docs/ENGINE.md). Requests are strict: an unknown field is an error naming it, since a typo in a
sampling parameter would otherwise change results quietly.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, StrictFloat, StrictInt, model_validator

from miles.protocol.base import (
    Count,
    Penalty,
    RequestModel,
    ResponseModel,
    Seed,
    Stop,
    Temperature,
    TopK,
    TopP,
    sample_seed,
)
from miles.protocol.compat import (
    DISAGGREGATION,
    EXTRA_OUTPUT,
    GRAMMAR,
    HIDDEN,
    INTERNAL,
    LOGIT_PROCESSOR,
    LORA,
    MULTIMODAL,
    REASONING,
    SHARED_UNSUPPORTED,
    WATERMARK,
    SGLangFields,
    Unsupported,
)

# SamplingParams fields whose null SGLang reads as "the default" (its __post_init__).
_NULL_IS_DEFAULT = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "spaces_between_special_tokens",
    }
)
# OpenAI's bound on a logit bias, which SGLang forwards unchanged.
MAX_LOGIT_BIAS = 100.0


def _logit_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    for key in value or {}:
        # Canonical only: "05" would be token 5 a second time, and which of two values won a guess.
        if not (key.isascii() and key.isdigit() and len(key) <= 12) or (key != "0" and key.startswith("0")):
            raise ValueError(
                f'logit_bias keys are token ids written as decimal strings without leading zeros ("42"); '
                f"got {key[:20]!r}"
            )
    return value


class CommonSampling(SGLangFields):
    """The decoding settings SGLang's ``SamplingParams`` and its OpenAI requests share, defined once
    so that both refuse the same values."""

    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] = 0.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: Annotated[StrictFloat, Field(gt=0.0, le=2.0)] = 1.0
    stop: Stop = None
    stop_token_ids: list[Count] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: Annotated[StrictInt, Field(ge=1, le=64)] = 1
    # OpenAI's name; SamplingParams accepts it as a shorter alias of its ``sampling_seed``.
    seed: Seed | None = None


# SamplingParams fields that OpenAI's completion requests (vLLM's and miles' own) take by the same
# name: the shared ones but the two OpenAI spells otherwise (``include_stop_str_in_output``, the
# seed SGLang calls ``sampling_seed``), and the two each side bounds its own way.
OPENAI_SAME_NAME = (
    *(name for name in CommonSampling.model_fields if name not in ("no_stop_trim", "seed")),
    "temperature",
    "logit_bias",
)


class SamplingParams(CommonSampling):
    """Per-request decoding settings, with SGLang's names and defaults (the engine checks token ids)."""

    ignored_fields: ClassVar[frozenset[str]] = frozenset({"stream_interval"})
    unsupported_fields: ClassVar[Mapping[str, Unsupported]] = {
        "stop_regex": Unsupported("stop regexes are not implemented; use stop strings or stop_token_ids"),
        "beam_width": Unsupported("beam search is not implemented", unset=(1,)),
        "json_schema": Unsupported(GRAMMAR, unset=("",)),
        "regex": Unsupported(GRAMMAR, unset=("",)),
        "ebnf": Unsupported(GRAMMAR, unset=("",)),
        "structural_tag": Unsupported(GRAMMAR, unset=("",)),
        "spaces_between_special_tokens": Unsupported(
            "the tokenizer's decode always puts its own spacing between special tokens", default=True
        ),
        "custom_params": Unsupported(LOGIT_PROCESSOR),
        "watermark": Unsupported(WATERMARK),
        "stop_strs": Unsupported(INTERNAL),
        "stop_regex_strs": Unsupported(INTERNAL),
        "stop_str_max_len": Unsupported(INTERNAL, default=0),
        "stop_regex_max_len": Unsupported(INTERNAL, default=0),
        "is_normalized": Unsupported(INTERNAL, default=False),
        "ebnf_full_assistant": Unsupported(INTERNAL, default=False),
    }
    extension_fields: ClassVar[frozenset[str]] = frozenset({"seed"})
    null_is_default: ClassVar[frozenset[str]] = _NULL_IS_DEFAULT

    # null: as many tokens as the context length leaves after the prompt (SGLang's meaning).
    max_new_tokens: Count | None = 128
    min_new_tokens: Count = 0
    temperature: Temperature = 1.0
    # Added to the logits of the named token ids before sampling (OpenAI's bound: -100..100).
    logit_bias: Annotated[
        dict[str, Annotated[StrictFloat, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None,
        AfterValidator(_logit_bias),
    ] = None
    sampling_seed: Seed | None = None

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must not exceed max_new_tokens")
        if self.seed is not None and self.sampling_seed is not None and self.seed != self.sampling_seed:
            raise ValueError("give either seed or sampling_seed, not two different values")
        return self

    @property
    def effective_seed(self) -> int | None:
        return self.sampling_seed if self.sampling_seed is not None else self.seed

    @property
    def token_budget(self) -> int:
        """``max_new_tokens`` once the engine has resolved null (see ``with_budget``)."""
        assert self.max_new_tokens is not None, "the engine resolves max_new_tokens=null before a request runs"
        return self.max_new_tokens

    def with_budget(self, budget: int) -> SamplingParams:
        """These settings with ``max_new_tokens`` set (the engine's resolution of null)."""
        return self.model_copy(update={"max_new_tokens": budget})

    def for_sample(self, sample: int) -> SamplingParams:
        """The settings of sample ``sample`` of ``n``: seeded, it draws with ``sample_seed``."""
        seed = self.effective_seed
        if seed is None or sample == 0:
            return self
        return self.model_copy(update={"sampling_seed": sample_seed(seed, sample), "seed": None})

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


TopLogprobs = Annotated[StrictInt, Field(ge=0, le=20)]


class GenerateRequest(SGLangFields):
    """``POST /generate``: one prompt or a batch (lists), as text or token ids; settings may be
    one value or one per prompt, as in SGLang."""

    ignored_fields: ClassVar[frozenset[str]] = frozenset(
        {
            # Logging, tracing and metrics.
            "no_logs",
            "custom_labels",
            "external_trace_header",
            "received_time",
            "conversation_id",
            # Scheduling, caching and routing hints: one queue, no prefix cache, no DP workers.
            "priority",
            "extra_key",
            "cache_salt",
            "routing_key",
            "kv_hints",
            "http_worker_ipc",
        }
    )
    unsupported_fields: ClassVar[Mapping[str, Unsupported]] = {
        **SHARED_UNSUPPORTED,
        **{
            name: Unsupported(MULTIMODAL)
            for name in (
                "input_embeds",
                "image_data",
                "video_data",
                "audio_data",
                "mm_hashes",
                "mm_content_hashes",
                "video_config",
                "modalities",
                "max_dynamic_patch",
                "min_dynamic_patch",
                "image_max_dynamic_patch",
                "video_max_dynamic_patch",
            )
        },
        "use_audio_in_video": Unsupported(MULTIMODAL, default=False),
        "token_ids_logprob": Unsupported("logprobs of chosen token ids are not returned; use top_logprobs_num"),
        "return_sampling_mask": Unsupported(EXTRA_OUTPUT, default=False),
        "sampling_logprobs_mode": Unsupported(
            "logprobs are always those of the model's raw distribution (before temperature and filtering)"
        ),
        "return_flat_raw_top_logprobs": Unsupported(EXTRA_OUTPUT, default=False),
        "return_flat_raw_output_top_logprobs": Unsupported(EXTRA_OUTPUT, default=False),
        "return_flat_raw_top_logprobs_b64": Unsupported(EXTRA_OUTPUT, default=False),
        "return_indexer_topk": Unsupported(HIDDEN, default=False),
        "lora_id": Unsupported(LORA),
        "positional_embed_overrides": Unsupported("embedding overrides are not supported"),
        "bootstrap_pair_key": Unsupported(DISAGGREGATION),
        "decode_tp_size": Unsupported(DISAGGREGATION),
        "need_wait_for_mm_inputs": Unsupported(DISAGGREGATION, default=False),
        "num_items_assigned": Unsupported(DISAGGREGATION),
        "encoder_urls": Unsupported(DISAGGREGATION),
        "background": Unsupported("background requests (OpenAI's responses API) are not supported", default=False),
        "require_reasoning": Unsupported(REASONING, default=False),
        "max_thinking_tokens": Unsupported(REASONING),
        "return_bytes": Unsupported("the engine generates text, not images", default=False),
        "return_entropy": Unsupported(EXTRA_OUTPUT, default=False),
        "return_prompt_token_ids": Unsupported(EXTRA_OUTPUT, default=False),
        "multi_item_delimiter_indices": Unsupported("multi-item scoring is not supported"),
        "token_indices_to_pool": Unsupported("pooling readouts (scoring) are not supported"),
    }
    # SGLang's router adds "model" (null, or the model it routed by) to every /generate it forwards.
    extension_fields: ClassVar[frozenset[str]] = frozenset({"model"})

    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: StrictInt | list[StrictInt | None] | None = None
    top_logprobs_num: TopLogprobs | list[TopLogprobs | None] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    session_id: str | None = None
    log_metrics: bool = True
    model: str | None = None

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("text is an empty batch; give at least one prompt")
        starts = self.logprob_start_len if isinstance(self.logprob_start_len, list) else [self.logprob_start_len]
        if any(s not in (None, -1) for s in starts):
            raise ValueError(
                "logprob_start_len other than -1 (prompt logprobs) is not supported; "
                "output-token logprobs come with return_logprob=true"
            )
        if self.stream and self.is_batch:
            raise ValueError("streaming is supported for a single prompt, not a batch")
        n = self.batch_size
        for name in ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        if self.input_ids and isinstance(self.input_ids[0], list) and not all(self.input_ids):
            raise ValueError("input_ids must not contain an empty prompt")
        return self

    @property
    def is_batch(self) -> bool:
        if isinstance(self.text, list):
            return True
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]

    @property
    def batch_size(self) -> int:
        return len(self.text or self.input_ids or ()) if self.is_batch else 1

    def logprobs_of(self, prompt: int) -> LogprobSettings:
        """What prompt ``prompt`` of the batch asked for in logprobs (null: SGLang's defaults)."""
        wanted = bool(per_prompt(self.return_logprob, prompt))
        top = per_prompt(self.top_logprobs_num, prompt)
        return LogprobSettings(return_logprob=wanted, top_logprobs=(top or 0) if wanted else 0)


def per_prompt(value: Any, index: int) -> Any:
    """Prompt ``index``'s value of a setting given once for all prompts or as one per prompt."""
    return value[index] if isinstance(value, list) else value


class LogprobSettings(ResponseModel):
    """The logprobs one prompt of a request asked for."""

    return_logprob: bool
    top_logprobs: int


class FinishReason(ResponseModel):
    """Why a generation ended: ``length``, ``stop`` (with what matched) or ``abort``."""

    type: Literal["length", "stop", "abort"]
    length: int | None = None
    matched: int | str | None = None
    message: str | None = None


class WeightVersionSpan(ResponseModel):
    """Output tokens ``[start, end)`` of ``output_ids`` were sampled from ``weight_version``'s logits."""

    weight_version: str
    start: int
    end: int


class GenerateMetaInfo(ResponseModel):
    """``meta_info`` of a generation response; ``weight_version`` is the version at the end."""

    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    e2e_latency: float
    weight_version: str
    # The first and last spans' versions (the version current at the answer when no token was
    # produced).
    weight_version_start: str
    weight_version_end: str
    # Which weights produced which output tokens, in order, covering every output token once; two
    # or more spans when the weights changed under the request (in-place pause across an update, a
    # rename, a retracted request resumed on new weights). Empty without output tokens.
    weight_version_spans: list[WeightVersionSpan] = []
    # True when the request was cut short (aborted by a client, a pause or an update, or failed
    # inside the engine): the tokens so far are returned so the caller can resubmit.
    interrupted: bool = False
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    output_top_logprobs: list[list[tuple[float, int, str | None]]] | None = None


class GenerateResponse(ResponseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


class PauseMode(StrEnum):
    """What happens to in-flight requests when generation pauses: ``drain`` (running ones finish on
    the current weights), ``abort`` (running and queued ones end at once), ``retract`` (running
    ones return to the front of the queue with their tokens, to be prefilled again on the weights
    then current), ``in_place`` (they continue after the pause, possibly on new weights)."""

    DRAIN = "drain"
    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"


class PauseGenerationRequest(RequestModel):
    mode: PauseMode = PauseMode.ABORT


class ContinueGenerationRequest(RequestModel):
    torch_empty_cache: bool = False


class AbortRequest(RequestModel):
    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None

"""OpenAI-compatible completion and chat requests, and their translation to SGLang generate requests.

Requests keep OpenAI's field names; unknown fields are refused, and every value the native
``SamplingParams`` would refuse is refused here, at validation (a 400 naming the field, never a
failure inside the handler). Responses follow OpenAI's shapes and add one extension per choice,
``weight_version`` (plus ``weight_version_start`` and ``weight_version_spans``), so RL callers
using an OpenAI client still learn which weights produced each sample.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StrictFloat, StrictInt, ValidationError, field_validator, model_validator

from miles.protocol.base import Count, RequestModel
from miles.protocol.compat import (
    EXTRA_OUTPUT,
    GRAMMAR,
    LOGIT_PROCESSOR,
    MULTIMODAL,
    REASONING,
    SHARED_UNSUPPORTED,
    SGLangFields,
    Unsupported,
)
from miles.protocol.sglang import OPENAI_SAME_NAME, CommonSampling, GenerateResponse, SamplingParams

# Fields of both SGLang OpenAI requests that only affect logging, scheduling or caching.
_IGNORED = frozenset({"user", "extra_key", "cache_salt", "priority"})
# Fields of both that ask for something the engine does not do (see miles.protocol.compat).
_UNSUPPORTED: dict[str, Unsupported] = {
    **SHARED_UNSUPPORTED,
    "return_cached_tokens_details": Unsupported(EXTRA_OUTPUT, default=False),
    "return_spec_tokens_details": Unsupported(EXTRA_OUTPUT, default=False),
    "return_token_ids": Unsupported(EXTRA_OUTPUT, default=False),
    "regex": Unsupported(GRAMMAR, unset=("",)),
    "ebnf": Unsupported(GRAMMAR, unset=("",)),
    "stop_regex": Unsupported("stop regexes are not implemented; use stop strings or stop_token_ids"),
    "response_format": Unsupported(GRAMMAR + '; only {"type": "text"} is served', unset=({"type": "text"},)),
    "custom_params": Unsupported(LOGIT_PROCESSOR),
}
# Fields SGLang reads null as "the default" for.
_NULL_IS_DEFAULT = frozenset(
    {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "n"}
)


class StreamOptions(RequestModel):
    """``stream_options``: with ``include_usage``, a last chunk carries the usage (OpenAI's rule)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False

    @model_validator(mode="after")
    def _check(self) -> StreamOptions:
        if self.continuous_usage_stats:
            raise ValueError("continuous_usage_stats is not supported; use include_usage for the usage at the end")
        return self


class _SamplingFields(CommonSampling):
    null_is_default: ClassVar[frozenset[str]] = _NULL_IS_DEFAULT
    extension_fields: ClassVar[frozenset[str]] = frozenset({"min_weight_version"})
    model: str | None = None
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    min_tokens: Count = 0
    rid: str | None = None
    session_id: str | None = None
    # miles extension: a minimum weight version, honoured by the controller's router.
    min_weight_version: str | None = None

    @property
    def token_budget(self) -> int:
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self) -> SamplingParams:
        """The native sampling settings of this request; valid whenever the request is (the
        validator below builds them once, so a value the native model refuses is a 400 here)."""
        return SamplingParams(
            max_new_tokens=self.token_budget,
            min_new_tokens=self.min_tokens,
            sampling_seed=self.seed,
            no_stop_trim=self.no_stop_trim,
            **{name: getattr(self, name) for name in OPENAI_SAME_NAME},
        )

    @model_validator(mode="after")
    def _translatable(self) -> _SamplingFields:
        # The fields above share the native model's constraints; this catches any combination
        # that only the native model refuses, at validation instead of inside the handler.
        try:
            self.sampling_params()
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"these settings cannot be served: {problems}") from None
        return self


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``, with SGLang's ``CompletionRequest`` fields."""

    ignored_fields: ClassVar[frozenset[str]] = _IGNORED | {"custom_labels"}
    unsupported_fields: ClassVar[Mapping[str, Unsupported]] = {
        **_UNSUPPORTED,
        "json_schema": Unsupported(GRAMMAR, unset=("",)),
        "best_of": Unsupported("best_of is not supported; ask for n samples and pick", unset=(1,)),
        "suffix": Unsupported("insertion (suffix) is not supported", unset=("",)),
    }
    null_is_default: ClassVar[frozenset[str]] = _NULL_IS_DEFAULT | {"max_tokens"}

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: Count = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False

    @property
    def token_budget(self) -> int:
        return self.max_tokens

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(self.prompt, list) and any(isinstance(p, list) and not p for p in self.prompt):
            raise ValueError("prompt must not contain an empty list of token ids")
        batch = isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)
        if self.stream and batch:
            raise ValueError("streaming supports a single prompt")
        if self.rid is not None and batch:
            raise ValueError("rid names one request; a batch of prompts gets its own ids")
        return self


class ChatMessage(SGLangFields):
    """One message, with the fields of SGLang's ``ChatCompletionMessageGenericParam``."""

    unsupported_fields: ClassVar[Mapping[str, Unsupported]] = {
        "tool_calls": Unsupported("tool calling is not supported", unset=([],)),
        "tools": Unsupported("tool calling is not supported", unset=([],)),
        "phase": Unsupported("message phases (commentary, final_answer) are not rendered"),
        "prefix": Unsupported("prefix completion of a final assistant message is not supported", unset=(False,)),
    }

    # SGLang's roles, matched regardless of case as SGLang does; the chat template renders them.
    role: Literal["system", "user", "assistant", "tool", "function", "developer", "latest_reminder", "root"]
    # A string, or OpenAI's list of content parts of which only text parts are served; None (an
    # assistant turn that only called tools, say) renders as empty text.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: {MULTIMODAL}; send text parts")
            text = part.get("text")
            if not isinstance(text, str):
                # ValueError, not TypeError: pydantic turns only ValueError into a validation error.
                raise ValueError("a text content part needs its text as a string")  # noqa: TRY004
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a text content part holds a lone UTF-16 surrogate, which is not valid text") from None
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (text parts joined)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part["text"] for part in self.content)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``, with SGLang's ``ChatCompletionRequest`` fields."""

    ignored_fields: ClassVar[frozenset[str]] = _IGNORED | {
        # Output parsing of reasoning models; without a reasoning parser SGLang ignores them too.
        "separate_reasoning",
        "stream_reasoning",
        "parallel_tool_calls",
        # How flat logprob arrays would be encoded; they are refused (return_flat_raw_*) anyway.
        "return_flat_raw_top_logprobs_b64",
    }
    unsupported_fields: ClassVar[Mapping[str, Unsupported]] = {
        **_UNSUPPORTED,
        "tools": Unsupported("tool calling is not supported"),
        "tool_choice": Unsupported("tool calling is not supported", default="auto", unset=("none",)),
        "return_prompt_token_ids": Unsupported(EXTRA_OUTPUT, default=False),
        "return_meta_info": Unsupported(EXTRA_OUTPUT, default=False),
        "return_input_ids_in_sglext": Unsupported(EXTRA_OUTPUT, default=False),
        "return_output_ids_in_sglext": Unsupported(EXTRA_OUTPUT, default=False),
        "return_sampling_mask": Unsupported(EXTRA_OUTPUT, default=False),
        "sampling_logprobs_mode": Unsupported("logprobs are those of the model's raw distribution"),
        "return_flat_raw_output_top_logprobs": Unsupported(EXTRA_OUTPUT, default=False),
        "reasoning_effort": Unsupported(REASONING),
        "thinking": Unsupported(REASONING),
        "task": Unsupported("model-specific tasks are not supported"),
        "continue_final_message": Unsupported(
            "continuing the final assistant message is not supported; send the text to /v1/completions",
            default=False,
        ),
        "max_dynamic_patch": Unsupported(MULTIMODAL),
        "min_dynamic_patch": Unsupported(MULTIMODAL),
        "use_audio_in_video": Unsupported(MULTIMODAL, default=False),
        "video_config": Unsupported(MULTIMODAL),
        "input_ids": Unsupported("pre-tokenized chat input is not supported; send input_ids to /generate"),
    }

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    # Extra variables for the chat template (e.g. {"enable_thinking": false}); the engine refuses
    # names that are arguments of the template call itself.
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def token_budget(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else 128


def finish_reason(response: GenerateResponse) -> str | None:
    reason = response.meta_info.finish_reason
    return None if reason is None else reason.type


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_body(
    responses: list[GenerateResponse], *, model: str, request_id: str, with_logprobs: bool
) -> dict[str, Any]:
    choices = []
    for response in responses:
        pairs = response.meta_info.output_token_logprobs if with_logprobs else None
        logprobs = None
        if pairs is not None:
            logprobs = {"token_logprobs": [lp for lp, _, _ in pairs], "tokens": [str(tok) for _, tok, _ in pairs]}
        choices.append({"text": response.text, "logprobs": logprobs})
    return _body("text_completion", responses, choices, model=model, request_id=request_id)


def chat_body(responses: list[GenerateResponse], *, model: str, request_id: str, with_logprobs: bool) -> dict[str, Any]:
    choices = []
    for response in responses:
        pairs = response.meta_info.output_token_logprobs if with_logprobs else None
        logprobs = None
        if pairs is not None:
            logprobs = {"content": [{"token": str(tok), "logprob": lp} for lp, tok, _ in pairs]}
        choices.append({"message": {"role": "assistant", "content": response.text}, "logprobs": logprobs})
    return _body("chat.completion", responses, choices, model=model, request_id=request_id)


def _body(
    kind: str, responses: list[GenerateResponse], choices: list[dict[str, Any]], *, model: str, request_id: str
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": index, **choice, "finish_reason": finish_reason(response), **versions(response)}
            for index, (response, choice) in enumerate(zip(responses, choices, strict=True))
        ],
        "usage": usage_of(responses),
    }


def versions(response: GenerateResponse) -> dict[str, Any]:
    """The miles extension every choice carries: which weights produced it (see GenerateMetaInfo)."""
    meta = response.meta_info
    return {
        "weight_version": meta.weight_version_end,
        "weight_version_start": meta.weight_version_start,
        "weight_version_spans": [span.model_dump(mode="json") for span in meta.weight_version_spans],
    }


def usage_of(responses: list[GenerateResponse]) -> dict[str, int]:
    # Every choice of one request shares its prompt; count it once.
    prompt = responses[0].meta_info.prompt_tokens if responses else 0
    completion = sum(r.meta_info.completion_tokens for r in responses)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

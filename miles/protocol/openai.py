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
from typing import Annotated, Any, Literal

from pydantic import Field, StrictFloat, StrictInt, ValidationError, model_validator

from miles.protocol.base import Count, Penalty, RequestModel, Seed, Stop, TopK, TopP
from miles.protocol.sglang import GenerateResponse, SamplingParams


class _SamplingFields(RequestModel):
    model: str | None = None
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    n: Annotated[StrictInt, Field(ge=1, le=64)] = 1
    stream: bool = False
    stop: Stop = None
    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    user: str | None = None
    # miles extensions: sticky routing and a minimum weight version, honoured by the controller.
    session_id: str | None = None
    min_weight_version: str | None = None

    @property
    def token_budget(self) -> int:
        raise NotImplementedError

    def sampling_params(self) -> SamplingParams:
        """The native sampling settings of this request; valid whenever the request is (the
        validator below builds them once, so a value the native model refuses is a 400 here)."""
        return SamplingParams(
            max_new_tokens=self.token_budget,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            n=self.n,
            stop=self.stop,
            sampling_seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
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
        if self.stream and isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            raise ValueError("streaming supports a single prompt")
        return self


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    @property
    def token_budget(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else 128


def finish_reason(response: GenerateResponse) -> str | None:
    reason = response.meta_info.finish_reason
    if reason is None:
        return None
    return {"length": "length", "stop": "stop", "abort": "abort"}[reason.type]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_body(
    responses: list[GenerateResponse], *, model: str, request_id: str, with_logprobs: bool
) -> dict[str, Any]:
    choices = []
    for index, response in enumerate(responses):
        logprobs = None
        if with_logprobs and response.meta_info.output_token_logprobs is not None:
            logprobs = {
                "token_logprobs": [lp for lp, _, _ in response.meta_info.output_token_logprobs],
                "tokens": [str(tok) for _, tok, _ in response.meta_info.output_token_logprobs],
            }
        choices.append(
            {
                "index": index,
                "text": response.text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(response),
                **versions(response),
            }
        )
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(responses),
    }


def chat_body(
    responses: list[GenerateResponse], *, model: str, request_id: str, with_logprobs: bool
) -> dict[str, Any]:
    choices = []
    for index, response in enumerate(responses):
        logprobs = None
        if with_logprobs and response.meta_info.output_token_logprobs is not None:
            logprobs = {
                "content": [
                    {"token": str(tok), "logprob": lp} for lp, tok, _ in response.meta_info.output_token_logprobs
                ]
            }
        choices.append(
            {
                "index": index,
                "message": {"role": "assistant", "content": response.text},
                "logprobs": logprobs,
                "finish_reason": finish_reason(response),
                **versions(response),
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(responses),
    }


def versions(response: GenerateResponse) -> dict[str, Any]:
    """The miles extension every choice carries: which weights produced it (see GenerateMetaInfo)."""
    meta = response.meta_info
    return {
        "weight_version": meta.weight_version_end,
        "weight_version_start": meta.weight_version_start,
        "weight_version_spans": [span.model_dump(mode="json") for span in meta.weight_version_spans],
    }


def _usage(responses: list[GenerateResponse]) -> dict[str, int]:
    # Every choice of one request shares its prompt; count it once.
    prompt = responses[0].meta_info.prompt_tokens if responses else 0
    completion = sum(r.meta_info.completion_tokens for r in responses)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

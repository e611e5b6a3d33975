"""SGLang's native ``/generate``, spoken to a server that answers only OpenAI's ``/v1/completions``
(vLLM): the request as one completions request per prompt, each answer as SGLang's.

The translation, field by field: docs/VLLM.md, "SGLang's /generate for a model served by vLLM".
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from miles.errors import InvalidRequestError
from miles.protocol.sglang import (
    OPENAI_SAME_NAME,
    FinishReason,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    SamplingParams,
    WeightVersionSpan,
    per_prompt,
)

_TOKEN_ID = "token_id:"
# SGLang's (logprob, token id, token text): the text is never given here.
Logprob = tuple[float, int, str | None]


def parse_generate(body: dict[str, Any]) -> GenerateRequest:
    """``body`` as SGLang's request; InvalidRequestError where a completions server cannot serve it."""
    try:
        request = GenerateRequest.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {str(e['msg']).removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise InvalidRequestError(f"invalid request: {problems}") from None
    if request.stream:
        raise InvalidRequestError(
            "stream: /generate is not streamed for a model served by vLLM; stream from /v1/completions"
        )
    if request.return_text_in_logprobs:
        raise InvalidRequestError(
            "return_text_in_logprobs: not available for a model served by vLLM (logprobs name token ids); "
            "leave it false"
        )
    return request


def _prompt(request: GenerateRequest, index: int) -> str | list[int]:
    if request.text is not None:
        return request.text[index] if isinstance(request.text, list) else request.text
    ids = request.input_ids or []
    return list(ids[index]) if ids and isinstance(ids[0], list) else list(ids)


def completion_body(request: GenerateRequest, index: int) -> dict[str, Any]:
    """The ``/v1/completions`` body for prompt ``index`` of ``request``."""
    sampling: SamplingParams = per_prompt(request.sampling_params, index) or SamplingParams()
    body: dict[str, Any] = {
        "prompt": _prompt(request, index),
        "max_tokens": sampling.max_new_tokens,
        "min_tokens": sampling.min_new_tokens,
        "include_stop_str_in_output": sampling.no_stop_trim,
        "return_token_ids": True,
    }
    body.update({name: getattr(sampling, name) for name in OPENAI_SAME_NAME if getattr(sampling, name) is not None})
    if sampling.effective_seed is not None:
        body["seed"] = sampling.effective_seed
    logprobs = request.logprobs_of(index)
    if logprobs.return_logprob:
        body["logprobs"] = logprobs.top_logprobs
        body["return_tokens_as_token_ids"] = True
    return body


class _Logprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None


class _Choice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: _Logprobs | None = None


class _Completion(BaseModel):
    id: str
    choices: list[_Choice]


def _token_id(name: str) -> int:
    if not name.startswith(_TOKEN_ID):
        raise ValueError(f"a logprob names token {name!r}, not a token id")
    return int(name.removeprefix(_TOKEN_ID))


def _finish(choice: _Choice) -> FinishReason | None:
    if choice.finish_reason == "length":
        return FinishReason(type="length", length=len(choice.token_ids))
    if choice.finish_reason == "stop":
        return FinishReason(type="stop", matched=choice.stop_reason)
    if choice.finish_reason is None:
        return None
    return FinishReason(type="abort", message=choice.finish_reason)


def generate_answers(
    request: GenerateRequest, index: int, answer: bytes, *, versions: tuple[str, str], latency_s: float
) -> list[dict[str, Any]]:
    """SGLang's answers (one per sample, in order) to prompt ``index`` from vLLM's completions
    ``answer``; ``versions``: the answering server's weight version when the request was sent
    and when the answer came. ValueError when the answer is not a completions answer."""
    completion = _Completion.model_validate_json(answer)
    rid = per_prompt(request.rid, index)
    logprobs = request.logprobs_of(index)
    start, end = versions
    choices = sorted(completion.choices, key=lambda c: c.index)
    prompt_tokens = next((len(c.prompt_token_ids) for c in choices if c.prompt_token_ids is not None), 0)
    answers = []
    for choice in choices:
        base = rid or completion.id
        sampled = len(choice.token_ids)
        spans = [WeightVersionSpan(weight_version=end, start=0, end=sampled)] if sampled and start == end else []
        meta = GenerateMetaInfo(
            id=base if len(choices) == 1 else f"{base}-{choice.index}",
            finish_reason=_finish(choice),
            prompt_tokens=prompt_tokens,
            completion_tokens=sampled,
            e2e_latency=latency_s,
            weight_version=end,
            weight_version_start=start,
            weight_version_end=end,
            weight_version_spans=spans,
            interrupted=choice.finish_reason not in (None, "stop", "length"),
            output_token_logprobs=_sampled_logprobs(choice) if logprobs.return_logprob else None,
            output_top_logprobs=_top_logprobs(choice, logprobs.top_logprobs) if logprobs.top_logprobs else None,
        )
        answers.append(GenerateResponse(text=choice.text, output_ids=choice.token_ids, meta_info=meta))
    return [a.model_dump(mode="json") for a in answers]


def _sampled_logprobs(choice: _Choice) -> list[Logprob]:
    if choice.logprobs is None or len(choice.logprobs.token_logprobs) != len(choice.token_ids):
        raise ValueError("the answer has no logprob for every output token")
    pairs = zip(choice.logprobs.token_logprobs, choice.logprobs.tokens, choice.token_ids, strict=True)
    out: list[Logprob] = []
    for logprob, name, token in pairs:
        if logprob is None or _token_id(name) != token:
            raise ValueError("the answer's logprobs name other tokens than its token_ids")
        out.append((logprob, token, None))
    return out


def _top_logprobs(choice: _Choice, k: int) -> list[list[Logprob]]:
    tops = choice.logprobs.top_logprobs if choice.logprobs is not None else None
    if tops is None or len(tops) != len(choice.token_ids):
        raise ValueError("the answer has no top logprobs for every output token")
    ranked = (sorted(((lp, _token_id(name)) for name, lp in (top or {}).items()), key=lambda p: -p[0]) for top in tops)
    return [[(lp, token, None) for lp, token in pairs[:k]] for pairs in ranked]

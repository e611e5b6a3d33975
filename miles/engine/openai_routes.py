"""OpenAI-compatible routes, translated: completion and chat requests into native generate
requests (the chat template applied), and native snapshots back into OpenAI's stream chunks."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from miles.engine.engine import ENCODE_OFF_LOOP_CHARS, Engine
from miles.errors import InvalidRequestError
from miles.protocol.openai import ChatCompletionRequest, CompletionRequest, finish_reason, usage_of, versions
from miles.protocol.sglang import GenerateRequest, GenerateResponse
from miles.utils.http import sse


def _generate_request(
    request: CompletionRequest | ChatCompletionRequest, *, return_logprob: bool, top_logprobs_num: int, **prompt: Any
) -> GenerateRequest:
    """The native request ``request`` translates to, with ``prompt`` (its text or input_ids)."""
    # The OpenAI models refuse what the native ones would (miles.protocol.openai), so this only
    # guards against the two drifting apart: a 400 naming the field, not a 500.
    try:
        return GenerateRequest(
            **prompt,
            sampling_params=request.sampling_params(),
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            stream=request.stream,
            rid=request.rid,
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors())
        raise InvalidRequestError(f"invalid request: {problems}") from None


def completion_to_generate(request: CompletionRequest) -> GenerateRequest:
    prompt = request.prompt
    text = isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], str))
    return _generate_request(
        request,
        return_logprob=request.logprobs is not None,
        top_logprobs_num=request.logprobs or 0,
        **{"text" if text else "input_ids": prompt},
    )


# apply_chat_template's own parameters: chat_template_kwargs are variables for the template (as in
# SGLang), never a way to pass another template, tools or output options to the call.
_TEMPLATE_PARAMETERS = frozenset(
    name
    for name, p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.items()
    if p.kind is not p.VAR_KEYWORD
)


async def chat_to_generate(engine: Engine, request: ChatCompletionRequest) -> GenerateRequest:
    messages = [m.for_template() for m in request.messages]
    reserved = sorted((request.chat_template_kwargs or {}).keys() & _TEMPLATE_PARAMETERS)
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs must not set {reserved}: they are arguments of the template call, which "
            "the engine sets itself; pass only variables the chat template reads"
        )

    def render() -> str:
        try:
            text = engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **(request.chat_template_kwargs or {})
            )
        except Exception as exc:  # the template is user data (from the checkpoint); any failure is theirs
            raise InvalidRequestError(f"the model's chat template could not render these messages: {exc}") from exc
        if not isinstance(text, str):
            raise InvalidRequestError("the model's chat template did not render these messages to one text")
        return text

    # A long conversation renders on a worker thread, so the event loop keeps serving meanwhile.
    long = sum(len(str(m.get("content") or "")) for m in messages) >= ENCODE_OFF_LOOP_CHARS
    rendered = await asyncio.to_thread(render) if long else render()
    # The template writes the special tokens itself (as apply_chat_template(tokenize=True) does).
    (ids,) = await engine.encode([rendered], add_special_tokens=False)
    return _generate_request(
        request, input_ids=ids, return_logprob=request.logprobs, top_logprobs_num=request.top_logprobs or 0
    )


async def openai_stream(
    snapshots: AsyncIterator[GenerateResponse], *, model: str, rid: str, chat: bool, usage: bool
) -> AsyncIterator[bytes]:
    sent = ""
    kind = "chat.completion.chunk" if chat else "text_completion"
    last: GenerateResponse | None = None
    async for snapshot in snapshots:
        last = snapshot
        reason = finish_reason(snapshot)
        # Snapshots carry the whole text so far; OpenAI streams deltas. A trailing U+FFFD may be
        # an incomplete UTF-8 sequence that the next token completes, so it is held back.
        stable = snapshot.text if reason is not None else snapshot.text.rstrip("\ufffd")
        delta = ""
        if stable.startswith(sent):  # else a stop string was trimmed from text already sent
            delta, sent = stable[len(sent) :], stable
        if not delta and reason is None:
            continue
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if chat:
            choice["delta"] = {"role": "assistant", "content": delta}
        else:
            choice["text"] = delta
        if reason is not None:
            choice.update(versions(snapshot))
        yield sse({"id": rid, "object": kind, "model": model, "choices": [choice]})
    if usage and last is not None:
        # OpenAI's stream_options.include_usage: one more chunk, with no choices, before [DONE].
        yield sse({"id": rid, "object": kind, "model": model, "choices": [], "usage": usage_of([last])})
    yield sse("[DONE]")

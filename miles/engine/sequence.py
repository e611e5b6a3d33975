"""One generation request as the scheduler tracks it, and the responses it renders.

Each output token is credited to the weights whose logits it was sampled from (``logits_version``
when it was sampled; docs/ENGINE.md, "Weight versions").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from miles.engine.sampling import RowSampler
from miles.protocol.sglang import FinishReason, GenerateMetaInfo, GenerateResponse, WeightVersionSpan


class ResultSink(Protocol):
    """Where a sequence's progress and final result go (called from the scheduler thread)."""

    def progress(self, snapshot: GenerateResponse) -> None: ...

    def finish(self, response: GenerateResponse) -> None: ...


class Detokenizer(Protocol):
    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str: ...


@dataclass(eq=False)
class Sequence:
    """One generation request (mutable; owned by the scheduler thread once it runs)."""

    rid: str
    prompt_ids: list[int]
    sampler: RowSampler
    sink: ResultSink
    stream: bool = False
    top_logprobs: int = 0
    return_logprob: bool = False
    arrived: float = field(default_factory=time.monotonic)
    # When the first output token was sampled (time to first token); None until then.
    first_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)
    # The version of the weights that computed the logits the next token will be sampled from;
    # None while the sequence has no logits (waiting, or retracted back to the queue).
    logits_version: str | None = None
    # (version, first output index) where each weight-version span starts; it ends where the next does.
    _spans: list[tuple[str, int]] = field(default_factory=list, init=False, repr=False)

    @property
    def history(self) -> list[int]:
        """Prompt and output so far: what a prefill must see to continue this sequence."""
        return self.prompt_ids + self.output_ids

    def record(self, token: int, *, logprob: float | None, top: list[tuple[float, int]]) -> None:
        """Append one sampled token, credited to the weights that computed its logits."""
        assert self.logits_version is not None, f"request {self.rid} sampled a token without logits"
        index = len(self.output_ids)
        if index == 0 and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.output_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.top_logprobs:
            self.top.append(top)
        if not self._spans or self._spans[-1][0] != self.logits_version:
            self._spans.append((self.logits_version, index))

    def stop_reason(self, detokenizer: Detokenizer) -> FinishReason | None:
        """Why the sequence ends after its last token, or None when it goes on."""
        params = self.sampler.params
        last = self.output_ids[-1]
        if len(self.output_ids) >= params.min_new_tokens:
            if last in self.sampler.stop_ids:
                return FinishReason(type="stop", matched=last)
            if params.stop_strings:
                text = self._text(detokenizer)
                for stop in params.stop_strings:
                    if stop in text:
                        return FinishReason(type="stop", matched=stop)
        if len(self.output_ids) >= params.token_budget:
            return FinishReason(type="length", length=len(self.output_ids))
        return None

    def response(
        self, reason: FinishReason | None, *, interrupted: bool, detokenizer: Detokenizer, current_version: str
    ) -> GenerateResponse:
        """The response (or, with ``reason`` None, a stream snapshot) for the output so far.

        ``current_version`` is reported as the start and end version when no token was produced.
        """
        params = self.sampler.params
        text = self._text(detokenizer)
        if reason is not None and reason.type == "stop" and not params.no_stop_trim:
            # Like SGLang, the text excludes what stopped it (unless no_stop_trim); output_ids keep it.
            if isinstance(reason.matched, str):
                text = text[: text.index(reason.matched)]
            else:
                text = detokenizer.decode(self.output_ids[:-1], skip_special_tokens=params.skip_special_tokens)
        # The last end is the output's length; zip drops it when no token was produced (no span).
        ends = [start for _, start in self._spans[1:]] + [len(self.output_ids)]
        spans = [
            WeightVersionSpan(weight_version=version, start=start, end=end)
            for (version, start), end in zip(self._spans, ends, strict=False)
        ]
        start = spans[0].weight_version if spans else current_version
        end = spans[-1].weight_version if spans else current_version
        # SGLang's shape: (logprob, token id, token text); the text is never filled in.
        logprobs: list[tuple[float, int, str | None]] | None = None
        top: list[list[tuple[float, int, str | None]]] | None = None
        if self.return_logprob:
            logprobs = [(lp, tok, None) for lp, tok in zip(self.logprobs, self.output_ids, strict=False)]
            if self.top_logprobs:
                top = [[(lp, tok, None) for lp, tok in pairs] for pairs in self.top]
        return GenerateResponse(
            text=text,
            output_ids=list(self.output_ids),
            meta_info=GenerateMetaInfo(
                id=self.rid,
                finish_reason=reason,
                prompt_tokens=len(self.prompt_ids),
                completion_tokens=len(self.output_ids),
                e2e_latency=time.monotonic() - self.arrived,
                weight_version=end,
                weight_version_start=start,
                weight_version_end=end,
                weight_version_spans=spans,
                interrupted=interrupted,
                output_token_logprobs=logprobs,
                output_top_logprobs=top,
            ),
        )

    def _text(self, detokenizer: Detokenizer) -> str:
        return detokenizer.decode(self.output_ids, skip_special_tokens=self.sampler.params.skip_special_tokens)

"""Sampling groups of completions from SGLang-compatible ``/generate`` endpoints (adapter).

One request per prompt (``n = G``) keeps a prompt's G answers together whatever order a server
gives a batch; the requests run concurrently, so the server still batches them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from miles.errors import RolloutRequestError
from miles.protocol.sglang import GenerateResponse
from miles.train.config import TEMPERATURE
from miles.train.task import NEWLINE_TOKEN_ID


@dataclass(frozen=True, slots=True)
class Sample:
    """One completion as the server produced it."""

    output_ids: tuple[int, ...]
    # The server's logprob of each output token (raw distribution, temperature 1).
    logprobs: tuple[float, ...]
    # ``meta_info.weight_version``: the version the last token was generated on.
    weight_version: str
    # The version the first token was generated on (they differ when an update came mid-answer).
    weight_version_start: str
    # Cut short by a pause or an update (partial rollout); the trainer leaves these out.
    interrupted: bool


@dataclass(frozen=True, slots=True)
class Group:
    """The completions sampled for one prompt."""

    prompt_ids: tuple[int, ...]
    samples: tuple[Sample, ...]


class Sampler(Protocol):
    """Where training samples come from."""

    async def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        min_weight_version: str | None = None,
    ) -> list[Group]:
        """One ``Group`` of ``group_size`` samples per prompt, in prompt order, generated on
        ``min_weight_version`` or later when given; RolloutRequestError when a request failed."""


class HttpSampler:
    """A ``Sampler`` over one or more ``/generate`` base URLs (controller or engines)."""

    def __init__(self, urls: Sequence[str], *, http: httpx.AsyncClient, timeout_s: float = 120.0) -> None:
        """``http`` is the caller's to close; ValueError when no URL is given."""
        if not urls:
            raise ValueError("give at least one /generate base URL")
        self._http = http
        self._timeout_s = timeout_s
        # Continues across calls, so that with several URLs every server gets its share even
        # when each call has fewer prompts than there are servers.
        self._next_url = itertools.cycle([u.rstrip("/") for u in urls])

    async def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        min_weight_version: str | None = None,
    ) -> list[Group]:
        """``min_weight_version`` needs a controller's URL (an engine would refuse the field)."""
        params = {
            "n": group_size,
            "temperature": TEMPERATURE,
            "max_new_tokens": max_new_tokens,
            # EOS ends a completion by default; a newline ends it too (one answer per line).
            "stop_token_ids": [NEWLINE_TOKEN_ID],
        }
        since = {} if min_weight_version is None else {"min_weight_version": min_weight_version}
        bodies = [{"input_ids": list(p), "sampling_params": params, "return_logprob": True, **since} for p in prompts]
        return list(await asyncio.gather(*(self._one(next(self._next_url), b, group_size=group_size) for b in bodies)))

    async def _one(self, url: str, payload: dict[str, Any], *, group_size: int) -> Group:
        try:
            response = await self._http.post(f"{url}/generate", json=payload, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            raise RolloutRequestError(f"/generate failed: {type(exc).__name__}: {exc}", url=url) from exc
        if response.status_code != 200:
            raise RolloutRequestError(f"/generate answered {response.status_code}: {response.text[:300]}", url=url)
        body = response.json()
        items = body if isinstance(body, list) else [body]
        if len(items) != group_size:
            raise RolloutRequestError(f"/generate returned {len(items)} completions for n={group_size}", url=url)
        samples = tuple(_parse_sample(item, url=url) for item in items)
        return Group(prompt_ids=tuple(payload["input_ids"]), samples=samples)


def _parse_sample(item: Any, *, url: str) -> Sample:
    try:
        response = GenerateResponse.model_validate(item)
    except ValidationError as exc:
        raise RolloutRequestError(f"/generate answer does not fit the SGLang response: {exc}", url=url) from exc
    meta = response.meta_info
    pairs = meta.output_token_logprobs
    if pairs is None or len(pairs) != len(response.output_ids):
        raise RolloutRequestError(
            "/generate returned no per-token logprob for every output token; it must honour return_logprob",
            url=url,
            output_tokens=len(response.output_ids),
            logprobs=None if pairs is None else len(pairs),
        )
    if any(token != out for (_, token, _), out in zip(pairs, response.output_ids, strict=True)):
        raise RolloutRequestError("/generate logprobs name other tokens than output_ids", url=url, rid=meta.id)
    interrupted = meta.interrupted or (meta.finish_reason is not None and meta.finish_reason.type == "abort")
    return Sample(
        output_ids=tuple(response.output_ids),
        logprobs=tuple(float(lp) for lp, _, _ in pairs),
        weight_version=meta.weight_version,
        weight_version_start=meta.weight_version_start,
        interrupted=interrupted,
    )

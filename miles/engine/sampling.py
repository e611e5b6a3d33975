"""Next-token selection for a batch: penalties, temperature, top-k / top-p / min-p, seeded draws.

Each row keeps its own ``torch.Generator``, and logprobs are those of the raw distribution
(docs/ENGINE.md, "Sampling"); the scheduler calls ``sample_rows``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from miles.protocol.sglang import SamplingParams

logger = logging.getLogger("miles.engine")


@dataclass(frozen=True)
class RowSampler:
    """The sampling state one sequence carries from step to step."""

    params: SamplingParams
    generator: torch.Generator | None
    # Token ids that end generation: EOS (unless ignore_eos) and stop_token_ids.
    stop_ids: frozenset[int]
    # logit_bias as (token ids, values), built once per request; None without a bias.
    bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def create(params: SamplingParams, *, eos_ids: frozenset[int]) -> RowSampler:
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device="cpu")
            seed = params.effective_seed
            generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= eos_ids
        bias = None
        if params.bias:
            ids, values = zip(*sorted(params.bias.items()), strict=True)
            bias = (torch.tensor(ids, dtype=torch.long), torch.tensor(values, dtype=torch.float32))
        return RowSampler(params=params, generator=generator, stop_ids=frozenset(stop_ids), bias=bias)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        p = self.params
        return p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1


@dataclass(frozen=True)
class SampledTokens:
    tokens: list[int]
    # Per row, the chosen token's logprob when the row asked for logprobs, else None.
    logprobs: list[float | None]
    # Per row, the top-k (logprob, token id) pairs when asked for, else an empty list.
    top: list[list[tuple[float, int]]]


@dataclass(frozen=True)
class SampledRow:
    """One row's selection: the token, its logprob (when asked for) and its top alternatives."""

    token: int
    logprob: float | None
    top: list[tuple[float, int]]


@dataclass(frozen=True)
class SamplingFailure:
    """Selecting a token for this row raised, even alone; ``error`` carries the traceback."""

    error: Exception


def sample_rows(
    logits: torch.Tensor,
    samplers: list[RowSampler],
    *,
    histories: list[list[int]],
    output_lengths: list[int],
    want_logprobs: list[bool],
    top_logprobs: list[int],
) -> list[SampledRow | SamplingFailure]:
    """``sample_batch``, but a row whose selection raises fails alone: if the batch raises, every
    row is selected on its own, and only the rows that still raise come back as failures.

    Every row's random number is drawn before anything can raise and reused by the retry, so a
    seeded row draws the same token whether or not a neighbour broke the batch.
    """
    uniforms = _uniforms(samplers)

    def select(rows: slice) -> list[SampledRow | SamplingFailure]:  # SampledRows only, typed as returned below
        batch = sample_batch(
            logits[rows],
            samplers[rows],
            uniforms=uniforms[rows],
            histories=histories[rows],
            output_lengths=output_lengths[rows],
            want_logprobs=want_logprobs[rows],
            top_logprobs=top_logprobs[rows],
        )
        return [
            SampledRow(token=t, logprob=lp, top=top)
            for t, lp, top in zip(batch.tokens, batch.logprobs, batch.top, strict=True)
        ]

    try:
        return select(slice(None))
    except Exception:
        # Which row broke the batch is found by the retry below; each failing row is reported
        # (with its own traceback) by the caller.
        logger.warning("sampling a batch of %d rows failed; sampling each row alone", len(samplers), exc_info=True)
    results: list[SampledRow | SamplingFailure] = []
    for row in range(len(samplers)):
        try:
            results.extend(select(slice(row, row + 1)))
        except Exception as exc:  # noqa: BLE001  # this row alone cannot be sampled: it fails, its neighbours go on
            results.append(SamplingFailure(error=exc))
    return results


def _uniforms(samplers: list[RowSampler]) -> torch.Tensor:
    """One uniform number per row from its own generator (0 for greedy rows, which draw nothing)."""
    values = [float(torch.rand(1, generator=s.generator)) if s.generator is not None else 0.0 for s in samplers]
    return torch.tensor(values, dtype=torch.float32)


def sample_batch(
    logits: torch.Tensor,
    samplers: list[RowSampler],
    *,
    histories: list[list[int]],
    output_lengths: list[int],
    want_logprobs: list[bool],
    top_logprobs: list[int],
    uniforms: torch.Tensor | None = None,
) -> SampledTokens:
    """Pick one token per row of ``logits`` ([B, V]) following each row's sampling settings.

    ``histories`` are prompt + output ids per row (for penalties), ``output_lengths`` the number of
    tokens generated so far (for ``min_new_tokens``), ``want_logprobs`` / ``top_logprobs`` what each
    row wants reported, ``uniforms`` each row's random number (drawn from its generator when not
    given). Batched as docs/ENGINE.md ("Sampling") describes.
    """
    if uniforms is None:
        uniforms = _uniforms(samplers)
    logits = logits.float()
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    sampled = [row for row, sampler in enumerate(samplers) if not sampler.greedy]
    # The sampled rows' logits, gathered once; penalties and masks are applied to their lines here.
    sampled_logits = logits.index_select(0, torch.tensor(sampled, dtype=torch.long)) if sampled else None
    line_of = {row: line for line, row in enumerate(sampled)}
    for row, sampler in enumerate(samplers):
        masking = output_lengths[row] < sampler.params.min_new_tokens and bool(sampler.stop_ids)
        if not sampler.needs_penalties and not masking and sampler.bias is None:
            continue
        # An adjusted row: a copy for a greedy row, its own line of `sampled_logits` for a sampled one.
        row_logits = logits[row].clone() if sampler.greedy else sampled_logits[line_of[row]]  # type: ignore[index]
        if sampler.bias is not None:
            # Logprobs are still reported under the raw logits (see the module docstring).
            ids, values = sampler.bias
            row_logits[ids] += values
        if sampler.needs_penalties:
            _apply_penalties(row_logits, sampler.params, histories[row], output_lengths[row])
        if masking:
            row_logits[list(sampler.stop_ids)] = float("-inf")
        if sampler.greedy:
            tokens[row] = int(torch.argmax(row_logits).item())
    if sampled:
        assert sampled_logits is not None
        drawn = _draw(sampled_logits, [samplers[row] for row in sampled], uniforms[sampled])
        for row, token in zip(sampled, drawn, strict=True):
            tokens[row] = token
    logprobs: list[float | None] = [None] * len(samplers)
    top: list[list[tuple[float, int]]] = [[] for _ in samplers]
    reporting = [row for row in range(len(samplers)) if want_logprobs[row] or top_logprobs[row]]
    if reporting:
        index = torch.tensor(reporting, dtype=torch.long)
        raw = torch.log_softmax(logits.index_select(0, index), dim=-1)
        chosen = raw.gather(1, torch.tensor([tokens[r] for r in reporting]).unsqueeze(1)).squeeze(1).tolist()
        widest = max(top_logprobs[r] for r in reporting)
        if widest:
            values, ids = torch.topk(raw, k=min(widest, raw.shape[-1]), dim=-1)
        for i, row in enumerate(reporting):
            if want_logprobs[row]:
                logprobs[row] = chosen[i]
            if k := top_logprobs[row]:
                top[row] = list(zip(values[i, :k].tolist(), ids[i, :k].tolist(), strict=True))
    return SampledTokens(tokens=tokens, logprobs=logprobs, top=top)


def _draw(logits: torch.Tensor, samplers: list[RowSampler], uniform: torch.Tensor) -> list[int]:
    """One seeded draw per row of ``logits`` ([S, V], penalties applied), after temperature and the
    top-k, top-p and min-p filters, all rows at once: each row inverts its cumulative distribution
    (in token-id order) at its ``uniform``, so its token never depends on its neighbours."""
    vocab = logits.shape[-1]
    params = [s.params for s in samplers]
    temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
    if any(0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0 for p in params):
        probs, order = torch.sort(probs, dim=-1, descending=True)
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]).unsqueeze(1)
        kth = probs.gather(1, top_k - 1)
        probs = torch.where(probs >= kth, probs, 0.0)
        # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
        cumulative = probs.cumsum(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
        probs = probs.masked_fill(cumulative - probs > top_p * cumulative[:, -1:], 0.0)
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
        probs = torch.where(probs >= min_p * probs[:, :1], probs, 0.0)
        # Back to token order: a row's draw must not depend on whether its neighbours filter.
        probs = torch.zeros_like(probs).scatter(1, order, probs)
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1]
    uniform = uniform.to(device=total.device, dtype=total.dtype)
    choice = torch.searchsorted(cumulative, (uniform * total).unsqueeze(1), right=True).squeeze(1)
    choice = choice.clamp(max=vocab - 1)
    # Every candidate filtered out (e.g. all logits -inf): fall back to the argmax.
    usable = torch.isfinite(total) & (total > 0)
    return torch.where(usable, choice, logits.argmax(dim=-1)).tolist()


def _apply_penalties(row_logits: torch.Tensor, params: SamplingParams, history: list[int], output_length: int) -> None:
    if params.repetition_penalty != 1 and history:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        selected = row_logits[seen]
        row_logits[seen] = torch.where(
            selected > 0, selected / params.repetition_penalty, selected * params.repetition_penalty
        )
    generated = history[len(history) - output_length :] if output_length else []
    if generated and (params.frequency_penalty != 0 or params.presence_penalty != 0):
        ids, counts = torch.tensor(generated, dtype=torch.long).unique(return_counts=True)
        row_logits[ids] -= params.frequency_penalty * counts.float() + params.presence_penalty

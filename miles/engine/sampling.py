"""Next-token selection for a batch: penalties, temperature, top-k / top-p / min-p, seeded draws.

Each row keeps its own ``torch.Generator`` so a seeded request draws the same tokens whatever else
shares its batch. Greedy rows (temperature 0) take the argmax and never touch a generator.
Logprobs are reported under the model's raw distribution (log-softmax of the logits before
temperature and filtering), which is what RL importance ratios need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.protocol.sglang import SamplingParams


@dataclass(frozen=True)
class RowSampler:
    """The sampling state one sequence carries from step to step."""

    params: SamplingParams
    generator: torch.Generator | None
    # Token ids that end generation: EOS (unless ignore_eos) and stop_token_ids.
    stop_ids: frozenset[int]

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
        return RowSampler(params=params, generator=generator, stop_ids=frozenset(stop_ids))

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


def sample_batch(
    logits: torch.Tensor,
    samplers: list[RowSampler],
    *,
    histories: list[list[int]],
    output_lengths: list[int],
    want_logprobs: list[bool],
    top_logprobs: list[int],
) -> SampledTokens:
    """Pick one token per row of ``logits`` ([B, V]) following each row's sampling settings.

    ``histories`` are prompt + output ids per row (for penalties), ``output_lengths`` the number of
    tokens generated so far (for ``min_new_tokens``), ``want_logprobs`` / ``top_logprobs`` what each
    row wants reported. Plain greedy rows share one batched argmax; the per-row work (penalties,
    masks, seeded draws) is done only for rows that need it.
    """
    logits = logits.float()
    greedy_choice = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, sampler in enumerate(samplers):
        params = sampler.params
        masking = output_lengths[row] < params.min_new_tokens and bool(sampler.stop_ids)
        if sampler.greedy and not sampler.needs_penalties and not masking:
            tokens.append(greedy_choice[row])
            continue
        row_logits = logits[row].clone()
        if sampler.needs_penalties:
            _apply_penalties(row_logits, params, histories[row], output_lengths[row])
        if masking:
            row_logits[list(sampler.stop_ids)] = float("-inf")
        if sampler.greedy:
            tokens.append(int(torch.argmax(row_logits).item()))
            continue
        probs = _filtered_probs(row_logits / params.temperature, params)
        tokens.append(int(torch.multinomial(probs, 1, generator=sampler.generator).item()))
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
            if top_logprobs[row]:
                k = top_logprobs[row]
                top[row] = list(zip(values[i, :k].tolist(), ids[i, :k].tolist()))
    return SampledTokens(tokens=tokens, logprobs=logprobs, top=top)


def _apply_penalties(
    row_logits: torch.Tensor, params: SamplingParams, history: list[int], output_length: int
) -> None:
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


def _filtered_probs(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    probs = torch.softmax(scaled, dim=-1)
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_probs > params.top_p * cumulative[-1]
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    total = probs.sum()
    if not torch.isfinite(total) or total <= 0:
        # Every candidate was filtered out (e.g. all logits -inf): fall back to the argmax.
        fallback = torch.zeros_like(probs)
        fallback[int(torch.argmax(scaled).item())] = 1.0
        return fallback
    return probs / total

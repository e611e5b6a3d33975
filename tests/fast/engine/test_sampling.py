"""Next-token selection: greedy, seeded batched draws, the filters, penalties and stop masks."""

from __future__ import annotations

import math

import pytest
import torch

from miles.engine.sampling import RowSampler, SampledRow, SamplingFailure, sample_batch, sample_rows
from miles.protocol.sglang import SamplingParams

EOS = 2


def _sampler(**params: object) -> RowSampler:
    return RowSampler.create(SamplingParams(max_new_tokens=16, **params), eos_ids=frozenset({EOS}))


def _sample(logits: torch.Tensor, samplers: list[RowSampler], *, output_length: int = 4, **kwargs: object):
    rows = len(samplers)
    options: dict[str, object] = {
        "histories": [[]] * rows,
        "output_lengths": [output_length] * rows,
        "want_logprobs": [False] * rows,
        "top_logprobs": [0] * rows,
    }
    options.update(kwargs)
    return sample_batch(logits, samplers, **options)  # type: ignore[arg-type]


def _frequencies(logits: torch.Tensor, draws: int, **params: object) -> torch.Tensor:
    """How often each token is drawn from one row of ``logits``, over ``draws`` seeded rows."""
    samplers = [_sampler(sampling_seed=seed, **params) for seed in range(draws)]
    tokens = _sample(logits.expand(draws, -1), samplers).tokens
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double() / draws


def test_greedy_rows_take_the_argmax_and_need_no_generator() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    samplers = [_sampler(temperature=0.0) for _ in range(5)]
    assert all(s.generator is None for s in samplers)
    assert _sample(logits, samplers).tokens == logits.argmax(-1).tolist()


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=generator)
    alone = [_sample(logits[row : row + 1], [_sampler(sampling_seed=row)]).tokens[0] for row in range(6)]
    # Same rows, in a batch with greedy, filtered and differently seeded neighbours, in another order.
    order = [5, 3, 0, 1, 4, 2]
    mixed = [_sampler(sampling_seed=row) for row in order] + [_sampler(temperature=0.0), _sampler(top_k=3, seed=99)]
    batch = torch.cat([logits[order], logits[:2]])
    tokens = _sample(batch, mixed).tokens
    assert [tokens[order.index(row)] for row in range(6)] == alone


def test_draws_follow_the_softmax_at_the_requested_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    draws = 20000
    for temperature in (1.0, 0.5):
        expected = torch.softmax(logits[0].double() / temperature, dim=-1)
        observed = _frequencies(logits, draws, temperature=temperature)
        # Five standard errors of a binomial proportion: fails on a wrong distribution, not on luck.
        tolerance = 5 * torch.sqrt(expected * (1 - expected) / draws)
        assert torch.all((observed - expected).abs() <= tolerance), (temperature, observed, expected)


def test_top_k_top_p_and_min_p_keep_only_their_candidates() -> None:
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    probs = torch.softmax(logits[0], dim=-1)
    draws = 4000

    top_k = _frequencies(logits, draws, top_k=3)
    assert top_k[3:].sum() == 0 and top_k[:3].min() > 0
    expected = probs[:3] / probs[:3].sum()
    assert torch.allclose(top_k[:3], expected.double(), atol=0.04)

    # The smallest prefix reaching 0.8 of the mass: tokens 0 and 1 hold 0.73, 0..2 hold 0.90.
    assert probs[:2].sum() < 0.8 < probs[:3].sum()
    top_p = _frequencies(logits, draws, top_p=0.8)
    assert top_p[3:].sum() == 0 and top_p[:3].min() > 0

    # min_p 0.5 keeps tokens at least half as likely as the best one: 0 and 1 (e^-0.5 = 0.61).
    min_p = _frequencies(logits, draws, min_p=0.5)
    assert min_p[2:].sum() == 0 and min_p[:2].min() > 0

    assert _frequencies(logits, 50, top_k=1)[0] == 1.0
    assert _frequencies(logits, 50, top_p=0.01)[0] == 1.0


def test_penalties_and_stop_masks_apply_to_their_rows_only() -> None:
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 0.0], [0.0, 0.0, 5.0, 4.0, 0.0]])
    plain, masked = _sampler(temperature=0.0), _sampler(temperature=0.0, min_new_tokens=8)
    # Token 2 is EOS: a row still under min_new_tokens cannot end, the other one can.
    assert _sample(logits, [plain, masked]).tokens == [2, 3]
    assert _sample(logits, [plain, masked], output_length=8).tokens == [2, 2]
    # A repetition penalty turns a greedy row away from a token it already produced.
    penalised = _sampler(temperature=0.0, repetition_penalty=2.0, ignore_eos=True)
    result = _sample(logits, [penalised, plain], histories=[[2], [2]])
    assert result.tokens == [3, 2]
    # The same penalty on a sampled row: token 2 (5.0 -> 2.5) now loses to token 3 most of the time.
    sampled = [_sampler(sampling_seed=s, repetition_penalty=2.0, ignore_eos=True, top_k=2) for s in range(400)]
    tokens = _sample(logits[:1].expand(400, -1), sampled, histories=[[2]] * 400).tokens
    share = tokens.count(3) / 400
    assert abs(share - 1 / (1 + math.exp(2.5 - 4.0))) < 0.08


def test_a_row_with_no_candidate_left_falls_back_to_the_argmax() -> None:
    logits = torch.full((2, 6), float("-inf"))
    logits[1, 4] = 1.0
    samplers = [_sampler(sampling_seed=1), _sampler(sampling_seed=2, top_k=2)]
    assert _sample(logits, samplers).tokens == [0, 4]


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_are_reported_under_the_raw_distribution(greedy: bool) -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    params = {"temperature": 0.0} if greedy else {"temperature": 0.7, "top_k": 5, "sampling_seed": 3}
    samplers = [_sampler(**params) for _ in range(3)]
    result = _sample(logits, samplers, want_logprobs=[True, False, True], top_logprobs=[0, 0, 4])
    raw = torch.log_softmax(logits, dim=-1)
    assert result.logprobs[1] is None and result.top[0] == [] and result.top[1] == []
    for row in (0, 2):
        assert result.logprobs[row] == pytest.approx(raw[row, result.tokens[row]].item(), abs=1e-6)
    values, ids = torch.topk(raw[2], 4)
    assert [token for _, token in result.top[2]] == ids.tolist()
    assert [value for value, _ in result.top[2]] == pytest.approx(values.tolist(), abs=1e-6)


def test_a_row_whose_sampling_raises_fails_alone_and_seeded_rows_draw_as_in_a_clean_batch() -> None:
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(5))
    clean = [_sampler(sampling_seed=11), _sampler(temperature=0.0), _sampler(sampling_seed=12, top_p=0.9)]
    expected = _sample(logits[[0, 1, 3]], clean).tokens
    # A stop id past the vocabulary, masked while under min_new_tokens, indexes past the logits.
    breaking = _sampler(temperature=0.0, min_new_tokens=8, stop_token_ids=[10**9])
    samplers = [_sampler(sampling_seed=11), _sampler(temperature=0.0), breaking, _sampler(sampling_seed=12, top_p=0.9)]
    rows = len(samplers)
    results = sample_rows(
        logits,
        samplers,
        histories=[[]] * rows,
        output_lengths=[4] * rows,
        want_logprobs=[False] * rows,
        top_logprobs=[0] * rows,
    )
    assert isinstance(results[2], SamplingFailure) and isinstance(results[2].error, IndexError)
    assert [r.token for r in results if isinstance(r, SampledRow)] == expected

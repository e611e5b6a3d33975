"""GRPO's formulas on hand-computed cases: group advantages and the clipped, token-mean loss."""

from __future__ import annotations

import math

import pytest
import torch

from miles.train.grpo import clipped_policy_loss, group_advantages


def test_advantages_are_group_normalised_with_population_std() -> None:
    # Group [0, 1]: mean 0.5, population std 0.5 -> (-1, +1). Group [1, 2, 3, 6]: mean 3,
    # population std sqrt((4 + 1 + 0 + 9) / 4) = sqrt(3.5).
    adv = group_advantages(torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 2.0, 3.0, 6.0]]), eps=0.0)
    assert torch.allclose(adv[0], torch.tensor([-1.0, 1.0, 1.0, -1.0]))
    s = math.sqrt(3.5)
    assert torch.allclose(adv[1], torch.tensor([-2 / s, -1 / s, 0.0, 3 / s]))


def test_eps_is_added_to_the_std() -> None:
    adv = group_advantages(torch.tensor([[0.0, 1.0]]), eps=0.5)
    assert torch.allclose(adv, torch.tensor([[-0.5, 0.5]]))


def test_zero_variance_group_gives_exactly_zero() -> None:
    # 0.1 * 3 is not exactly representable: the mean differs from the values in the last bit,
    # and dividing that by eps would otherwise give a huge advantage.
    adv = group_advantages(torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.0, 0.3]]), eps=1e-6)
    assert torch.equal(adv[0], torch.zeros(3))
    assert adv[1].abs().sum() > 0


def test_advantages_reject_groups_of_one() -> None:
    with pytest.raises(ValueError, match="group >= 2"):
        group_advantages(torch.tensor([[1.0], [0.0]]))
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 0.0]))


def _loss(ratio: list[list[float]], adv: list[float], mask: list[list[bool]], *, clip_eps: float = 0.2):
    server = torch.zeros(len(ratio), len(ratio[0]))
    trainer = torch.log(torch.tensor(ratio)).requires_grad_(True)
    result = clipped_policy_loss(
        logp_trainer=trainer,
        logp_server=server,
        advantages=torch.tensor(adv),
        mask=torch.tensor(mask),
        clip_eps=clip_eps,
    )
    return result, trainer


def test_unclipped_ratio_one_is_minus_the_token_mean_advantage() -> None:
    # Row 0 has 3 tokens with A=+1, row 1 has 1 token with A=-1 -> (-(3) + 1) / 4 = -0.5.
    result, _ = _loss([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [1.0, -1.0], [[True, True, True], [True, False, False]])
    assert result.loss.item() == pytest.approx(-0.5)
    assert result.num_tokens == 4
    assert result.clip_fraction == 0.0
    assert result.mean_ratio == pytest.approx(1.0)
    assert result.behaviour_kl == 0.0


def test_the_behaviour_kl_sees_a_gap_the_mean_ratio_averages_away() -> None:
    # Ratios 2 and 1/2 average to 1.25, and 0.5 and 1.5 to exactly 1: the mean ratio says little.
    # The estimate r - 1 - log r is 0 only at r = 1, and positive either side; masked tokens count
    # for nothing.
    result, _ = _loss([[0.5, 1.5, 9.0]], [0.0], [[True, True, False]])
    assert result.mean_ratio == pytest.approx(1.0)
    expected = ((0.5 - 1 - math.log(0.5)) + (1.5 - 1 - math.log(1.5))) / 2
    assert result.behaviour_kl == pytest.approx(expected)
    assert result.behaviour_kl > 0.05


def test_token_mean_weighs_tokens_not_sequences() -> None:
    # A per-sequence mean would give (-1 + -3) / 2 = -2; the token mean is (-1 - 3 - 3 - 3) / 4.
    result, _ = _loss([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [1.0, 3.0], [[True, False, False], [True, True, True]])
    assert result.loss.item() == pytest.approx(-10 / 4)


def test_positive_advantage_is_clipped_above_one_plus_eps() -> None:
    # A > 0: min(1.5 * 2, 1.2 * 2) = 2.4 -> loss -2.4, and no gradient through the clipped token.
    result, trainer = _loss([[1.5]], [2.0], [[True]])
    assert result.loss.item() == pytest.approx(-2.4)
    assert result.clip_fraction == 1.0
    result.loss.backward()
    assert trainer.grad is not None and trainer.grad.abs().sum() == 0
    # Below 1 + eps nothing is clipped for A > 0, even far below 1 - eps (no floor on the upside).
    result, _ = _loss([[0.5]], [2.0], [[True]])
    assert result.loss.item() == pytest.approx(-1.0)
    assert result.clip_fraction == 0.0


def test_negative_advantage_is_clipped_below_one_minus_eps() -> None:
    # A < 0: min(0.5 * -1, 0.8 * -1) = -0.8 -> loss 0.8, gradient cut.
    result, trainer = _loss([[0.5]], [-1.0], [[True]])
    assert result.loss.item() == pytest.approx(0.8)
    assert result.clip_fraction == 1.0
    result.loss.backward()
    assert trainer.grad is not None and trainer.grad.abs().sum() == 0
    # A large ratio with A < 0 is never clipped: the pessimistic term is the unclipped one.
    result, trainer = _loss([[1.5]], [-1.0], [[True]])
    assert result.loss.item() == pytest.approx(1.5)
    assert result.clip_fraction == 0.0
    result.loss.backward()
    # d(-ratio * A)/d logp = -A * ratio = 1.5
    assert trainer.grad is not None and trainer.grad[0, 0].item() == pytest.approx(1.5)


def test_mixed_batch_clips_per_token_and_ignores_masked_tokens() -> None:
    # Tokens: (1.5, A=+1) -> -1.2 clipped; (0.9, A=+1) -> -0.9; (0.5, A=-1) -> 0.8 clipped;
    # (7.0, masked) ignored. Mean over 3 tokens: (-1.2 - 0.9 + 0.8) / 3.
    result, _ = _loss([[1.5, 0.9], [0.5, 7.0]], [1.0, -1.0], [[True, True], [True, False]])
    assert result.loss.item() == pytest.approx((-1.2 - 0.9 + 0.8) / 3)
    assert result.clip_fraction == pytest.approx(2 / 3)
    assert result.mean_ratio == pytest.approx((1.5 + 0.9 + 0.5) / 3)


def test_gradient_of_the_unclipped_loss_is_the_policy_gradient() -> None:
    result, trainer = _loss([[1.0, 1.0]], [2.0], [[True, True]])
    result.loss.backward()
    # d/dlogp of -(exp(logp - logp_old) * A) / 2 tokens at ratio 1 = -A / 2.
    assert trainer.grad is not None and torch.allclose(trainer.grad, torch.tensor([[-1.0, -1.0]]))


def test_empty_batch_gives_a_zero_loss_that_backpropagates() -> None:
    result, trainer = _loss([[1.3]], [1.0], [[False]])
    assert result.loss.item() == 0.0 and result.num_tokens == 0
    result.loss.backward()
    assert trainer.grad is not None


def test_loss_rejects_bad_shapes_and_clip() -> None:
    with pytest.raises(ValueError, match="clip_eps"):
        _loss([[1.0]], [1.0], [[True]], clip_eps=1.5)
    with pytest.raises(ValueError, match="shapes differ"):
        clipped_policy_loss(
            logp_trainer=torch.zeros(2, 3),
            logp_server=torch.zeros(2, 2),
            advantages=torch.zeros(2),
            mask=torch.ones(2, 3, dtype=torch.bool),
            clip_eps=0.2,
        )
    with pytest.raises(ValueError, match="advantages"):
        clipped_policy_loss(
            logp_trainer=torch.zeros(2, 3),
            logp_server=torch.zeros(2, 3),
            advantages=torch.zeros(3),
            mask=torch.ones(2, 3, dtype=torch.bool),
            clip_eps=0.2,
        )

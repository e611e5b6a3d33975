"""GRPO's two formulas: group-normalised advantages and the clipped policy-gradient loss.

Advantages: within each group (the G completions of one prompt), ``(r - mean) / (std + eps)``
with the population standard deviation of the group (divide by G). A group whose rewards are all
equal carries no signal and gets exactly zero advantage.

Loss: per completion token, ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)`` with
``ratio = exp(logp_trainer - logp_server)``. Normalisation: **token mean over the whole batch**
(sum over every completion token of every sample, divided by the number of those tokens), so
every token weighs the same whatever the length of its completion (DAPO's choice; per-sequence
means would let short completions dominate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Advantages ``[P, G]`` for rewards ``[P, G]`` (one row per prompt, one column per sample).
    Raises ValueError when ``rewards`` is not two-dimensional or a group has fewer than two samples."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, group] with group >= 2, got shape {tuple(rewards.shape)}")
    rewards = rewards.double()
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    advantages = (rewards - mean) / (std + eps)
    # Exact comparison rather than std == 0: the mean of equal floats may differ from them in the
    # last bit, and that rounding noise divided by eps would be a large spurious advantage.
    flat = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(advantages), advantages).float()


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """The loss to backpropagate and what it says about the batch (an SFT step's loss leaves the
    rest at their neutral values)."""

    loss: torch.Tensor
    num_tokens: int = 0
    # Share of tokens where the clipped term was the smaller one (the gradient was cut there).
    clip_fraction: float = 0.0
    mean_ratio: float = 1.0
    # How far the trainer's policy is from the behaviour policy that sampled the tokens: the
    # token mean of ``ratio - 1 - log(ratio)``, an estimate of KL(behaviour || trainer) that is
    # never negative and 0 only when the logprobs agree. (The mean ratio itself is 1 in
    # expectation whatever the gap, so it cannot tell.)
    behaviour_kl: float = 0.0


def clipped_policy_loss(
    *,
    logp_trainer: torch.Tensor,
    logp_server: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> PolicyLoss:
    """The clipped policy-gradient loss of ``[N, T]`` per-token logprobs (``logp_trainer`` with grad),
    ``[N]`` advantages (one per completion) and the ``[N, T]`` ``mask`` of real completion tokens. A
    batch without tokens gives a zero loss that still backpropagates (to keep the caller's step
    uniform). Raises ValueError when shapes disagree or ``clip_eps`` is not in ``(0, 1)``."""
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    if logp_trainer.shape != logp_server.shape or logp_trainer.shape != mask.shape:
        raise ValueError(
            f"logprob and mask shapes differ: trainer {tuple(logp_trainer.shape)}, "
            f"server {tuple(logp_server.shape)}, mask {tuple(mask.shape)}"
        )
    if advantages.shape != logp_trainer.shape[:1]:
        raise ValueError(f"advantages must be [N]={tuple(logp_trainer.shape[:1])}, got {tuple(advantages.shape)}")
    mask = mask.bool()
    num_tokens = int(mask.sum())
    ratio = torch.exp(logp_trainer - logp_server.detach())
    adv = advantages.detach().unsqueeze(1).to(ratio.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if num_tokens == 0:
        return PolicyLoss(loss=(logp_trainer * 0.0).sum())
    loss = per_token.masked_fill(~mask, 0.0).sum() / num_tokens
    with torch.no_grad():
        cut = (clipped < unclipped) & mask
        kl = (ratio.detach() - 1.0 - (logp_trainer.detach() - logp_server.detach())).masked_fill(~mask, 0.0)
        return PolicyLoss(
            loss=loss,
            num_tokens=num_tokens,
            clip_fraction=float(cut.sum()) / num_tokens,
            mean_ratio=float(ratio.masked_fill(~mask, 0.0).sum()) / num_tokens,
            behaviour_kl=float(kl.sum()) / num_tokens,
        )

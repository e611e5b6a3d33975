"""The trainer's side of the model: token batches, per-token logprobs, and the two losses' inputs.

Sequences are packed right-padded (prompt then completion), so every real token sits at its own
position from 0; the engine packs left-padded with positions counted from the first real token,
which gives the same positions and so the same logprobs up to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from miles.train.task import Problem


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """Prompt + completion sequences, right-padded, and where each completion sits."""

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    # [N, T]: for completion token t of row i, the position whose logits predict it.
    predictor_index: torch.Tensor
    # [N, T]: the completion token ids (padding where ``completion_mask`` is False).
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor  # [N, T] bool


def encode_prompt(problem: Problem, *, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """BOS then the prompt's tokens: what the servers are sent and what the trainer conditions on."""
    return [tokenizer.bos_token_id, *tokenizer.encode(problem.prompt, add_special_tokens=False)]


def encode_answer(problem: Problem, *, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The correct completion's tokens: the answer then EOS (the SFT target)."""
    return [*tokenizer.encode(problem.answer, add_special_tokens=False), tokenizer.eos_token_id]


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *, pad_token_id: int) -> PackedBatch:
    """Pack ``prompts[i] + completions[i]`` for every i into one right-padded batch; ValueError
    when the lists differ in length or are empty, or a prompt is empty."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"need as many completions as prompts, and at least one: {len(prompts)} vs {len(completions)}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt is empty; every prompt starts with at least BOS")
    rows = len(prompts)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    longest = max(1, max(len(c) for c in completions))
    batch = PackedBatch(
        input_ids=torch.full((rows, width), pad_token_id, dtype=torch.long),
        attention_mask=torch.zeros((rows, width), dtype=torch.long),
        predictor_index=torch.zeros((rows, longest), dtype=torch.long),
        completion_ids=torch.full((rows, longest), pad_token_id, dtype=torch.long),
        completion_mask=torch.zeros((rows, longest), dtype=torch.bool),
    )
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        sequence = [*prompt, *completion]
        batch.input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        batch.attention_mask[row, : len(sequence)] = 1
        n = len(completion)
        if n:
            # Token at position len(prompt) + t is predicted by the logits at the position before it.
            batch.predictor_index[row, :n] = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
            batch.completion_ids[row, :n] = torch.tensor(list(completion), dtype=torch.long)
            batch.completion_mask[row, :n] = True
    return batch


def completion_logprobs(model: PreTrainedModel, batch: PackedBatch) -> torch.Tensor:
    """``[N, T]`` logprobs of each completion token under ``model`` (0 where masked), with grad."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    index = batch.predictor_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    predicting = torch.gather(logits, 1, index).float()
    logprobs = F.log_softmax(predicting, dim=-1)
    picked = torch.gather(logprobs, 2, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(~batch.completion_mask, 0.0)


def sft_loss(model: PreTrainedModel, batch: PackedBatch) -> torch.Tensor:
    """Token-mean negative log-likelihood of the completions (teacher forcing)."""
    logprobs = completion_logprobs(model, batch)
    return -logprobs.sum() / max(1, int(batch.completion_mask.sum()))

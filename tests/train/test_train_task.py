"""The synthetic task (seeded, exact checker), completion parsing, packing, and the config."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from miles.models.presets import build_model
from miles.models.tokenizer import EOS_TOKEN_ID, build_tokenizer
from miles.train.config import TrainerConfig
from miles.train.policy import completion_logprobs, encode_answer, encode_prompt, pack, sft_loss
from miles.train.task import Completion, Ending, Problem, ReverseTask, parse_completion, score

PROBLEM = Problem(prompt="rev abcd\n", answer="dcba")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_generator_is_seeded_and_follows_its_settings() -> None:
    task = ReverseTask(alphabet="xyz", min_length=2, max_length=4)

    def problems(seed: int) -> list[Problem]:
        rng = random.Random(seed)
        return [task.sample(rng) for _ in range(50)]

    first = problems(7)
    assert first == problems(7)
    assert first != problems(8)
    for problem in first:
        letters = problem.prompt.removeprefix("rev ").removesuffix("\n")
        assert problem.prompt == f"rev {letters}\n"
        assert 2 <= len(letters) <= 4 and set(letters) <= set("xyz")
        assert problem.answer == letters[::-1]
    # sample() draws from the caller's RNG: same state, same problem.
    assert task.sample(random.Random(3)) == task.sample(random.Random(3))


def test_exact_answer_scores_one_with_either_terminator() -> None:
    assert score(PROBLEM, Completion("dcba", Ending.EOS)) == 1.0
    assert score(PROBLEM, Completion("dcba", Ending.NEWLINE)) == 1.0


def test_wrong_and_empty_answers() -> None:
    assert score(PROBLEM, Completion("wxyz", Ending.EOS)) == 0.0
    assert score(PROBLEM, Completion("", Ending.EOS)) == 0.0
    assert score(PROBLEM, Completion("abcd", Ending.EOS)) == 0.0  # not reversed: no position matches


def test_partial_credit_stays_below_half() -> None:
    assert score(PROBLEM, Completion("dcbx", Ending.EOS)) == pytest.approx(0.5 * 3 / 4)
    assert score(PROBLEM, Completion("dc", Ending.EOS)) == pytest.approx(0.5 * 2 / 4)
    # A correct answer the model never ended is not exact.
    assert score(PROBLEM, Completion("dcba", Ending.CUT)) == pytest.approx(0.5)


def test_trailing_junk_is_not_exact_and_costs_credit() -> None:
    assert score(PROBLEM, Completion("dcba ", Ending.EOS)) == pytest.approx(0.5 * 4 / 5)
    assert score(PROBLEM, Completion("dcbadcba", Ending.NEWLINE)) == pytest.approx(0.5 * 4 / 8)
    assert score(PROBLEM, Completion("dcba<|pad|>", Ending.EOS)) < 0.5


def test_parse_completion_stops_at_the_first_terminator(tokenizer) -> None:
    ids = list(b"dcba")
    assert parse_completion([*ids, EOS_TOKEN_ID], tokenizer=tokenizer) == Completion("dcba", Ending.EOS)
    assert parse_completion([*ids, 10, *b"zz"], tokenizer=tokenizer) == Completion("dcba", Ending.NEWLINE)
    assert parse_completion(ids, tokenizer=tokenizer) == Completion("dcba", Ending.CUT)
    # Special tokens other than EOS stay in the text as junk.
    assert parse_completion([*ids, 256, EOS_TOKEN_ID], tokenizer=tokenizer).text == "dcba<|bos|>"


def test_prompt_and_answer_encoding(tokenizer) -> None:
    assert encode_prompt(PROBLEM, tokenizer=tokenizer) == [tokenizer.bos_token_id, *b"rev abcd\n"]
    assert encode_answer(PROBLEM, tokenizer=tokenizer) == [*b"dcba", EOS_TOKEN_ID]


def test_packed_logprobs_match_one_sequence_at_a_time() -> None:
    model = build_model("tiny", seed=0)
    prompts = [[256, 1, 2, 3], [256, 9]]
    completions = [[4, 5], [6, 7, 8, 257]]
    batch = pack(prompts, completions, pad_token_id=258)
    assert batch.completion_mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    with torch.no_grad():
        packed = completion_logprobs(model, batch)
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            seq = torch.tensor([prompt + completion])
            logprobs = torch.log_softmax(model(seq).logits[0].float(), dim=-1)
            expected = [logprobs[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(completion)]
            assert packed[row, : len(completion)].tolist() == pytest.approx(expected, abs=1e-5)
        assert packed[0, 2:].abs().sum() == 0
        assert sft_loss(model, batch).item() == pytest.approx(-packed.sum().item() / 6, rel=1e-6)


def test_pack_refuses_mismatched_input() -> None:
    with pytest.raises(ValueError):
        pack([[1]], [[2], [3]], pad_token_id=0)
    with pytest.raises(ValueError):
        pack([[]], [[2]], pad_token_id=0)


def test_config_validation_says_how_to_fix() -> None:
    with pytest.raises(ValidationError, match="at least 8"):
        TrainerConfig(max_new_tokens=5)
    with pytest.raises(ValidationError, match="choose one of"):
        TrainerConfig(preset="nope")
    with pytest.raises(ValidationError, match="give at least one training step"):
        TrainerConfig(sft_steps=0, grpo_steps=0)
    with pytest.raises(ValidationError, match="swap or widen"):
        ReverseTask(min_length=5, max_length=3)
    with pytest.raises(ValidationError, match="repeated"):
        ReverseTask(alphabet="aab")
    with pytest.raises(ValidationError):
        TrainerConfig(group_size=1)
    with pytest.raises(ValidationError):
        TrainerConfig(learning_rate=1.0)  # unknown field: a typo must not pass silently

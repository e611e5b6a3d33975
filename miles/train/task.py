"""The synthetic task the reference trainer learns: reverse a short string, checked exactly.

A problem is a line ``rev <letters>\\n``; the answer is the letters reversed, then EOS (a newline
ends it just as well).

Reward (in ``[0, 1]``):

- ``1.0`` for an exact answer that ended (EOS or newline).
- Otherwise partial credit ``0.5 * matched / max(len(answer), len(expected))``, where ``matched``
  counts positions at which the answer has the expected character. Wrong characters, missing
  characters, trailing junk and a completion cut off by the token limit all lose credit, and no
  inexact answer scores more than ``0.5``, so an exact answer always earns at least twice any near miss.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NEWLINE_TOKEN_ID = ord("\n")
PROMPT_PREFIX = "rev "


class Ending(StrEnum):
    """How a completion ended."""

    EOS = "eos"
    NEWLINE = "newline"
    # Cut by the token limit (or aborted): the model never said it was done.
    CUT = "cut"


@dataclass(frozen=True, slots=True)
class Problem:
    """One task instance: the prompt text and the exact expected answer (without terminator)."""

    prompt: str
    answer: str


@dataclass(frozen=True, slots=True)
class Completion:
    """A completion as the checker sees it: the text before its terminator, and how it ended."""

    text: str
    ending: Ending


class ReverseTask(BaseModel):
    """Reverse a string of ``min_length..max_length`` characters drawn from ``alphabet``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    alphabet: Annotated[str, Field(min_length=2)] = "abcdefghijklmnop"
    min_length: Annotated[int, Field(ge=1)] = 3
    max_length: Annotated[int, Field(ge=1, le=32)] = 7

    @model_validator(mode="after")
    def _check(self) -> ReverseTask:
        if self.min_length > self.max_length:
            raise ValueError(
                f"min_length ({self.min_length}) exceeds max_length ({self.max_length}); swap or widen them"
            )
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError("alphabet has repeated characters; list each character once")
        if not all(c.isascii() and c.isprintable() and not c.isspace() for c in self.alphabet):
            raise ValueError("alphabet must hold printable ASCII characters other than whitespace")
        return self

    def sample(self, rng: random.Random) -> Problem:
        """One problem drawn from ``rng`` (the same RNG state gives the same problem)."""
        length = rng.randint(self.min_length, self.max_length)
        letters = "".join(rng.choice(self.alphabet) for _ in range(length))
        return Problem(prompt=f"{PROMPT_PREFIX}{letters}\n", answer=letters[::-1])


def score(problem: Problem, completion: Completion) -> float:
    """The reward of ``completion`` for ``problem``, in ``[0, 1]`` (rules in the module docstring)."""
    if completion.text == problem.answer and completion.ending is not Ending.CUT:
        return 1.0
    longest = max(len(completion.text), len(problem.answer))
    if longest == 0:
        return 0.0
    matched = sum(got == want for got, want in zip(completion.text, problem.answer, strict=False))
    # At most 0.5 (the right text, never ended): the model must say it is done to be exact.
    return 0.5 * matched / longest


def parse_completion(output_ids: Sequence[int], *, tokenizer: PreTrainedTokenizerBase) -> Completion:
    """The completion up to its first terminator (EOS or newline) as text, and how it ended.

    Special tokens other than EOS stay in the text (as their names), so they count as junk."""
    eos = tokenizer.eos_token_id
    end = next((i for i, token in enumerate(output_ids) if token in (eos, NEWLINE_TOKEN_ID)), None)
    ending = Ending.CUT if end is None else Ending.EOS if output_ids[end] == eos else Ending.NEWLINE
    text = tokenizer.decode(list(output_ids[:end]), skip_special_tokens=False)
    assert isinstance(text, str)  # one sequence of ids decodes to one string
    return Completion(text=text, ending=ending)

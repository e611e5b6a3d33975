"""What every request on the wire shares: a strict base model and the value types both APIs use,
and the shape both answer a failure in (``ErrorAnswer``).

A request is refused at validation, naming the field, for anything the engine could not honour
later: an unknown field, a bool for a number, a NaN or infinite float (``json`` accepts them), text
that is not valid Unicode (a ``"\\ud800"`` escape decodes to a lone surrogate no response can
encode). Failing here is what keeps bad input from ever causing a 500.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    StrictFloat,
    StrictInt,
    field_validator,
)
from pydantic_core import CoreSchema

from miles.errors import Refusal

# torch.Generator.manual_seed accepts exactly this range (negative seeds are mapped onto it).
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# A version names weights in every response and log line; longer text is a mistake, not a name.
MAX_VERSION_CHARS = 256


_SURROGATE = re.compile("[\ud800-\udfff]")


def _first_surrogate(value: Any) -> str | None:
    if isinstance(value, str):
        match = _SURROGATE.search(value)  # C speed: prompts can be long
        return match.group() if match else None
    # Validated lists hold one type (list[int], list[str], list[list[int]] ...): a list of
    # numbers or models needs no walk, which keeps long token-id prompts cheap.
    if isinstance(value, list | tuple) and value and isinstance(value[0], str | list | tuple):
        for item in value:
            found = _first_surrogate(item)
            if found is not None:
                return found
    return None


_SEQUENCES = frozenset({"list", "tuple", "set", "frozenset", "dict"})


def _fail_fast(schema: Any) -> None:
    """Set ``fail_fast`` on every sequence and mapping in a core schema (in place)."""
    if isinstance(schema, dict):
        if schema.get("type") in _SEQUENCES:
            schema["fail_fast"] = True
        for value in schema.values():
            _fail_fast(value)
    elif isinstance(schema, list):
        for item in schema:
            _fail_fast(item)


class RequestModel(BaseModel):
    """Base of every request model: unknown fields, non-finite floats and broken text are refused.
    Every sequence stops at its first invalid item: millions of errors took FastAPI seconds per
    hundred thousand to build and format, on the event loop."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: type[BaseModel], handler: GetCoreSchemaHandler) -> CoreSchema:
        schema = handler(source)
        _fail_fast(schema)
        return schema

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        surrogate = _first_surrogate(value)
        if surrogate is not None:
            raise ValueError(
                f"holds a lone UTF-16 surrogate ({surrogate.encode('unicode_escape').decode()}), which is "
                "not valid Unicode text; send the text as UTF-8 or as a complete surrogate pair"
            )
        return value


def _top_k(value: int) -> int:
    if value == 0 or value < -1:
        raise ValueError("top_k must be -1 (disabled) or a positive integer")
    return value


def _stops(value: str | list[str] | None) -> str | list[str] | None:
    stops = [value] if isinstance(value, str) else (value or [])
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return value


# Value types shared by the SGLang and OpenAI request models, so both refuse the same values with
# the same message, at validation, naming the field.
Count = Annotated[StrictInt, Field(ge=0)]
Seed = Annotated[StrictInt, Field(ge=MIN_SEED, le=MAX_SEED)]
TopK = Annotated[StrictInt, AfterValidator(_top_k)]
Stop = Annotated[str | list[str] | None, AfterValidator(_stops)]
Temperature = Annotated[StrictFloat, Field(ge=0.0)]
TopP = Annotated[StrictFloat, Field(gt=0.0, le=1.0)]
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
WeightVersion = Annotated[str, Field(min_length=1, max_length=MAX_VERSION_CHARS)]
# One line of a sensible length: names, versions and checksums the controller's API takes reach
# logs, tables and answers as they are (a newline in one would forge a log line).
Label = Annotated[str, Field(min_length=1, max_length=MAX_VERSION_CHARS, pattern=r"^[^\x00-\x1f\x7f]+$")]


def sample_seed(seed: int, sample: int) -> int:
    """``seed + sample``, wrapped back into the range ``torch.Generator.manual_seed`` accepts."""
    derived = seed + sample
    return derived - 2**64 if derived > MAX_SEED else derived


class ResponseModel(BaseModel):
    """Base of what the APIs answer: frozen."""

    model_config = ConfigDict(frozen=True)


class ErrorDetail(ResponseModel):
    message: str
    type: str
    code: int
    # Set for a refusal the caller may act on by name; absent for every other error.
    refusal: Refusal | None = None


class ErrorAnswer(ResponseModel):
    """How both miles APIs answer a failure (``miles.utils.http``)."""

    error: ErrorDetail

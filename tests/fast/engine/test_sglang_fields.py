"""Our request models against SGLang's own source at the pinned version, so a drift fails here.

``make test`` installs ``sglang==SGLANG_VERSION`` without its dependencies into ``.sglang-ref``
(or set ``MILES_SGLANG_REF`` to another copy of its source). Importing SGLang needs CUDA builds of
torch, so its classes are read with ``ast``: the fields of ``GenerateReqInput`` and
``SamplingParams``, and of its OpenAI ``CompletionRequest`` and ``ChatCompletionRequest``. Every
SGLang field must be accepted by our model (declared, or ignored) or refused by name unless unset;
every field of ours that SGLang lacks must be a documented miles extension.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from miles.protocol.compat import SGLANG_VERSION, SGLangFields
from miles.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest
from miles.protocol.sglang import GenerateRequest, SamplingParams
from miles.protocol.sglang_weights import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)

REPO = Path(__file__).resolve().parents[3]
REF = Path(os.environ.get("MILES_SGLANG_REF") or REPO / ".sglang-ref")

IO_STRUCT = "sglang/srt/managers/io_struct.py"

# (our model, SGLang source file, SGLang class, a minimal valid request of ours)
MODELS: list[tuple[type[SGLangFields], str, str, dict[str, Any]]] = [
    (GenerateRequest, "sglang/srt/managers/io_struct.py", "GenerateReqInput", {"text": "hi"}),
    (SamplingParams, "sglang/srt/sampling/sampling_params.py", "SamplingParams", {}),
    (CompletionRequest, "sglang/srt/entrypoints/openai/protocol.py", "CompletionRequest", {"prompt": "hi"}),
    (
        ChatCompletionRequest,
        "sglang/srt/entrypoints/openai/protocol.py",
        "ChatCompletionRequest",
        {"messages": [{"role": "user", "content": "hi"}]},
    ),
    (
        UpdateWeightsFromTensorRequest,
        IO_STRUCT,
        "UpdateWeightsFromTensorReqInput",
        {"serialized_named_tensors": ["e30="], "load_format": "miles_shm"},
    ),
    (
        InitWeightsUpdateGroupRequest,
        IO_STRUCT,
        "InitWeightsUpdateGroupReqInput",
        {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2},
    ),
    (
        UpdateWeightsFromDistributedRequest,
        IO_STRUCT,
        "UpdateWeightsFromDistributedReqInput",
        {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]]},
    ),
    (DestroyWeightsUpdateGroupRequest, IO_STRUCT, "DestroyWeightsUpdateGroupReqInput", {}),
    (
        ChatMessage,
        "sglang/srt/entrypoints/openai/protocol.py",
        "ChatCompletionMessageGenericParam",
        {"role": "assistant", "content": "hi"},
    ),
]


def sglang_source(relative: str) -> ast.Module:
    path = REF / relative
    if not path.is_file():
        pytest.fail(
            f"SGLang's source is not at {REF} ({relative} is missing): run `make test`, which installs "
            f"sglang=={SGLANG_VERSION} there without its dependencies (or `make sglang-ref`), or point "
            "MILES_SGLANG_REF at a copy of it"
        )
    return ast.parse(path.read_text(encoding="utf-8"))


def class_fields(module: ast.Module, name: str) -> dict[str, str]:
    """The request fields of class ``name`` (with those of its bases defined in the same module):
    its ``__init__`` parameters if it writes one, else its annotated class attributes, as SGLang's
    dataclasses, msgspec structs and pydantic models declare them. Maps each to its default."""
    classes = {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}
    node = classes[name]
    fields: dict[str, str] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(class_fields(module, base.id))
    init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
    if init is not None:
        args = [*init.args.args[1:], *init.args.kwonlyargs]
        return fields | {a.arg: "?" for a in args}
    for statement in node.body:
        if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name):
            continue
        field = statement.target.id
        if field.startswith("_") or "ClassVar" in ast.unparse(statement.annotation):
            continue
        fields[field] = ast.unparse(statement.value) if statement.value is not None else "required"
    return fields


def test_the_reference_is_the_pinned_sglang() -> None:
    sglang_source("sglang/srt/managers/io_struct.py")  # fails with how to install it when missing
    metadata = sorted(REF.glob("sglang-*.dist-info/METADATA"))
    versions = [
        line.removeprefix("Version:").strip()
        for path in metadata
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.startswith("Version:")
    ]
    assert versions == [SGLANG_VERSION], (
        f"{REF} holds sglang {versions}; run `make clean test` to install {SGLANG_VERSION}"
    )


@pytest.mark.parametrize(("model", "source", "name", "_"), MODELS, ids=[m[2] for m in MODELS])
def test_every_sglang_field_is_accepted_or_refused_by_name(
    model: type[SGLangFields], source: str, name: str, _: dict[str, Any]
) -> None:
    theirs = set(class_fields(sglang_source(source), name))
    declared = set(model.model_fields)
    ignored = set(model.ignored_fields)
    refused = set(model.unsupported_fields)
    # The review, as a table in the test output (pytest -s, or on failure).
    print(f"\n{name} ({len(theirs)} fields at sglang {SGLANG_VERSION}):")
    print(f"  served:   {sorted(theirs & declared)}")
    print(f"  ignored:  {sorted(theirs & ignored)}")
    print(f"  refused unless unset: {sorted(theirs & refused)}")
    print(f"  miles extensions: {sorted(model.extension_fields)}")
    assert not (declared & ignored) and not (declared & refused) and not (ignored & refused)
    unreviewed = theirs - declared - ignored - refused
    assert not unreviewed, (
        f"SGLang's {name} has fields {sorted(unreviewed)} that {model.__name__} neither serves, ignores nor "
        "refuses: review each and add it to the model or to ignored_fields / unsupported_fields"
    )
    ours = declared | ignored | refused
    assert ours - theirs == set(model.extension_fields), (
        f"{model.__name__} has fields SGLang's {name} lacks: {sorted(ours - theirs)}; only documented miles "
        f"extensions ({sorted(model.extension_fields)}) may be"
    )


def _set_value(default: Any) -> Any:
    """A value that asks for something, for a field whose unset value is ``default``."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 7
    return "miles-test-value"


def _errors(model: type[BaseModel], body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return str(caught.value)


@pytest.mark.parametrize(("model", "_source", "_name", "minimal"), MODELS, ids=[m[2] for m in MODELS])
def test_unsupported_fields_are_refused_by_name_unless_unset(
    model: type[SGLangFields], _source: str, _name: str, minimal: dict[str, Any]
) -> None:
    for field, rule in model.unsupported_fields.items():
        message = _errors(model, {**minimal, field: _set_value(rule.default)})
        assert f"field {field!r} is not supported" in message, message
        for unset in (None, rule.default, *rule.unset):
            model.model_validate({**minimal, field: unset})
    for field in model.ignored_fields:
        model.model_validate({**minimal, field: "anything"})
    # A field SGLang does not have either is a typo, refused by name.
    assert "temprature" in _errors(model, {**minimal, "temprature": 0.5})


def test_what_sglang_router_adds_to_every_generate_is_accepted() -> None:
    # sglang-router 0.3.2 forwards /generate with these fields added (seen on the wire).
    body = {
        "text": "hi",
        "model": None,
        "sampling_params": {"max_new_tokens": 2},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
    }
    GenerateRequest.model_validate(body)


def test_null_means_sglangs_default_for_sampling_fields() -> None:
    params = SamplingParams.model_validate({"temperature": None, "top_k": None, "n": None, "ignore_eos": None})
    assert (params.temperature, params.top_k, params.n, params.ignore_eos) == (1.0, -1, 1, False)
    # max_new_tokens null is SGLang's "until the context is full", resolved by the engine.
    assert SamplingParams.model_validate({"max_new_tokens": None}).max_new_tokens is None
    request = GenerateRequest.model_validate(
        {"text": ["a", "b"], "return_logprob": [True, False], "top_logprobs_num": [2, None], "logprob_start_len": None}
    )
    assert request.logprobs_of(0).top_logprobs == 2 and request.logprobs_of(1).return_logprob is False

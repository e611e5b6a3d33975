"""Server specs for SGLang servers: hostile values are refused with a message that says how to fix them."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from miles.controller.fleet import ModelServerSpec

SGLANG = "miles.rollout.sglang_rollout.SGLangRollout"


@pytest.mark.parametrize(
    ("urls", "message"),
    [
        (["not a url"], "is not a server's base URL"),
        (["ftp://10.0.0.1:30000"], "is not a server's base URL"),
        (["http://[::1"], "is not a server's base URL"),
        (["http://h:1/generate"], "has a path or query"),
        (["http://h:1?x=1"], "has a path or query"),
        (["http://h:99999"], "a port is 1..65535"),
        (["http://user:secret@h:1"], "carries credentials"),
        (["http://h:1", "http://h:1/"], "lists a server twice"),
        ([""], "at least 1 character"),
        ([7], "valid string"),
    ],
)
def test_bad_urls_are_refused_by_name(urls: list[Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message) as caught:
        ModelServerSpec.model_validate({"cls": SGLANG, "checkpoint": "/ckpt", "urls": urls})
    assert "secret" not in str(caught.value).split("input_value")[0]


@pytest.mark.parametrize(
    "sglang",
    [
        {"tp_size": 0},
        {"tp_size": True},
        {"tp_size": "2"},
        {"dp_size": 65},
        {"mem_fraction_static": 1.5},
        {"mem_fraction_static": float("nan")},
        {"context_length": 0},
        {"launcher": []},
        {"launcher": [""]},
        {"tensor_parallel_size": 2},
    ],
)
def test_bad_sglang_arguments_are_refused(sglang: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="sglang"):
        ModelServerSpec.model_validate({"cls": SGLANG, "checkpoint": "/ckpt", "sglang": sglang})


def test_cls_and_server_cls_name_the_same_field() -> None:
    by_alias = ModelServerSpec.model_validate({"cls": SGLANG, "checkpoint": "/ckpt", "urls": ["http://h:1/"]})
    by_name = ModelServerSpec.model_validate({"server_cls": SGLANG, "checkpoint": "/ckpt", "urls": ["http://h:1"]})
    assert by_alias == by_name
    assert by_alias.urls == ("http://h:1",)

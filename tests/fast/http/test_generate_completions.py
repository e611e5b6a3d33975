"""SGLang's /generate as vLLM's /v1/completions and back (``miles.protocol.generate_completions``);
end to end against a real vLLM server in ``tests/vllm``."""

from __future__ import annotations

import json

import pytest

from miles.errors import InvalidRequestError
from miles.protocol.generate_completions import completion_body, generate_answers, parse_generate


def completions_answer(*choices: dict[str, object]) -> bytes:
    """What vLLM 0.32's /v1/completions answers, with return_token_ids (and logprobs by id)."""
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": list(choices)}).encode()


def choice(index: int, ids: list[int], *, logprobs: list[float] | None = None, finish: str = "length") -> dict:
    return {
        "index": index,
        "text": "".join(chr(97 + i % 26) for i in ids),
        "token_ids": ids,
        "prompt_token_ids": [1, 2, 3],
        "finish_reason": finish,
        "stop_reason": 7 if finish == "stop" else None,
        "logprobs": None
        if logprobs is None
        else {
            "tokens": [f"token_id:{i}" for i in ids],
            "token_logprobs": logprobs,
            "top_logprobs": [
                {f"token_id:{i}": lp, "token_id:99": lp - 1, "token_id:98": lp - 2}
                for i, lp in zip(ids, logprobs, strict=False)
            ],
        },
    }


def test_each_sampling_field_is_sent_under_vllms_name() -> None:
    request = parse_generate(
        {
            "input_ids": [[5, 6], [7]],
            "sampling_params": {
                "max_new_tokens": 9,
                "min_new_tokens": 2,
                "no_stop_trim": True,
                "n": 3,
                "stop_token_ids": [4],
                "temperature": 0.5,
                "sampling_seed": 11,
            },
            "return_logprob": [True, False],
            "top_logprobs_num": 2,
        }
    )
    first, second = completion_body(request, 0), completion_body(request, 1)
    assert first["prompt"] == [5, 6] and second["prompt"] == [7]
    assert (first["max_tokens"], first["min_tokens"], first["include_stop_str_in_output"]) == (9, 2, True)
    assert (first["n"], first["stop_token_ids"], first["temperature"], first["seed"]) == (3, [4], 0.5, 11)
    assert first["return_token_ids"] and first["logprobs"] == 2 and first["return_tokens_as_token_ids"]
    assert "logprobs" not in second
    # SGLang's null max_new_tokens (what fits) is vLLM's null, not its default of 16.
    assert (
        completion_body(parse_generate({"text": "x", "sampling_params": {"max_new_tokens": None}}), 0)["max_tokens"]
        is None
    )


def test_answers_come_back_in_sglangs_shape_sample_by_sample() -> None:
    request = parse_generate(
        {"text": "abc", "rid": "r", "sampling_params": {"n": 2}, "return_logprob": True, "top_logprobs_num": 2}
    )
    answer = completions_answer(
        choice(1, [3, 4], logprobs=[-0.5, -0.25]), choice(0, [8], logprobs=[-1.0], finish="stop")
    )
    first, second = generate_answers(request, 0, answer, versions=("v1", "v1"), latency_s=0.5)
    assert first["output_ids"] == [8] and first["meta_info"]["id"] == "r-0"
    assert first["meta_info"]["finish_reason"] == {"type": "stop", "length": None, "matched": 7, "message": None}
    assert second["meta_info"]["output_token_logprobs"] == [[-0.5, 3, None], [-0.25, 4, None]]
    assert second["meta_info"]["output_top_logprobs"][0] == [[-0.5, 3, None], [-1.5, 99, None]]
    assert second["meta_info"]["finish_reason"]["type"] == "length"
    assert second["meta_info"]["prompt_tokens"] == 3 and second["meta_info"]["completion_tokens"] == 2
    assert second["meta_info"]["weight_version_spans"] == [{"weight_version": "v1", "start": 0, "end": 2}]


def test_an_update_under_the_request_leaves_which_tokens_came_from_which_weights_unsaid() -> None:
    request = parse_generate({"text": "abc"})
    (answer,) = generate_answers(
        request, 0, completions_answer(choice(0, [3, 4])), versions=("v1", "v2"), latency_s=0.1
    )
    meta = answer["meta_info"]
    assert (meta["weight_version_start"], meta["weight_version"], meta["weight_version_spans"]) == ("v1", "v2", [])


@pytest.mark.parametrize(
    "broken",
    [
        b"not json",
        b'{"id": "x"}',
        completions_answer(choice(0, [3, 4], logprobs=[-0.5])),  # a logprob short
        completions_answer(
            {**choice(0, [3], logprobs=[-0.5]), "logprobs": {"tokens": ["3"], "token_logprobs": [-0.5]}}
        ),
    ],
    ids=["not-json", "no-choices", "logprobs-short", "logprobs-by-text"],
)
def test_an_answer_that_is_not_a_completions_answer_is_a_value_error(broken: bytes) -> None:
    request = parse_generate({"text": "abc", "return_logprob": True})
    with pytest.raises(ValueError):
        generate_answers(request, 0, broken, versions=("v", "v"), latency_s=0.0)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"text": "hi", "stream": True}, "stream"),
        ({"text": "hi", "return_text_in_logprobs": True}, "return_text_in_logprobs"),
        ({"text": "hi", "sampling_params": {"max_new_token": 3}}, "max_new_token"),
        ({"text": "hi", "input_ids": [1]}, "exactly one of text or input_ids"),
        ({"text": "hi", "sampling_params": {"temperature": -1.0}}, "temperature"),
    ],
)
def test_what_cannot_be_sent_is_refused_by_name(body: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        parse_generate(body)

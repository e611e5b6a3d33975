"""The embedded engine's HTTP API against one real engine process serving a tiny checkpoint.

Every test runs twice: on the fused decoder (what a Llama checkpoint gets by default) and on the
model's Transformers forward (what every other architecture gets), so both serve the whole API.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.testing import running_engine, weights_held
from miles.weights.checkpoint import read_manifest


@pytest.fixture(scope="module", params=["fused", "transformers"])
def engine_url(
    request: pytest.FixtureRequest, checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    forward = ("--forward", request.param)
    with running_engine(checkpoints["v1"], log_dir=tmp_path_factory.mktemp("logs"), extra_args=forward) as url:
        assert request.param in httpx.get(f"{url}/get_server_info", trust_env=False).json()["forward"]
        yield url


@pytest.fixture
def http(engine_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine_url, timeout=60, trust_env=False) as client:
        yield client


def greedy(text: str, n: int = 8, **extra: object) -> dict[str, object]:
    return {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, **extra}}


def test_health_and_info(http: httpx.Client, checkpoints: dict[str, Path]) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True
    assert info["weight_version"] == "1"
    assert info["served_model_name"] == "tiny"
    # The identity a drift probe compares: computed at start-up, so never null once healthy.
    v1_checksum = read_manifest(checkpoints["v1"]).checksum
    assert weights_held(http) == {"weight_version": "1", "checksum": v1_checksum}
    # The process's own identity: the same on every probe of this process (a restart makes another).
    instance = http.get("/get_weight_version").json()["instance_id"]
    assert re.fullmatch("[0-9a-f]{32}", instance)
    assert http.get("/get_weight_version").json()["instance_id"] == instance
    server = http.get("/get_server_info").json()
    assert server["internal_states"][0]["generation_state"] == "serving"
    assert server["checksum"] == v1_checksum


def test_generate_text_and_ids_agree(http: httpx.Client) -> None:
    by_text = http.post("/generate", json=greedy("12+34=")).json()
    ids = http.post("/generate", json={"text": "12+34=", "sampling_params": {"max_new_tokens": 0}}).json()
    assert ids["meta_info"]["prompt_tokens"] == by_text["meta_info"]["prompt_tokens"]
    meta = by_text["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8, "matched": None, "message": None}
    assert meta["completion_tokens"] == len(by_text["output_ids"]) == 8
    assert meta["weight_version_start"] == meta["weight_version_end"] == meta["weight_version"] == "1"
    assert meta["weight_version_spans"] == [{"weight_version": "1", "start": 0, "end": 8}]
    assert ids["meta_info"]["weight_version_spans"] == []


def test_greedy_is_deterministic_alone_and_in_a_batch(http: httpx.Client) -> None:
    prompts = ["a", "hello world", "1+1=", "the quick brown fox jumps"]
    alone = [http.post("/generate", json=greedy(p, 12)).json()["output_ids"] for p in prompts]
    again = [http.post("/generate", json=greedy(p, 12)).json()["output_ids"] for p in prompts]
    batch = http.post(
        "/generate", json={"text": prompts, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    ).json()
    assert alone == again
    assert [r["output_ids"] for r in batch] == alone


def test_seeded_sampling_reproduces_and_n_expands(http: httpx.Client) -> None:
    body = {"text": "x", "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 7, "n": 3}}
    first = http.post("/generate", json=body).json()
    second = http.post("/generate", json=body).json()
    assert len(first) == 3
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in second]
    assert len({tuple(r["output_ids"]) for r in first}) > 1, "the n samples should differ"


def test_logprobs_are_reported_per_token(http: httpx.Client) -> None:
    body = {**greedy("abc", 5), "return_logprob": True, "top_logprobs_num": 3}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 5
    for (logprob, _token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert top[0][0] == pytest.approx(logprob)


def test_stop_strings_and_token_ids(http: httpx.Client) -> None:
    full = http.post("/generate", json=greedy("zz", 16)).json()
    stop_token = full["output_ids"][3]
    by_token = http.post("/generate", json=greedy("zz", 16, stop_token_ids=[stop_token])).json()
    assert by_token["meta_info"]["finish_reason"]["type"] == "stop"
    assert by_token["meta_info"]["finish_reason"]["matched"] == stop_token
    assert by_token["output_ids"] == full["output_ids"][: full["output_ids"].index(stop_token) + 1]
    text = full["text"]
    stop = text[4:6] if len(text) >= 6 and text[4:6].strip() else None
    if stop:
        by_text = http.post("/generate", json=greedy("zz", 16, stop=stop)).json()
        assert by_text["meta_info"]["finish_reason"] == {
            "type": "stop",
            "matched": stop,
            "length": None,
            "message": None,
        }
        assert stop not in by_text["text"]


def test_streaming_sends_cumulative_snapshots(http: httpx.Client) -> None:
    chunks = []
    with http.stream("POST", "/generate", json={**greedy("hi", 4), "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line.removeprefix("data: "))
    assert chunks[-1] == "[DONE]"
    snapshots = [json.loads(c) for c in chunks[:-1]]
    assert [len(s["output_ids"]) for s in snapshots] == [1, 2, 3, 4]
    assert snapshots[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert snapshots[-1]["output_ids"] == http.post("/generate", json=greedy("hi", 4)).json()["output_ids"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text": "x", "bogus": 1}, "unknown field 'bogus'"),
        ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "x", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 100000}}, "context length"),
        ({"text": "x", "sampling_params": {"nucleus": 0.5}}, "unknown field 'sampling_params.nucleus'"),
        ({"input_ids": [1, 2, 10**6]}, "outside the vocabulary"),
        ({"text": "x", "input_ids": [1]}, "exactly one of text or input_ids"),
        ({}, "exactly one of text or input_ids"),
        ({"text": ["a", "b"], "stream": True}, "streaming"),
        ({"input_ids": []}, "empty"),
    ],
)
def test_bad_generate_requests_get_400_with_a_message(http: httpx.Client, body: dict, needle: str) -> None:
    response = http.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_malformed_json_is_400(http: httpx.Client) -> None:
    response = http.post("/generate", content=b'{"text": "x",', headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_openai_endpoints(http: httpx.Client) -> None:
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    completion = http.post("/v1/completions", json={"prompt": "12+", "max_tokens": 5, "temperature": 0}).json()
    assert completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] == 5
    assert completion["choices"][0]["weight_version"] == "1"
    assert completion["choices"][0]["weight_version_spans"] == [{"weight_version": "1", "start": 0, "end": 5}]
    native = http.post("/generate", json=greedy("12+", 5)).json()
    assert completion["choices"][0]["text"] == native["text"]
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
    ).json()
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] <= 4
    bad = http.post("/v1/chat/completions", json={"messages": [], "max_tokens": 4})
    assert bad.status_code == 400
    lines = []
    with http.stream(
        "POST", "/v1/completions", json={"prompt": "12+", "max_tokens": 5, "temperature": 0, "stream": True}
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
    assert "".join(deltas) == native["text"]
    last = json.loads(lines[-2][6:])["choices"][0]
    assert last["weight_version_spans"] == [{"weight_version": "1", "start": 0, "end": 5}]


def test_abort_request_needs_a_target(http: httpx.Client) -> None:
    assert http.post("/abort_request", json={}).status_code == 400
    assert http.post("/abort_request", json={"rid": "nobody"}).json() == {"success": True, "num_aborted": 0}


def test_flush_cache_and_weights_checker(http: httpx.Client, checkpoints: dict[str, Path]) -> None:
    assert http.post("/flush_cache").status_code == 200
    body = http.post("/weights_checker", json={"action": "checksum"}).json()
    assert body["success"] is True
    assert body["payload"]["checksum"] == read_manifest(checkpoints["v1"]).checksum
    assert http.post("/weights_checker", json={"action": "snapshot"}).status_code == 400


def test_a_client_that_goes_away_stops_its_generation(http: httpx.Client, engine_url: str) -> None:
    import threading
    import time

    body = {"text": "a", "sampling_params": {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}}
    gave_up = threading.Event()

    def impatient_client() -> None:
        try:
            httpx.post(f"{engine_url}/generate", json=body, timeout=1.0, trust_env=False)
        except httpx.ReadTimeout:
            gave_up.set()

    def aborted() -> float:
        lines = http.get("/metrics").text.splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith("sglang:num_aborted_requests_total{"))

    aborted_before = aborted()
    client = threading.Thread(target=impatient_client)
    client.start()

    def running() -> int:
        return http.get("/get_server_info").json()["internal_states"][0]["running_requests"]

    deadline = time.monotonic() + 10
    while running() == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)
    # Hold the request in place so that only the client's departure can end it.
    http.post("/pause_generation", json={"mode": "in_place"})
    try:
        client.join(timeout=10)
        assert gave_up.is_set()
        deadline = time.monotonic() + 10
        while running():
            assert time.monotonic() < deadline, "the request kept running after its client left"
            time.sleep(0.05)
        # Counted as aborted, as SGLang counts a request whose client left.
        assert aborted() == aborted_before + 1
    finally:
        http.post("/continue_generation", json={})


def test_both_info_names_answer_with_sglangs_fields(http: httpx.Client) -> None:
    model = http.get("/model_info").json()
    assert model == http.get("/get_model_info").json()
    for field in (
        "model_path",
        "served_model_name",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
        "load_format",
        "disaggregation_mode",
        "model_type",
        "architectures",
    ):
        assert field in model, field
    server = http.get("/server_info").json()
    assert server.keys() == http.get("/get_server_info").json().keys()
    assert (server["tp_size"], server["dp_size"], server["disaggregation_mode"]) == (1, 1, "null")
    assert server["fence"] == 0 and server["window_open"] is False


def test_sglang_defaults_sent_as_null_and_per_prompt_logprobs(http: httpx.Client) -> None:
    nulls = {"temperature": None, "top_p": None, "top_k": None, "n": None, "min_new_tokens": None, "max_new_tokens": 4}
    body = {
        "text": "hi",
        "sampling_params": {**nulls, "temperature": 0},
        "return_logprob": None,
        "lora_path": None,
        "return_hidden_states": False,
        "image_data": None,
        "model": None,
        "priority": 3,
        "cache_salt": "x",
    }
    assert (
        http.post("/generate", json=body).json()["output_ids"]
        == http.post("/generate", json=greedy("hi", 4)).json()["output_ids"]
    )
    batch = http.post(
        "/generate",
        json={
            "text": ["a", "b"],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": [True, False],
            "top_logprobs_num": [2, 0],
        },
    ).json()
    assert len(batch[0]["meta_info"]["output_top_logprobs"][0]) == 2
    assert batch[1]["meta_info"]["output_token_logprobs"] is None


def test_max_new_tokens_null_generates_until_the_context_is_full(http: httpx.Client) -> None:
    context = http.get("/model_info").json()["context_length"]
    body = {"input_ids": [5] * (context - 3), "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert meta["completion_tokens"] == 3 and meta["finish_reason"]["type"] == "length"
    full = http.post("/generate", json={"input_ids": [5] * context, "sampling_params": {"max_new_tokens": None}})
    assert full.status_code == 400 and "no room" in full.json()["error"]["message"]


def test_logit_bias_steers_sampling(http: httpx.Client) -> None:
    plain = http.post("/generate", json=greedy("abc", 4)).json()["output_ids"]
    target = (plain[0] + 1) % 100 + 3
    biased = http.post("/generate", json=greedy("abc", 4, logit_bias={str(target): 100})).json()["output_ids"]
    assert biased == [target] * 4
    # OpenAI's name for it, on the OpenAI route.
    completion = http.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 2, "temperature": 0, "logit_bias": {str(target): 100}}
    ).json()
    assert completion["usage"]["completion_tokens"] == 2


def test_openai_fields_clients_send(http: httpx.Client) -> None:
    chat = {
        "model": "anything",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]}],
        "max_completion_tokens": 3,
        "temperature": None,
        "user": "someone",
        "stream_options": None,
        "n": 1,
        "stop": None,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "chat_template_kwargs": {},
    }
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    as_text = {**chat, "messages": [{"role": "user", "content": "hi there"}], "temperature": 0}
    as_parts = {**chat, "temperature": 0}
    assert (
        http.post("/v1/chat/completions", json=as_text).json()["choices"][0]["message"]
        == http.post("/v1/chat/completions", json=as_parts).json()["choices"][0]["message"]
    )
    reserved = http.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {"tokenize": False}})
    assert reserved.status_code == 400 and "chat_template_kwargs" in reserved.json()["error"]["message"]
    lines = []
    body = {"prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}, "rid": "usage-1"}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    last = json.loads(lines[-1].removeprefix("data: "))
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "developer", "content": "be brief"}, {"role": "User", "content": "hi"}],
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "reasoning_content": "thinking"},
            {"role": "user", "content": "and?"},
        ],
        [{"role": "function", "name": "f", "content": "42"}, {"role": "user", "content": "so?"}],
    ],
    ids=["developer-and-any-case", "null-content-and-reasoning", "function"],
)
def test_chat_takes_the_messages_sglang_takes(http: httpx.Client, messages: list[dict[str, object]]) -> None:
    answer = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    ("field", "value"),
    [("tool_calls", [{"function": {"name": "f", "arguments": "{}"}}]), ("phase", "final_answer"), ("prefix", True)],
)
def test_chat_message_fields_it_cannot_honour_are_refused_by_name(
    http: httpx.Client, field: str, value: object
) -> None:
    message = {"role": "assistant", "content": "x", field: value}
    answer = http.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 2})
    assert answer.status_code == 400 and f"field {field!r} is not supported" in answer.text, answer.text

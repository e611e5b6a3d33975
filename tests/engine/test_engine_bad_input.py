"""Nothing a client sends makes the engine answer 5xx, and no bad request costs another its output.

A table of hand-made edge values for every endpoint (huge and negative numbers, NaN and Infinity
literals, booleans where numbers belong, empty strings and lists, wrong types, unknown fields,
broken Unicode, long strings, nested lists, bodies that are not JSON) must each get a 4xx whose
message names the problem; afterwards the engine still generates exactly what it did before.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
from fastapi.testclient import TestClient

from miles.engine.engine import Engine
from miles.engine.http_server import create_app
from miles.engine.settings import EngineSettings
from miles.testing import app_on_loopback, running_engine

MAX_MIB = 8
REFERENCE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


@pytest.fixture(scope="module")
def engine_url(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_engine(
        checkpoints["v1"], log_dir=tmp_path_factory.mktemp("logs"), extra_args=("--max-request-mib", str(MAX_MIB))
    ) as url:
        yield url


@pytest.fixture
def http(engine_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine_url, timeout=60, trust_env=False) as client:
        yield client


@pytest.fixture(scope="module")
def reference(engine_url: str) -> list[int]:
    """What the engine generates before any bad request was sent."""
    return httpx.post(f"{engine_url}/generate", json=REFERENCE, trust_env=False, timeout=60).json()["output_ids"]


def _long(prompt: list[int], tokens: int) -> dict[str, object]:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}


BAD_GENERATE_PARAMS = [
    # An out-of-vocabulary stop id with min_new_tokens once failed inside the step, aborting the
    # whole running batch; seeds out of torch's range failed in the handler (500).
    ({"max_new_tokens": 4, "min_new_tokens": 2, "stop_token_ids": [1000000000]}, "stop_token_ids"),
    ({"max_new_tokens": 4, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 2**70}, "sampling_seed"),
    ({"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": -(2**70)}, "sampling_seed"),
    ({"max_new_tokens": 4, "temperature": 1.0, "seed": 2**64}, "seed"),
]


def test_a_bad_request_is_refused_while_other_clients_keep_generating(
    http: httpx.Client, engine_url: str, reference: list[int]
) -> None:
    prompts = [[11, 12], [13, 14, 15], [16]]
    expected = [http.post("/generate", json=_long(p, 480)).json()["output_ids"] for p in prompts]

    def run(body: dict) -> httpx.Response:
        with httpx.Client(base_url=engine_url, timeout=120, trust_env=False) as client:
            return client.post("/generate", json=body)

    def states() -> dict:
        return http.get("/get_server_info").json()["internal_states"][0]

    with ThreadPoolExecutor(len(prompts) + len(BAD_GENERATE_PARAMS)) as pool:
        # Held while they arrive, so that all of them join the batch at one step however slowly
        # their threads start on a busy machine.
        http.post("/pause_generation", json={"mode": "in_place"})
        good = [pool.submit(run, _long(p, 480)) for p in prompts]
        deadline = time.monotonic() + 30
        while states()["waiting_requests"] < len(prompts):
            assert time.monotonic() < deadline, "the requests never reached the engine"
        http.post("/continue_generation", json={})
        while states()["running_requests"] < len(prompts):
            assert time.monotonic() < deadline and not any(f.done() for f in good), "requests never ran together"
        # Freeze them in the batch, so the bad requests arrive while they are mid-generation
        # whatever the speed of this machine; a bad request that got in would join their batch.
        http.post("/pause_generation", json={"mode": "in_place"})
        bad = [pool.submit(run, {"text": "x", "sampling_params": params}) for params, _ in BAD_GENERATE_PARAMS]
        answered_while_held = [_settles(f) for f in bad]
        http.post("/continue_generation", json={})
        refused = [f.result(timeout=120) for f in bad]
        results = [f.result(timeout=120).json() for f in good]
    for response, (_, field) in zip(refused, BAD_GENERATE_PARAMS, strict=True):
        assert response.status_code == 400, response.text
        assert field in response.json()["error"]["message"]
    assert all(answered_while_held), "refused before joining the queue, not after"
    for result, want in zip(results, expected, strict=True):
        assert result["meta_info"]["finish_reason"]["type"] == "length", result["meta_info"]
        assert result["output_ids"] == want


def _settles(future: Future, timeout: float = 5.0) -> bool:
    """Whether ``future`` finishes within ``timeout`` (a refused request answers at once; one that
    was let in waits in the queue while generation is held)."""
    try:
        future.result(timeout=timeout)
    except TimeoutError:
        return False
    return True


def test_derived_seeds_of_n_samples_wrap_into_range(http: httpx.Client) -> None:
    top = 2**64 - 1
    body = {"text": "x", "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": top, "n": 3}}
    first = http.post("/generate", json=body)
    assert first.status_code == 200, first.text
    second = http.post("/generate", json=body).json()
    assert [r["output_ids"] for r in first.json()] == [r["output_ids"] for r in second]


LONG = "a" * 5000
OVERSIZED = b'{"text": "' + b"a" * (MAX_MIB << 20) + b'"}'
CASES: list[tuple[str, str, object, int, str]] = [
    # /generate: numbers, NaN/Infinity literals, booleans, types, lists, unicode, lengths.
    ("POST", "/generate", '{"text": "x", "sampling_params": {"temperature": Infinity}}', 400, "temperature"),
    ("POST", "/generate", '{"text": "x", "sampling_params": {"temperature": NaN}}', 400, "temperature"),
    ("POST", "/generate", '{"text": "x", "sampling_params": {"top_p": NaN}}', 400, "top_p"),
    ("POST", "/generate", '{"text": "x", "sampling_params": {"min_p": Infinity}}', 400, "min_p"),
    ("POST", "/generate", '{"text": "x", "sampling_params": {"repetition_penalty": -Infinity}}', 400, "repetition"),
    ("POST", "/generate", '{"text": "x", "sampling_params": {"frequency_penalty": 1e999}}', 400, "frequency"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"top_k": False}}, 400, "top_k"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": True}}, 400, "max_new_tokens"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"n": True}}, 400, "sampling_params.n"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"temperature": True}}, 400, "temperature"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2**70}}, 400, "context length"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"n": 10**6}}, 400, "sampling_params.n"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"stop": [""]}}, 400, "stop"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"stop_token_ids": [2**70]}}, 400, "stop_token_ids"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"stop_token_ids": "1"}}, 400, "stop_token_ids"),
    ("POST", "/generate", {"text": "x", "sampling_params": [{}, {}]}, 400, "sampling_params has 2 entries"),
    ("POST", "/generate", {"input_ids": [True, 1]}, 400, "input_ids"),
    ("POST", "/generate", {"input_ids": [[1], []]}, 400, "empty"),
    ("POST", "/generate", {"input_ids": [[[1]]]}, 400, "input_ids"),
    ("POST", "/generate", {"input_ids": [-1]}, 400, "outside the vocabulary"),
    ("POST", "/generate", {"input_ids": [2**70]}, 400, "outside the vocabulary"),
    ("POST", "/generate", {"text": []}, 400, "empty batch"),
    ("POST", "/generate", {"text": ""}, 400, "empty"),
    ("POST", "/generate", {"text": 5}, 400, "text"),
    ("POST", "/generate", {"text": LONG * 20}, 400, "context length"),
    # Text that cannot fit the context whatever it tokenizes to is refused before tokenizing (a
    # 4 MB prompt once held the event loop for seconds, and much larger ones took gigabytes).
    ("POST", "/generate", {"text": "a" * 4_000_000}, 400, "characters, more than fit the context length"),
    ("POST", "/generate", {"text": ["x", "a" * 100_000]}, 400, "characters, more than fit"),
    ("POST", "/v1/completions", {"prompt": "a" * 100_000}, 400, "characters, more than fit"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG * 20}]}, 400, "characters"),
    # A body larger than the engine reads is refused (413) before it is read, on every route.
    ("POST", "/generate", OVERSIZED, 413, "--max-request-mib"),
    ("POST", "/v1/chat/completions", OVERSIZED, 413, "--max-request-mib"),
    ("POST", "/update_weights_from_disk", OVERSIZED, 413, "--max-request-mib"),
    ("POST", "/update_weights_from_tensor", OVERSIZED, 413, "--max-request-mib"),
    ("POST", "/generate", '{"text": "\\ud800"}', 400, "surrogate"),
    ("POST", "/generate", '{"text": "x", "rid": "\\udc80"}', 400, "rid"),
    ("POST", "/generate", {"text": "x", "top_logprobs_num": 21}, 400, "top_logprobs_num"),
    ("POST", "/generate", {"text": "x", "logprob_start_len": 0}, 400, "logprob_start_len"),
    ("POST", "/generate", {"text": "x", "logprob_start_len": False}, 400, "logprob_start_len"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"n": 2}, "stream": True}, 400, "streaming"),
    ("POST", "/generate", {"text": "x", "extra": {"nested": [1]}}, 400, "unknown field 'extra'"),
    ("POST", "/generate", b"\xff\xfe{", 400, "UTF-8"),
    ("POST", "/generate", b'{"text": "\xff"}', 400, "UTF-8"),
    ("POST", "/generate", b"[" * 50000, 400, "parsed"),
    ("POST", "/generate", b'{"text": "x",', 400, "not valid JSON"),
    ("POST", "/generate", b"[]", 400, "JSON object"),
    ("POST", "/generate", b"", 400, "JSON body"),
    ("POST", "/generate", b"9" * 5000, 400, "JSON"),
    # OpenAI routes: values the native sampling model refuses are refused here, naming the field.
    ("POST", "/v1/completions", {"prompt": "x", "top_k": 0}, 400, "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": False}, 400, "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": ""}, 400, "stop"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("POST", "/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [1, 10**6]}, 400, "outside the vocabulary"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("POST", "/v1/completions", '{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("POST", "/v1/completions", '{"prompt": "x", "presence_penalty": NaN}', 400, "presence_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": "x", "best_of": 2}, 400, "field 'best_of' is not supported"),
    ("POST", "/v1/completions", {"prompt": "x", "bestof": 2}, 400, "unknown field 'bestof'"),
    # SGLang fields that ask for what the engine cannot do are refused by name; a typo stays a typo.
    ("POST", "/generate", {"text": "x", "return_hidden_states": True}, 400, "field 'return_hidden_states'"),
    ("POST", "/generate", {"text": "x", "image_data": "a.png"}, 400, "field 'image_data' is not supported"),
    ("POST", "/generate", {"text": "x", "lora_path": ["a"]}, 400, "field 'lora_path' is not supported"),
    ("POST", "/generate", {"text": "x", "bootstrap_room": 3}, 400, "field 'bootstrap_room'"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"json_schema": "{}"}}, 400, "field 'json_schema'"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"regex": "a+"}}, 400, "field 'regex'"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"temprature": 0}}, 400, "unknown field"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"logit_bias": {"x": 1}}}, 400, "logit_bias"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"logit_bias": {"1": 101}}}, 400, "logit_bias"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"logit_bias": {"999999": 1}}}, 400, "vocabulary"),
    ("POST", "/generate", {"text": "x", "sampling_params": {"logit_bias": {"5": 1, "05": 2}}}, 400, "leading zeros"),
    ("POST", "/generate", {"text": ["a", "b"], "return_logprob": [True]}, 400, "return_logprob has 1 entries"),
    ("POST", "/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": {"continuous_usage_stats": True}}, 400, "continuous"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "image_url",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "field 'tools' is not supported",
    ),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": 0}, 400, "top_k"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400, "stop"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": -(2**70)}, 400, "seed"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": True},
        400,
        "max_completion_tokens",
    ),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}, 400, "top"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400, "surrogate"),
    # Weight updates: paths are checked before any filesystem call.
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp/a\x00b"}, 400, "NUL"),
    ("POST", "/update_weights_from_disk", {"model_path": LONG}, 400, "characters long"),
    ("POST", "/update_weights_from_disk", {"model_path": "/" + "b" * 300}, 400, "component"),
    ("POST", "/update_weights_from_disk", {"model_path": ""}, 400, "empty"),
    ("POST", "/update_weights_from_disk", {"model_path": ["/a"]}, 400, "not a list"),
    ("POST", "/update_weights_from_disk", '{"model_path": "\\udc80"}', 400, "surrogate"),
    ("POST", "/update_weights_from_disk", {"model_path": "/no/such/checkpoint"}, 404, "not a directory"),
    ("POST", "/update_weights_from_disk", {}, 400, "model_path"),
    ("POST", "/update_weights_from_disk", {"model_path": "/a", "weight_version": ""}, 400, "weight_version"),
    ("POST", "/update_weights_from_disk", {"model_path": "/a", "token_step": True}, 400, "token_step"),
    ("POST", "/update_weight_version", {"new_version": ""}, 400, "new_version"),
    ("POST", "/update_weight_version", {"new_version": "v" * 300}, 400, "new_version"),
    ("POST", "/update_weight_version", '{"new_version": "\\ud800"}', 400, "new_version"),
    ("POST", "/update_weight_version", {"new_version": 2}, 400, "new_version"),
    ("POST", "/update_weight_version", {}, 400, "new_version"),
    # Control endpoints.
    ("POST", "/pause_generation", {"mode": "sleep"}, 400, "mode"),
    ("POST", "/pause_generation", {"mode": 1}, 400, "mode"),
    ("POST", "/continue_generation", b"[]", 400, "JSON object"),
    ("POST", "/continue_generation", {"torch_empty_cache": "perhaps"}, 400, "torch_empty_cache"),
    ("POST", "/abort_request", {}, 400, "rid"),
    ("POST", "/abort_request", {"rid": 5}, 400, "rid"),
    ("POST", "/abort_request", '{"rid": "x", "abort_message": "\\ud800"}', 400, "abort_message"),
    ("POST", "/weights_checker", {"action": "snapshot"}, 400, "action"),
    ("POST", "/weights_checker", b'"checksum"', 400, "JSON object"),
    ("POST", "/export_weights", {}, 400, "step"),
    ("POST", "/export_weights", {"step": -1}, 400, "step"),
    ("POST", "/export_weights", {"step": True}, 400, "step"),
    ("POST", "/export_weights", {"step": 2**70}, 400, "step"),
    ("POST", "/export_weights", {"step": 1}, 409, "--snapshot-dir"),
    ("GET", "/no_such_endpoint", None, 404, "no such endpoint"),
    ("PUT", "/generate", {}, 405, "method"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "needle"),
    CASES,
    ids=[f"{method} {path} {str(body)[:40]}" for method, path, body, _, _ in CASES],
)
def test_bad_input_gets_a_4xx_naming_the_problem(
    http: httpx.Client, reference: list[int], method: str, path: str, body: object, status: int, needle: str
) -> None:
    if body is None:
        response = http.request(method, path)
    else:
        raw = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
        response = http.request(method, path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"], response.text


def test_a_chunked_body_is_refused_once_it_passes_the_limit(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        # No Content-Length: the engine counts what arrives.
        yield b'{"text": "'
        for _ in range(2 * MAX_MIB):
            yield b"a" * (1 << 20)

    response = http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text[:300]
    assert "--max-request-mib" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rid", [1] * 2_000_000),
        ("input_ids", [[1, 2, "x"]] * 500_000),
        ("sampling_params", {"max_new_tokens": 1, "logit_bias": {str(i): "x" for i in range(500_000)}}),
    ],
    ids=["rid", "input_ids", "logit_bias"],
)
def test_millions_of_bad_values_get_one_error_not_millions(http: httpx.Client, field: str, value: object) -> None:
    """A body of a few MiB whose list holds millions of wrong values: validating and reporting each
    held the event loop for a minute (the engine failed its health checks and was restarted, and the
    controller sent the same request to the next server). Each list stops at its first bad item."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}, field: value}
    if field == "input_ids":
        del body["text"]
    response = http.post("/generate", content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:500]
    assert len(response.content) < 4096, "one error per field, not one per item"
    assert field in response.json()["error"]["message"]


def test_the_engine_still_generates_correctly_after_all_of_it(http: httpx.Client, reference: list[int]) -> None:
    # Runs after the table (pytest keeps file order): nothing above changed what the engine serves.
    assert http.get("/health_generate").status_code == 200
    assert http.get("/get_weight_version").json()["weight_version"] == "1"
    assert http.post("/generate", json=REFERENCE).json()["output_ids"] == reference


class _BrokenInfoEngine(Engine):
    """The real engine with one bug planted: /get_model_info raises."""

    def model_info(self) -> dict[str, object]:
        raise RuntimeError("planted bug")


def test_a_bug_in_a_handler_answers_a_json_500_and_logs_its_traceback(
    checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    engine = _BrokenInfoEngine(EngineSettings(model_path=checkpoints["v1"]))
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        response = client.get("/get_model_info")
        assert client.get("/get_weight_version").status_code == 200  # the server goes on
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_error" and "planted bug" in error["message"]
    logged = [r for r in caplog.records if r.getMessage().startswith("unhandled error on GET /get_model_info")]
    assert logged and logged[0].exc_info is not None


def test_after_a_bug_answers_500_the_connection_stays_open(checkpoints: dict[str, Path]) -> None:
    """Over real HTTP: a client that reuses its keep-alive connection after a 500 is answered on
    it (the server re-raising the bug would close it, failing the client's next request)."""
    engine = _BrokenInfoEngine(EngineSettings(model_path=checkpoints["v1"]))
    with (
        app_on_loopback(create_app(engine), timeout_s=120) as port,
        socket.create_connection(("127.0.0.1", port), timeout=30) as sock,
    ):
        reader = sock.makefile("rb")
        for path, status in (("/get_model_info", 500), ("/get_weight_version", 200), ("/get_model_info", 500)):
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: engine\r\n\r\n".encode())
            assert _status_and_body(reader) == status, path


def _status_and_body(reader: BinaryIO) -> int:
    """Read one HTTP/1.1 response with a Content-Length off ``reader``; return its status."""
    status_line = reader.readline()
    assert status_line, "the server closed the connection"
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    reader.read(length)
    return int(status_line.split()[1])


def test_a_full_queue_answers_429_and_a_batch_larger_than_it_400(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    args = ("--max-queued-requests", "2", "--max-running-requests", "1")
    with (
        running_engine(checkpoints["v1"], log_dir=tmp_path, extra_args=args) as url,
        httpx.Client(base_url=url, timeout=60, trust_env=False) as http,
        ThreadPoolExecutor(1) as pool,
    ):
        reference = http.post("/generate", json=REFERENCE).json()["output_ids"]
        # SGLang's --max-queued-requests counts sequences: a batch that could never fit is the
        # request's fault (400), a queue that is full now is the server's state (429, retry now).
        too_big = http.post("/generate", json={"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 1}})
        assert too_big.status_code == 400 and "--max-queued-requests" in too_big.text
        too_many = http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1, "n": 3}})
        assert too_many.status_code == 400, too_many.text
        assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        twice = {**REFERENCE, "sampling_params": {**REFERENCE["sampling_params"], "n": 2}}
        held: Future[httpx.Response] = pool.submit(http.post, "/generate", json=twice)
        deadline = time.monotonic() + 60
        while http.get("/get_server_info").json()["internal_states"][0]["waiting_requests"] != 2:
            assert time.monotonic() < deadline, "the request never queued"
            time.sleep(0.02)  # the queue is state the engine reports, not an event it sends
        full = http.post("/generate", json=REFERENCE)
        assert full.status_code == 429, full.text
        assert full.headers["retry-after"] == "0"
        assert full.json()["error"]["type"] == "rate_limit_error" and "queue is full" in full.text
        assert http.post("/continue_generation", json={}).status_code == 200
        assert [r["output_ids"] for r in held.result(timeout=60).json()] == [reference, reference]
        assert http.post("/generate", json=REFERENCE).json()["output_ids"] == reference

"""Weight updates on a real engine: verified loads, refused checkpoints, pause modes, no torn reads."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from miles.testing import copy_checkpoint, running_engine, weights_held
from miles.weights.checkpoint import read_manifest


@pytest.fixture(scope="module")
def allowed_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("allowed")


@pytest.fixture(scope="module")
def bad_checkpoints(checkpoints: dict[str, Path], allowed_root: Path) -> dict[str, Path]:
    """Broken variants of v2 inside the allowed root, one per way a checkpoint goes wrong."""
    from miles.models.presets import get_preset
    from miles.weights.checkpoint import save_checkpoint

    made: dict[str, Path] = {}
    corrupt = copy_checkpoint(checkpoints["v2"], allowed_root / "corrupt")
    weights = corrupt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # one byte inside the last tensor
    weights.write_bytes(bytes(data))
    made["corrupt"] = corrupt

    truncated = copy_checkpoint(checkpoints["v2"], allowed_root / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    made["truncated"] = truncated

    no_manifest = copy_checkpoint(checkpoints["v2"], allowed_root / "no_manifest")
    (no_manifest / "miles_manifest.json").unlink()
    made["no_manifest"] = no_manifest

    import torch
    import transformers

    config = get_preset("tiny").build_config()
    config.intermediate_size = 96  # same tensor names, other shapes
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    save_checkpoint(allowed_root / "wrong_shape", model=model, model_name="tiny", step=9)
    made["wrong_shape"] = allowed_root / "wrong_shape"
    return made


@pytest.fixture(scope="module")
def engine_url(
    checkpoints: dict[str, Path], allowed_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    roots = f"{checkpoints['v1'].parent},{allowed_root}"
    with running_engine(
        checkpoints["v1"],
        log_dir=tmp_path_factory.mktemp("logs"),
        env={"MILES_ALLOWED_CHECKPOINT_ROOTS": roots},
    ) as url:
        yield url


@pytest.fixture
def http(engine_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine_url, timeout=120, trust_env=False) as client:
        # Every test starts serving v1 and unpaused.
        client.post("/continue_generation", json={})
        client.post("/update_weights_from_disk", json={"model_path": str(read_manifest_dir(client))})
        yield client


def read_manifest_dir(client: httpx.Client) -> Path:
    return Path(client.get("/get_model_info").json()["tokenizer_path"])


PROMPTS = ["a", "12+7=", "hello", "the cat", "zz top", "999"]


def greedy(prompt: str, n: int = 10) -> dict[str, object]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0}}


def outputs(http: httpx.Client) -> list[list[int]]:
    return [http.post("/generate", json=greedy(p)).json()["output_ids"] for p in PROMPTS]


def load(http: httpx.Client, path: Path, **extra: object) -> httpx.Response:
    return http.post("/update_weights_from_disk", json={"model_path": str(path), **extra})


def test_update_loads_verified_weights_and_back(http: httpx.Client, checkpoints: dict[str, Path]) -> None:
    before = outputs(http)
    response = load(http, checkpoints["v2"])
    body = response.json()
    assert response.status_code == 200 and body["success"] is True, body
    assert body["weight_version"] == "2"
    assert body["checksum"] == read_manifest(checkpoints["v2"]).checksum
    checker = http.post("/weights_checker", json={"action": "checksum"}).json()["payload"]
    assert checker["checksum"] == read_manifest(checkpoints["v2"]).checksum
    # The identity a drift probe reads follows a direct load at once.
    identity = {"weight_version": "2", "checksum": read_manifest(checkpoints["v2"]).checksum}
    assert weights_held(http) == identity
    assert http.get("/get_server_info").json()["checksum"] == identity["checksum"]
    after = outputs(http)
    assert after != before
    assert load(http, checkpoints["v1"]).json()["success"] is True
    assert outputs(http) == before


def _loads_while_rewritten(http: httpx.Client, source: Path, racing: Path) -> list[httpx.Response]:
    """Load ``racing`` (a copy of ``source``) a dozen times while its weights file is cut and
    written again, over and over: a trainer saving a checkpoint again in place."""
    copy_checkpoint(source, racing)
    path = racing / "model.safetensors"
    data = path.read_bytes()
    stop = threading.Event()

    def rewrite() -> None:
        with open(path, "r+b") as f:
            while not stop.is_set():
                f.truncate(0)
                f.seek(0)
                f.write(data)
                f.flush()
                time.sleep(0.001)  # whole for a moment, so that loads open it and meet the next cut

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        return [load(http, racing) for _ in range(12)]
    finally:
        stop.set()
        writer.join()


def test_a_checkpoint_rewritten_while_it_is_staged_never_takes_the_engine_down(
    http: httpx.Client, checkpoints: dict[str, Path], allowed_root: Path
) -> None:
    """Read through a memory map, the engine died (SIGBUS) on the first such load. Each load now
    either loads what the manifest says or is refused, and the engine serves weights it vouches for."""
    before = outputs(http)
    answers = _loads_while_rewritten(http, checkpoints["v2"], allowed_root / "racing-staged")
    assert {a.status_code for a in answers} <= {200, 400}, [a.text for a in answers]
    v1, v2 = read_manifest(checkpoints["v1"]), read_manifest(checkpoints["v2"])
    assert weights_held(http) in (
        {"weight_version": "2", "checksum": v2.checksum},
        {"weight_version": "1", "checksum": v1.checksum},
    )
    assert load(http, checkpoints["v1"]).json()["success"] is True
    assert outputs(http) == before


def test_a_checkpoint_rewritten_while_it_is_copied_in_place_never_takes_the_engine_down(
    checkpoints: dict[str, Path], allowed_root: Path, tmp_path: Path
) -> None:
    """Copied in place, a file cut part of the way through leaves weights that are no checkpoint's:
    the load fails and they are unverified until a load succeeds, which it then does."""
    roots = f"{checkpoints['v1'].parent},{allowed_root}"
    env = {"MILES_ALLOWED_CHECKPOINT_ROOTS": roots}
    with (
        running_engine(checkpoints["v1"], log_dir=tmp_path, extra_args=("--weight-staging", "off"), env=env) as url,
        httpx.Client(base_url=url, timeout=120, trust_env=False) as http,
    ):
        before = outputs(http)
        answers = _loads_while_rewritten(http, checkpoints["v2"], allowed_root / "racing-in-place")
        assert {a.status_code for a in answers} <= {200, 400}, [a.text for a in answers]
        assert load(http, checkpoints["v1"]).json()["success"] is True
        assert weights_held(http) == {"weight_version": "1", "checksum": read_manifest(checkpoints["v1"]).checksum}
        assert outputs(http) == before


def test_custom_weight_version_is_kept(http: httpx.Client, checkpoints: dict[str, Path]) -> None:
    assert load(http, checkpoints["v2"], weight_version="step-2-rc").json()["weight_version"] == "step-2-rc"
    response = http.post("/generate", json=greedy("a")).json()
    assert response["meta_info"]["weight_version"] == "step-2-rc"


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("corrupt", "digest_mismatch"),
        ("truncated", "truncated_file"),
        ("no_manifest", "manifest"),
        ("wrong_shape", "shape"),
    ],
)
def test_bad_checkpoints_are_refused_and_old_weights_keep_serving(
    http: httpx.Client, checkpoints: dict[str, Path], bad_checkpoints: dict[str, Path], kind: str, needle: str
) -> None:
    before = outputs(http)
    response = load(http, bad_checkpoints[kind])
    assert response.status_code == 400
    body = response.json()
    assert body["success"] is False
    assert needle in body["message"].lower(), body["message"]
    # A refused load leaves the identity as it was.
    assert weights_held(http) == {
        "weight_version": "1",
        "checksum": read_manifest(checkpoints["v1"]).checksum,
    }
    checker = http.post("/weights_checker", json={}).json()["payload"]
    assert checker["checksum"] == read_manifest(checkpoints["v1"]).checksum
    assert outputs(http) == before


def test_paths_outside_allowed_roots_lists_and_missing_dirs_are_refused(
    http: httpx.Client, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    outside = copy_checkpoint(checkpoints["v2"], tmp_path / "outside")
    response = load(http, outside)
    assert response.status_code == 403
    assert "allowed checkpoint roots" in response.json()["error"]["message"]
    listed = http.post("/update_weights_from_disk", json={"model_path": [str(checkpoints["v2"])]})
    assert listed.status_code == 400 and "not a list" in listed.json()["error"]["message"]
    missing = load(http, checkpoints["v1"].parent / "nope")
    assert missing.status_code == 404
    # Inside a root, within the text limits (4,096 characters, 255 bytes a name), but longer in
    # bytes than any path the system can open: refused as such, never a 500.
    long = load(http, checkpoints["v1"].parent.joinpath(*["é" * 120] * 30))
    assert long.status_code == 403 and "cannot be listed" in long.json()["error"]["message"], long.text
    assert http.get("/get_weight_version").json()["weight_version"] == "1"


def long_request(prompt: str = "a", tokens: int = 400) -> dict[str, object]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}


def start_long(engine_url: str, count: int = 1, tokens: int = 400) -> tuple[ThreadPoolExecutor, list]:
    pool = ThreadPoolExecutor(count)

    def run(i: int) -> dict:
        with httpx.Client(base_url=engine_url, timeout=120, trust_env=False) as client:
            return client.post("/generate", json=long_request(f"p{i}", tokens)).json()

    futures = [pool.submit(run, i) for i in range(count)]
    return pool, futures


def wait_running(http: httpx.Client, count: int, futures: list) -> None:
    # Polling the server's own counters: the only way to observe "the request is now running"
    # from outside the process.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished = [f.result() for f in futures if f.done()]
        assert not finished, f"a long request ended before it was observed running: {finished}"
        state = http.get("/get_server_info").json()["internal_states"][0]
        if state["running_requests"] >= count:
            return
        time.sleep(0.001)
    raise AssertionError("requests never started running")


def test_pause_drain_finishes_in_flight_work(http: httpx.Client, engine_url: str) -> None:
    pool, futures = start_long(engine_url, 2, tokens=480)
    wait_running(http, 2, futures)
    paused = http.post("/pause_generation", json={"mode": "drain"}).json()
    assert paused["num_paused_requests"] == 2
    for future in futures:
        result = future.result(timeout=60)
        assert result["meta_info"]["finish_reason"]["type"] == "length"
        assert result["meta_info"]["completion_tokens"] == 480
    # New work waits while paused, then runs after continue.
    waiting = pool.submit(lambda: httpx.post(f"{engine_url}/generate", json=greedy("x", 3), timeout=60).json())
    time.sleep(0.3)
    assert not waiting.done()
    http.post("/continue_generation", json={})
    assert waiting.result(timeout=60)["meta_info"]["completion_tokens"] == 3
    pool.shutdown()


def test_pause_abort_ends_in_flight_work(http: httpx.Client, engine_url: str) -> None:
    pool, futures = start_long(engine_url, 2, tokens=480)
    wait_running(http, 2, futures)
    http.post("/pause_generation", json={"mode": "abort"})
    for future in futures:
        meta = future.result(timeout=60)["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] < 480
    http.post("/continue_generation", json={})
    pool.shutdown()


def test_pause_retract_requeues_running_requests_and_they_finish_complete(http: httpx.Client, engine_url: str) -> None:
    pool, futures = start_long(engine_url, 1, tokens=480)
    wait_running(http, 1, futures)
    paused = http.post("/pause_generation", json={"mode": "retract"}).json()
    assert paused["num_paused_requests"] == 1
    # Retracted, not ended: it waits at the front of the queue with what it produced.
    state = http.get("/get_server_info").json()["internal_states"][0]
    assert (state["running_requests"], state["waiting_requests"]) == (0, 1)
    assert not futures[0].done()
    http.post("/continue_generation", json={})
    result = futures[0].result(timeout=60)
    meta = result["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["interrupted"] is False
    assert meta["completion_tokens"] == len(result["output_ids"]) == 480
    assert meta["weight_version_spans"] == [{"weight_version": "1", "start": 0, "end": 480}]
    # Re-prefilling prompt + output on the same weights continues exactly where it stopped.
    straight = http.post("/generate", json=long_request("p0", 480)).json()
    assert result["output_ids"] == straight["output_ids"]
    pool.shutdown()


def test_aborting_a_retracted_request_returns_its_partial_output(http: httpx.Client, engine_url: str) -> None:
    with ThreadPoolExecutor(1) as pool:
        body = {**long_request("p0", 480), "rid": "retracted-1"}
        future = pool.submit(lambda: httpx.post(f"{engine_url}/generate", json=body, timeout=60, trust_env=False))
        wait_running(http, 1, [future])
        http.post("/pause_generation", json={"mode": "retract"})
        # Still in flight under its rid: a second request with that rid is refused.
        again = http.post("/generate", json={**greedy("x", 1), "rid": "retracted-1"})
        assert again.status_code == 400 and "already in flight" in again.json()["error"]["message"]
        assert http.post("/abort_request", json={"rid": "retracted-1"}).json()["num_aborted"] == 1
        result = future.result(timeout=60).json()
    meta = result["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["interrupted"] is True
    assert 0 < meta["completion_tokens"] == len(result["output_ids"]) < 480
    http.post("/continue_generation", json={})


def test_a_retracted_request_resumes_on_new_weights_with_version_spans(
    http: httpx.Client, engine_url: str, checkpoints: dict[str, Path]
) -> None:
    prompt = [5, 17, 42, 99]
    total = 480
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": total, "temperature": 0, "ignore_eos": True}}
    v1_reference = http.post("/generate", json=body).json()["output_ids"]
    snapshots: list[dict] = []
    with httpx.Client(base_url=engine_url, timeout=120, trust_env=False) as streaming:
        with streaming.stream("POST", "/generate", json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    snapshots.append(json.loads(line.removeprefix("data: ")))
                    if len(snapshots[-1]["output_ids"]) >= 5:
                        break
            paused = http.post("/pause_generation", json={"mode": "retract"}).json()
            assert paused["num_paused_requests"] == 1
            # The caller paused the engine, so the update leaves it paused.
            loaded = load(http, checkpoints["v2"]).json()
            assert loaded["success"] is True and loaded["weight_version"] == "2"
            assert http.get("/get_server_info").json()["internal_states"][0]["waiting_requests"] == 1
            http.post("/continue_generation", json={})
            for line in lines:
                if line.startswith("data: {"):
                    snapshots.append(json.loads(line.removeprefix("data: ")))
    final = snapshots[-1]
    meta = final["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["interrupted"] is False
    assert meta["completion_tokens"] == len(final["output_ids"]) == total
    spans = meta["weight_version_spans"]
    changed = spans[0]["end"]
    assert spans == [
        {"weight_version": "1", "start": 0, "end": changed},
        {"weight_version": "2", "start": changed, "end": total},
    ]
    assert 5 <= changed < total
    assert (meta["weight_version_start"], meta["weight_version_end"], meta["weight_version"]) == ("1", "2", "2")
    # Before the change: v1's greedy tokens. After: what v2 produces greedily from the history.
    assert final["output_ids"][:changed] == v1_reference[:changed]
    prefix = final["output_ids"][:changed]
    continuation = http.post(
        "/generate",
        json={
            "input_ids": prompt + prefix,
            "sampling_params": {"max_new_tokens": total - changed, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    assert continuation["meta_info"]["weight_version"] == "2"
    assert final["output_ids"][changed:] == continuation["output_ids"]
    # Stream snapshots carry the spans too, and every span covers the tokens sent so far.
    for snapshot in snapshots[:-1]:
        covered = snapshot["meta_info"]["weight_version_spans"]
        assert covered[-1]["end"] == len(snapshot["output_ids"])


def test_in_place_pause_lets_requests_span_an_update(
    http: httpx.Client, engine_url: str, checkpoints: dict[str, Path]
) -> None:
    pool, futures = start_long(engine_url, 1, tokens=480)
    wait_running(http, 1, futures)
    http.post("/pause_generation", json={"mode": "in_place"})
    assert load(http, checkpoints["v2"]).json()["success"] is True
    http.post("/continue_generation", json={})
    meta = futures[0].result(timeout=60)["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert (meta["weight_version_start"], meta["weight_version_end"]) == ("1", "2")
    spans = meta["weight_version_spans"]
    assert [s["weight_version"] for s in spans] == ["1", "2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == 480
    pool.shutdown()


def test_version_only_change_never_aborts(http: httpx.Client, engine_url: str, checkpoints: dict[str, Path]) -> None:
    pool, futures = start_long(engine_url, 1, tokens=300)
    wait_running(http, 1, futures)
    assert http.post("/update_weight_version", json={"new_version": "1b"}).json()["success"] is True
    meta = futures[0].result(timeout=60)["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["completion_tokens"] == 300
    # A rename changes the name, not the weights: the checksum stays.
    assert weights_held(http) == {
        "weight_version": "1b",
        "checksum": read_manifest(checkpoints["v1"]).checksum,
    }
    assert [s["weight_version"] for s in meta["weight_version_spans"]] == ["1", "1b"]
    pool.shutdown()


def test_no_torn_reads_while_updates_alternate(
    http: httpx.Client, engine_url: str, checkpoints: dict[str, Path]
) -> None:
    """Concurrent greedy clients while v1/v2 alternate: every response is exactly what one version
    produces alone, and says which."""
    reference = {"1": outputs(http)}
    load(http, checkpoints["v2"])
    reference["2"] = outputs(http)
    load(http, checkpoints["v1"])
    assert reference["1"] != reference["2"]

    stop = threading.Event()
    seen: list[tuple[int, dict]] = []
    errors: list[str] = []

    def client(worker: int) -> None:
        with httpx.Client(base_url=engine_url, timeout=120, trust_env=False) as c:
            i = worker
            while not stop.is_set():
                index = i % len(PROMPTS)
                response = c.post("/generate", json=greedy(PROMPTS[index]))
                if response.status_code != 200:
                    errors.append(response.text)
                else:
                    seen.append((index, response.json()))
                i += 1

    threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    try:
        round_ = 0
        # At least 10 updates, and enough responses around them to mean something.
        while round_ < 10 or (len(seen) < 60 and round_ < 200):
            target = checkpoints["v2"] if round_ % 2 == 0 else checkpoints["v1"]
            assert load(http, target).json()["success"] is True
            round_ += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors
    assert len(seen) >= 60
    versions = set()
    for index, response in seen:
        meta = response["meta_info"]
        assert meta["weight_version_start"] == meta["weight_version_end"]
        versions.add(meta["weight_version"])
        assert response["output_ids"] == reference[meta["weight_version"]][index]
    assert versions == {"1", "2"}


@pytest.fixture(scope="module")
def plain_checkpoint(allowed_root: Path) -> tuple[Path, str]:
    """A plain Hugging Face directory (``save_pretrained`` + tokenizer, no miles manifest) inside
    the allowed root, and the checksum of the model it was saved from."""
    from miles.models import build_model, build_tokenizer
    from miles.weights.checksum import checksum_module

    model = build_model("tiny", seed=1)
    directory = allowed_root / "plain-hf"
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    assert not (directory / "miles_manifest.json").exists()
    return directory, checksum_module(model).checksum


def test_a_plain_hf_checkpoint_loads_when_its_checksum_is_expected(
    http: httpx.Client, plain_checkpoint: tuple[Path, str]
) -> None:
    directory, checksum = plain_checkpoint
    before = outputs(http)
    response = load(http, directory, expected_checksum=checksum, weight_version="hf-1")
    body = response.json()
    assert response.status_code == 200 and body["success"] is True, body
    # The files were hashed once, while verifying; the live weights were hashed after the copy.
    assert body["checkpoint_checksum"] == checksum
    assert body["checksum"] == checksum
    assert body["weight_version"] == "hf-1"
    assert weights_held(http) == {"weight_version": "hf-1", "checksum": checksum}
    assert http.post("/weights_checker", json={}).json()["payload"]["checksum"] == checksum
    assert outputs(http) != before
    assert http.post("/generate", json=greedy("a")).json()["meta_info"]["weight_version"] == "hf-1"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"weight_version": "hf-x"}, "pass expected_checksum"),
        ({"expected_checksum": "0" * 32}, "pass weight_version"),
    ],
)
def test_a_plain_hf_checkpoint_needs_an_expected_checksum_and_a_version(
    http: httpx.Client, plain_checkpoint: tuple[Path, str], extra: dict, needle: str
) -> None:
    response = load(http, plain_checkpoint[0], **extra)
    body = response.json()
    assert response.status_code == 400 and body["success"] is False
    assert needle in body["message"]
    assert http.get("/get_weight_version").json()["weight_version"] == "1"


def test_a_plain_hf_checkpoint_with_another_checksum_is_refused_naming_both(
    http: httpx.Client, plain_checkpoint: tuple[Path, str], checkpoints: dict[str, Path]
) -> None:
    directory, checksum = plain_checkpoint
    wrong = read_manifest(checkpoints["v3"]).checksum
    assert wrong != checksum
    before = outputs(http)
    response = load(http, directory, expected_checksum=wrong, weight_version="hf-bad")
    body = response.json()
    assert response.status_code == 400 and body["success"] is False
    assert wrong in body["message"] and checksum in body["message"]
    assert body["checkpoint_checksum"] == checksum
    assert body["checksum"] is None  # nothing was copied
    assert weights_held(http) == {
        "weight_version": "1",
        "checksum": read_manifest(checkpoints["v1"]).checksum,
    }
    assert outputs(http) == before


def test_expected_checksum_must_match_the_manifest(http: httpx.Client, checkpoints: dict[str, Path]) -> None:
    v2 = read_manifest(checkpoints["v2"]).checksum
    wrong = read_manifest(checkpoints["v3"]).checksum
    refused = load(http, checkpoints["v2"], expected_checksum=wrong)
    body = refused.json()
    assert refused.status_code == 400 and body["success"] is False
    assert wrong in body["message"] and v2 in body["message"]
    assert http.get("/get_weight_version").json()["weight_version"] == "1"
    accepted = load(http, checkpoints["v2"], expected_checksum=v2).json()
    assert accepted["success"] is True and accepted["checkpoint_checksum"] == v2 == accepted["checksum"]


@pytest.mark.parametrize("value", ["", "x" * 257])
def test_expected_checksum_is_one_to_256_characters(
    http: httpx.Client, checkpoints: dict[str, Path], value: str
) -> None:
    response = load(http, checkpoints["v2"], expected_checksum=value)
    assert response.status_code == 400 and "expected_checksum" in response.json()["error"]["message"]


def test_a_checkpoint_with_a_file_linked_outside_the_roots_is_refused(
    http: httpx.Client, checkpoints: dict[str, Path], allowed_root: Path, tmp_path: Path
) -> None:
    # The directory lies inside a root; its weights are a symlink to a copy outside every root.
    outside = copy_checkpoint(checkpoints["v2"], tmp_path / "outside-v2")
    linked = copy_checkpoint(checkpoints["v2"], allowed_root / f"linked-{tmp_path.name}")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(outside / "model.safetensors")
    response = load(http, linked)
    assert response.status_code == 403, response.text
    message = response.json()["error"]["message"]
    assert "model.safetensors" in message and "outside the allowed checkpoint roots" in message
    assert http.get("/get_weight_version").json()["weight_version"] == "1"
    # A link that stays inside a root is fine.
    inside = copy_checkpoint(checkpoints["v2"], allowed_root / f"inside-{tmp_path.name}")
    (inside / "model.safetensors").unlink()
    (inside / "model.safetensors").symlink_to(checkpoints["v2"] / "model.safetensors")
    assert load(http, inside).json()["success"] is True

"""Staged activation on real engines: the new weights are written and hashed beside the live ones
while the engine serves, and swapped in under the write lock in a time that does not grow with
the model; ``--weight-staging off`` copies in place as before."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.models.presets import init_checkpoint
from miles.testing import copy_checkpoint, running_engine, weights_held
from miles.weights.checkpoint import read_manifest

STAGED_PHASES = {
    "open",
    "verify",
    "match",
    "stage_open",
    "stage_write",
    "stage_checksum",
    "pause",
    "write_lock_wait",
    "activate",
    "generation_held",
}
IN_PLACE_PHASES = {"open", "verify", "match", "pause", "write_lock_wait", "copy_and_checksum", "generation_held"}
PROMPTS = ["a", "12+7=", "hello", "the cat", "zz top", "999"]


def greedy(prompt: str, n: int = 12) -> dict[str, object]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0}}


def outputs(http: httpx.Client, n: int = 12) -> list[list[int]]:
    return [http.post("/generate", json=greedy(p, n)).json()["output_ids"] for p in PROMPTS]


def load(http: httpx.Client, path: Path) -> dict:
    return http.post("/update_weights_from_disk", json={"model_path": str(path)}).json()


def staging_info(http: httpx.Client) -> dict[str, object]:
    return http.get("/get_server_info").json()["weight_staging"]


def identity(http: httpx.Client) -> dict[str, object]:
    return weights_held(http)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def corrupt(checkpoints: dict[str, Path]) -> Path:
    """v2 with one byte flipped inside its last tensor (its manifest still names v2's digests),
    next to the other checkpoints so the engines may read it."""
    path = copy_checkpoint(checkpoints["v2"], checkpoints["v2"].parent / "v2-corrupt")
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    return path


def _engine(checkpoint: Path, log_dir: Path, *args: str) -> Iterator[httpx.Client]:
    with running_engine(checkpoint, log_dir=log_dir, extra_args=args) as url:
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as http:
            yield http


@pytest.fixture(scope="module")
def staged_engine(checkpoints: dict[str, Path], log_dir: Path) -> Iterator[httpx.Client]:
    yield from _engine(checkpoints["v1"], log_dir, "--weight-staging", "on")


@pytest.fixture(scope="module")
def in_place_engine(checkpoints: dict[str, Path], log_dir: Path) -> Iterator[httpx.Client]:
    yield from _engine(checkpoints["v1"], log_dir, "--weight-staging", "off")


@pytest.fixture
def staged(staged_engine: httpx.Client, checkpoints: dict[str, Path]) -> httpx.Client:
    """The staged engine, serving v1 (every test starts there)."""
    assert load(staged_engine, checkpoints["v1"])["success"] is True
    return staged_engine


def test_a_staged_update_serves_what_a_fresh_engine_serves(
    staged: httpx.Client, checkpoints: dict[str, Path], log_dir: Path
) -> None:
    before = outputs(staged)
    body = load(staged, checkpoints["v2"])
    expected = read_manifest(checkpoints["v2"]).checksum
    assert body["success"] is True, body
    assert (body["weight_version"], body["checksum"], body["checkpoint_checksum"]) == ("2", expected, expected)
    assert set(body["timings"]) == STAGED_PHASES
    # The checksum computed over the stage is what the live weights hash to after the swap.
    assert staged.post("/weights_checker", json={}).json()["payload"]["checksum"] == expected
    assert identity(staged) == {"weight_version": "2", "checksum": expected}
    info = staging_info(staged)
    assert (info["mode"], info["last_update_staged"], info["reason"]) == ("on", True, None)
    after = outputs(staged)
    assert after != before
    with running_engine(checkpoints["v2"], log_dir=log_dir) as url:
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as fresh:
            assert outputs(fresh) == after
            # The default, auto, stages when a second copy fits (a tiny model always does).
            assert "activate" in load(fresh, checkpoints["v1"])["timings"]
            assert staging_info(fresh)["mode"] == "auto"
            assert staging_info(fresh)["last_update_staged"] is True
            assert outputs(fresh) == before


def test_later_updates_reuse_the_staging_buffers(staged: httpx.Client, checkpoints: dict[str, Path]) -> None:
    info = staging_info(staged)
    assert info["staging_bytes"] == info["weight_bytes"] > 0
    for name in ("v2", "v3", "v4", "v1"):
        body = load(staged, checkpoints[name])
        assert body["success"] is True and body["checksum"] == read_manifest(checkpoints[name]).checksum
        assert staging_info(staged) == info


def test_a_corrupt_checkpoint_is_refused_and_the_old_weights_keep_serving(
    staged: httpx.Client, checkpoints: dict[str, Path], corrupt: Path
) -> None:
    before = outputs(staged)
    response = staged.post("/update_weights_from_disk", json={"model_path": str(corrupt)})
    assert response.status_code == 400
    body = response.json()
    assert body["success"] is False and "digest_mismatch" in body["message"]
    assert identity(staged) == {"weight_version": "1", "checksum": read_manifest(checkpoints["v1"]).checksum}
    assert staged.post("/weights_checker", json={}).json()["payload"]["checksum"] == identity(staged)["checksum"]
    # Never paused: still serving, the same outputs.
    assert staged.get("/health_generate").status_code == 200
    assert outputs(staged) == before
    assert load(staged, checkpoints["v2"])["success"] is True


def test_requests_in_flight_during_staged_updates_each_see_one_version(
    staged: httpx.Client, checkpoints: dict[str, Path]
) -> None:
    """Clients keep generating while updates alternate v1/v2: every answer is exactly what one
    version produces alone, and says which (drained onto the old weights, or run on the new)."""
    tokens = 24
    reference = {"1": outputs(staged, tokens)}
    assert load(staged, checkpoints["v2"])["success"] is True
    reference["2"] = outputs(staged, tokens)
    assert reference["1"] != reference["2"]

    stop = threading.Event()
    seen: list[tuple[int, dict]] = []
    errors: list[str] = []

    def client(worker: int) -> None:
        with httpx.Client(base_url=str(staged.base_url), timeout=120, trust_env=False) as http:
            i = worker
            while not stop.is_set():
                index = i % len(PROMPTS)
                response = http.post("/generate", json=greedy(PROMPTS[index], tokens))
                if response.status_code == 200:
                    seen.append((index, response.json()))
                else:
                    errors.append(response.text)
                i += 1

    threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    drained = 0
    try:
        rounds = 0
        while rounds < 10 or (len(seen) < 60 and rounds < 200):
            body = load(staged, checkpoints["v1" if rounds % 2 else "v2"])
            assert body["success"] is True and "activate" in body["timings"], body
            drained += body["num_paused_requests"]
            rounds += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors
    assert len(seen) >= 60
    assert drained > 0  # requests were in flight when updates paused, and finished on the old weights
    versions = set()
    for index, response in seen:
        meta = response["meta_info"]
        assert meta["weight_version_start"] == meta["weight_version_end"]
        versions.add(meta["weight_version"])
        assert response["output_ids"] == reference[meta["weight_version"]][index]
    assert versions == {"1", "2"}


def test_off_copies_in_place_as_before(in_place_engine: httpx.Client, checkpoints: dict[str, Path]) -> None:
    assert load(in_place_engine, checkpoints["v1"])["success"] is True
    before = outputs(in_place_engine)
    body = load(in_place_engine, checkpoints["v2"])
    expected = read_manifest(checkpoints["v2"]).checksum
    assert body["success"] is True and body["checksum"] == expected
    assert set(body["timings"]) == IN_PLACE_PHASES
    assert in_place_engine.post("/weights_checker", json={}).json()["payload"]["checksum"] == expected
    assert staging_info(in_place_engine) == {
        "mode": "off",
        "budget": 0.5,
        "weight_bytes": 0,
        "staging_bytes": 0,
        "last_update_staged": False,
        "reason": "--weight-staging off",
    }
    assert outputs(in_place_engine) != before
    assert load(in_place_engine, checkpoints["v1"])["success"] is True
    assert outputs(in_place_engine) == before


def test_auto_copies_in_place_when_a_second_copy_does_not_fit(checkpoints: dict[str, Path], log_dir: Path) -> None:
    # A budget no model fits in: the update is copied in place, and the engine says why.
    for http in _engine(checkpoints["v1"], log_dir, "--weight-staging", "auto", "--weight-staging-budget", "1e-9"):
        body = load(http, checkpoints["v2"])
        assert body["success"] is True and body["checksum"] == read_manifest(checkpoints["v2"]).checksum
        assert set(body["timings"]) == IN_PLACE_PHASES
        info = staging_info(http)
        assert (info["mode"], info["staging_bytes"], info["last_update_staged"]) == ("auto", 0, False)
        assert "--weight-staging-budget" in str(info["reason"])


def _median_phase(http: httpx.Client, versions: list[Path], phase: str) -> float:
    """The median of ``phase`` over updates alternating between ``versions`` (the first warms up)."""
    seconds = []
    for i in range(7):
        body = load(http, versions[(i + 1) % 2])
        assert body["success"] is True, body
        seconds.append(body["timings"][phase])
    return statistics.median(seconds[1:])


def test_the_swap_does_not_grow_with_the_model_as_the_copy_does(
    staged_engine: httpx.Client,
    in_place_engine: httpx.Client,
    checkpoints: dict[str, Path],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two presets 23x apart in bytes: generation waits for the in-place copy (``copy_and_checksum``
    under the write lock) or for the swap (``activate``). The swap is much shorter than the copy
    for both, and grows with the number of tensors (2.5x here), far less than the bytes."""
    root = tmp_path_factory.mktemp("small")
    small = [root / "s1", root / "s2"]
    for seed, path in enumerate(small):
        init_checkpoint(path, model_name="small", preset="small", seed=seed, step=seed + 1)
    tiny = [checkpoints["v1"], checkpoints["v2"]]
    swap, copy, size = {}, {}, {}
    swap["tiny"] = _median_phase(staged_engine, tiny, "activate")
    copy["tiny"] = _median_phase(in_place_engine, tiny, "copy_and_checksum")
    size["tiny"] = staging_info(staged_engine)["weight_bytes"]
    for http in _engine(small[0], log_dir, "--weight-staging", "on"):
        swap["small"] = _median_phase(http, small, "activate")
        size["small"] = staging_info(http)["weight_bytes"]
    for http in _engine(small[0], log_dir, "--weight-staging", "off"):
        copy["small"] = _median_phase(http, small, "copy_and_checksum")
    growth = size["small"] / size["tiny"]
    assert growth > 20
    for preset in ("tiny", "small"):
        assert swap[preset] * 3 < copy[preset], (swap, copy)
    assert swap["small"] / swap["tiny"] < growth / 3, (swap, size)

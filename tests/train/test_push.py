"""Weights pushed from the trainer's memory into real engines: shared memory and torch.distributed
(gloo), verified like a checkpoint, and every way a push can go wrong."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.errors import PublishError
from miles.rollout.engine_process import free_port
from miles.rollout.state import ServerState
from miles.testing import running_controller, running_engine
from miles.train.push import PushPublisher
from miles.weights.buckets import layout, pack
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import saved_state_dict

pytestmark = pytest.mark.timeout(300)

GREEDY = {"text": "abcdef", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


def weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoint))


@pytest.fixture(scope="module")
def v2_weights(checkpoints: dict[str, Path]) -> dict[str, torch.Tensor]:
    return weights_of(checkpoints["v2"])


@pytest.mark.parametrize("path", ["shm", "distributed"])
async def test_a_push_serves_exactly_the_published_weights(
    checkpoints: dict[str, Path], v2_weights: dict[str, torch.Tensor], path: str
) -> None:
    v2 = read_manifest(checkpoints["v2"])
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (ctl, url):
        # Small buckets: several per update, whatever the number of tensors.
        publisher = PushPublisher(ctl, path=path, bucket_bytes=64 * 1024, timeout_s=30)
        result = await publisher.push(v2_weights, step=7)
        assert (result.checksum, result.path, result.checkpoint_dir) == (v2.checksum, path, None)
        stats = publisher.last
        assert stats is not None and stats.buckets > 1
        # One call per bucket and engine (plus joining and leaving the group): constant in tensors.
        per_engine = stats.buckets + (2 if path == "distributed" else 0)
        assert stats.calls == 2 * per_engine
        servers = ctl.health().servers
        assert all(s.state is ServerState.SERVING and s.checksum == v2.checksum for s in servers)
        assert all(s.weight_version == "7" for s in servers)
        async with httpx.AsyncClient(trust_env=False) as http:
            answers = {(await http.post(f"{url}/generate", json=GREEDY)).json()["text"] for _ in range(4)}
    # The same greedy text as an engine loaded from the checkpoint itself.
    async with running_controller(model_checkpoint=checkpoints["v2"], num_servers=1) as (_, url2):
        async with httpx.AsyncClient(trust_env=False) as http:
            expected = (await http.post(f"{url2}/generate", json=GREEDY)).json()["text"]
    assert answers == {expected}


async def test_a_push_missing_a_tensor_is_rolled_back_and_serving_stays_verified(
    checkpoints: dict[str, Path], v2_weights: dict[str, torch.Tensor]
) -> None:
    v1 = read_manifest(checkpoints["v1"])
    partial = dict(list(v2_weights.items())[:-1])
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (ctl, _):
        with pytest.raises(PublishError, match="hash to"):
            await PushPublisher(ctl, path="shm", timeout_s=30).push(partial, step=7)
        servers = ctl.health().servers
        assert all(s.state is ServerState.SERVING and s.checksum == v1.checksum for s in servers), servers
        assert not ctl.health().lock.held


@pytest.fixture
def engine_url(checkpoints: dict[str, Path], tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """One engine of our own with a control secret (no controller)."""
    secret = "s" * 32
    with running_engine(checkpoints["v1"], log_dir=tmp_path, env={"MILES_ENGINE_SECRET": secret}) as url:
        yield url, {"authorization": f"Bearer {secret}"}


def shm_document(name: str, table: object) -> str:
    return base64.b64encode(json.dumps({"shm": name, "table": table}).encode()).decode()


def test_a_corrupted_bucket_is_refused_before_the_weights_change(
    engine_url: tuple[str, dict[str, str]], v2_weights: dict[str, torch.Tensor]
) -> None:
    url, auth = engine_url
    before = httpx.get(f"{url}/get_weight_version", headers=auth, trust_env=False).json()
    names = list(v2_weights)[:3]
    table = layout(v2_weights, names)
    name = f"miles-test-{uuid.uuid4().hex[:8]}"
    segment = Path("/dev/shm") / name
    with open(segment, "w+b") as f:
        f.truncate(table.total_bytes)
    try:
        flat = torch.from_file(str(segment), shared=True, size=table.total_bytes, dtype=torch.uint8)
        packed = pack(v2_weights, table, flat)
        flat[packed.entries[1].offset] ^= 0xFF  # one byte flipped on the way
        body = {
            "serialized_named_tensors": [shm_document(name, packed.model_dump(mode="json"))],
            "load_format": "miles_shm",
        }
        refused = httpx.post(f"{url}/update_weights_from_tensor", json=body, headers=auth, trust_env=False)
        assert refused.status_code == 400 and names[1] in refused.text and "digest" in refused.text
        # SGLang's pickled form is refused by name; so is a wrong shape, a foreign segment name.
        pickled = httpx.post(
            f"{url}/update_weights_from_tensor",
            json={"serialized_named_tensors": ["AAAA"]},
            headers=auth,
            trust_env=False,
        )
        assert pickled.status_code == 400 and "pickled" in pickled.text
        bad = packed.model_dump(mode="json")
        bad["entries"][0]["shape"] = [1, *bad["entries"][0]["shape"][1:], 7]
        shaped = httpx.post(
            f"{url}/update_weights_from_tensor",
            json={"serialized_named_tensors": [shm_document(name, bad)], "load_format": "miles_shm"},
            headers=auth,
            trust_env=False,
        )
        assert shaped.status_code == 400
        foreign = httpx.post(
            f"{url}/update_weights_from_tensor",
            json={"serialized_named_tensors": [shm_document("../etc/passwd", bad)], "load_format": "miles_shm"},
            headers=auth,
            trust_env=False,
        )
        assert foreign.status_code == 400 and "miles-" in foreign.text
    finally:
        segment.unlink()
    after = httpx.get(f"{url}/get_weight_version", headers=auth, trust_env=False).json()
    assert after == before
    # Still generating on its verified weights.
    assert httpx.post(f"{url}/generate", json=GREEDY, headers=auth, trust_env=False).status_code == 200


def test_a_group_whose_sender_never_comes_fails_in_bounded_time(engine_url: tuple[str, dict[str, str]]) -> None:
    url, auth = engine_url
    body = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
        "timeout_s": 2,
    }
    started = time.monotonic()
    answer = httpx.post(f"{url}/init_weights_update_group", json=body, headers=auth, trust_env=False, timeout=60)
    assert answer.status_code == 409 and "did not form" in answer.text, answer.text
    assert time.monotonic() - started < 30
    nccl = httpx.post(
        f"{url}/init_weights_update_group", json={**body, "backend": "nccl"}, headers=auth, trust_env=False
    )
    assert nccl.status_code == 400 and "gloo" in nccl.text
    unknown = httpx.post(
        f"{url}/update_weights_from_distributed",
        json={"names": ["x"], "dtypes": ["bfloat16"], "shapes": [[1]]},
        headers=auth,
        trust_env=False,
    )
    assert unknown.status_code == 404 and "join it first" in unknown.text

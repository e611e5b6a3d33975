"""Weights pushed from the trainer's memory into real engines: shared memory and torch.distributed
(gloo), verified like a checkpoint, and every way a push can go wrong."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import miles.train.engine_calls as engine_calls
from miles.config import TransferPath
from miles.controller.results import UpdateWindow
from miles.errors import PublishError
from miles.rollout.engine_process import free_port
from miles.rollout.state import ServerState
from miles.testing import bucket_segment, running_controller, running_engine, wait_until
from miles.train.distributed_push import GROUP_NAME
from miles.train.push import PushPublisher
from miles.weights.buckets import BucketTable, layout, pack
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import checksum_module, checksum_state_dict, saved_state_dict
from miles.weights.transport.segments import Segment

pytestmark = pytest.mark.timeout(300)

GREEDY = {"text": "abcdef", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


def weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoint))


@pytest.fixture(scope="module")
def v2_weights(checkpoints: dict[str, Path]) -> dict[str, torch.Tensor]:
    return weights_of(checkpoints["v2"])


@pytest.fixture(scope="module")
def greedy_of(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The greedy text of an engine that loaded the v1 and then the v2 checkpoint from disk."""
    texts = {}
    with running_engine(checkpoints["v1"], log_dir=tmp_path_factory.mktemp("greedy")) as url:
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as http:
            texts["v1"] = str(http.post("/generate", json=GREEDY).json()["text"])
            loaded = http.post("/update_weights_from_disk", json={"model_path": str(checkpoints["v2"])})
            assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
            texts["v2"] = str(http.post("/generate", json=GREEDY).json()["text"])
    assert texts["v1"] != texts["v2"]
    return texts


@pytest.mark.parametrize("path", ["shm", "distributed"])
async def test_a_push_serves_exactly_the_published_weights(
    checkpoints: dict[str, Path], v2_weights: dict[str, torch.Tensor], greedy_of: dict[str, str], path: str
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
        # Where the push's time went: the sender's phases (packing overlaps the sending), each
        # within the push as a whole.
        phases = {"pack", "engines"} | ({"join", "broadcast"} if path == "distributed" else set())
        assert phases <= stats.timings.keys(), stats.timings
        assert all(0 < stats.timings[p] <= stats.timings["push"] for p in phases), stats.timings
        servers = ctl.health().servers
        assert all(s.state is ServerState.SERVING and s.checksum == v2.checksum for s in servers)
        assert all(s.weight_version == "7" for s in servers)
        async with httpx.AsyncClient(trust_env=False) as http:
            answers = {(await http.post(f"{url}/generate", json=GREEDY)).json()["text"] for _ in range(4)}
        # The next push reuses what the first one left (the sender's buffers and segment, the
        # engines' receive buffers) and delivers exactly its own weights.
        v1 = read_manifest(checkpoints["v1"])
        again = await publisher.push(weights_of(checkpoints["v1"]), step=8)
        assert again.checksum == v1.checksum
        servers = ctl.health().servers
        assert all(
            s.state is ServerState.SERVING and (s.checksum, s.weight_version) == (v1.checksum, "8") for s in servers
        )
        await publisher.close()
    # The same greedy text as an engine loaded from the checkpoint itself.
    assert answers == {greedy_of["v2"]}


async def test_a_push_missing_a_tensor_or_an_engine_is_rolled_back_and_serving_stays_verified(
    checkpoints: dict[str, Path], v2_weights: dict[str, torch.Tensor]
) -> None:
    v1, v2 = read_manifest(checkpoints["v1"]), read_manifest(checkpoints["v2"])
    partial = dict(list(v2_weights.items())[:-1])
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (ctl, url):
        with pytest.raises(PublishError, match="hash to"):
            await PushPublisher(ctl, path="shm", timeout_s=30).push(partial, step=7)
        servers = ctl.health().servers
        assert all(s.state is ServerState.SERVING and s.checksum == v1.checksum for s in servers), servers
        assert not ctl.health().lock.held

        class KillsAnEngine(PushPublisher):
            """Kills the window's first engine outright once the window is open, before any bucket."""

            killed: int | None = None

            def _choose(self, window: UpdateWindow) -> TransferPath:
                KillsAnEngine.killed = ctl.fleet.rollout(None).cell(window.servers[0].server_id).pid
                assert KillsAnEngine.killed is not None
                os.kill(KillsAnEngine.killed, signal.SIGKILL)
                return super()._choose(window)

        for step, path in ((8, "shm"), (9, "distributed")):
            started = time.monotonic()
            with pytest.raises(PublishError, match=r"tiny-\d at http://127\.0\.0\.1:\d+ did not answer"):
                await KillsAnEngine(ctl, path=path, timeout_s=30).push(v2_weights, step=step)
            # A group that cannot form fails when its engine is found gone, not after timeout_s,
            # and the thread that was forming it ends too (a process exiting while it waited on
            # would abort in c10d).
            assert time.monotonic() - started < 15, path
            await wait_until(
                lambda: not any(t.name == "miles-push-group" for t in threading.enumerate()),
                what="the group-forming thread ended",
                timeout=10,
            )
            await wait_until(
                lambda: all(
                    s.state is ServerState.SERVING and s.pid not in (None, KillsAnEngine.killed)
                    for s in ctl.health().servers
                ),
                what="the engine replaced",
            )
            servers = ctl.health().servers
            assert all(s.checksum == v1.checksum and s.weight_version == "1" for s in servers), servers
            async with httpx.AsyncClient(trust_env=False) as http:
                assert (await http.post(f"{url}/generate", json=GREEDY)).status_code == 200
        # The engine that joined the group which never formed may still wait in it: the next push
        # forms a new one all the same.
        await PushPublisher(ctl, path="distributed", timeout_s=30).push(v2_weights, step=10)
        assert all(s.checksum == v2.checksum for s in ctl.health().servers)


@pytest.fixture(scope="module")
def engine_url(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, str]]]:
    """One engine of our own with a control secret (no controller), for the tests that push into it
    by hand (each compares the engine with itself before and after)."""
    secret = "s" * 32
    log_dir = tmp_path_factory.mktemp("engine")
    with running_engine(checkpoints["v1"], log_dir=log_dir, env={"MILES_ENGINE_SECRET": secret}) as url:
        yield url, {"authorization": f"Bearer {secret}"}


def shm_document(segment: object, table: object) -> str:
    """The document of a bucket in ``segment`` (a Segment, or a reference as JSON, hostile or not)."""
    ref = segment.ref.model_dump() if isinstance(segment, Segment) else segment
    return base64.b64encode(json.dumps({"shm": ref, "table": table}).encode()).decode()


@contextlib.contextmanager
def packed_segment(
    named: dict[str, torch.Tensor], names: list[str]
) -> Iterator[tuple[Segment, torch.Tensor, BucketTable]]:
    """A segment of our own holding ``names`` packed (the segment, its bytes, the packed table);
    closed at the end."""
    segment, packed = bucket_segment(named, names)
    try:
        yield segment, segment.flat, packed
    finally:
        segment.close()


def test_a_corrupted_bucket_is_refused_before_the_weights_change(
    engine_url: tuple[str, dict[str, str]], v2_weights: dict[str, torch.Tensor]
) -> None:
    url, auth = engine_url
    before = httpx.get(f"{url}/get_weight_version", headers=auth, trust_env=False).json()
    names = list(v2_weights)[:3]
    with packed_segment(v2_weights, names) as (name, flat, packed):
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
        # A CUDA IPC handle means nothing to an engine on the CPU: refused by name, before it is opened.
        ipc = httpx.post(
            f"{url}/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [
                    base64.b64encode(
                        json.dumps(
                            {
                                "cuda_ipc": {
                                    "device": 0,
                                    "numel": packed.total_bytes,
                                    "storage_offset": 0,
                                    "storage_handle": "AAAA",
                                    "storage_size_bytes": packed.total_bytes,
                                    "storage_offset_bytes": 0,
                                    "ref_counter_handle": "AAAA",
                                    "ref_counter_offset": 0,
                                },
                                "table": packed.model_dump(mode="json"),
                            }
                        ).encode()
                    ).decode()
                ],
                "load_format": "miles_cuda_ipc",
            },
            headers=auth,
            trust_env=False,
        )
        assert ipc.status_code == 400 and "needs an engine on a GPU" in ipc.text, ipc.text
        bad = packed.model_dump(mode="json")
        bad["entries"][0]["shape"] = [1, *bad["entries"][0]["shape"][1:], 7]
        shaped = httpx.post(
            f"{url}/update_weights_from_tensor",
            json={"serialized_named_tensors": [shm_document(name, bad)], "load_format": "miles_shm"},
            headers=auth,
            trust_env=False,
        )
        assert shaped.status_code == 400
        # Shapes no tensor could have are compared as numbers, never allocated (not even on the
        # meta device, where torch overflows computing their size).
        for huge in ([2**40, 2**40], [2**63], [10**30]):
            bad["entries"][0]["shape"] = huge
            refused = httpx.post(
                f"{url}/update_weights_from_tensor",
                json={"serialized_named_tensors": [shm_document(name, bad)], "load_format": "miles_shm"},
                headers=auth,
                trust_env=False,
            )
            assert refused.status_code == 400 and "but the model holds" in refused.text, refused.text
        for foreign, says in (
            ({"pid": os.getpid(), "fd": 0, "name": "../etc/passwd"}, "miles-"),
            ({"pid": os.getpid(), "fd": 0, "name": "miles-stdin"}, "is not the shared-memory segment"),
            ({"pid": 2**31 - 1, "fd": 3, "name": "miles-nobody"}, "no shared-memory segment"),
        ):
            refused = httpx.post(
                f"{url}/update_weights_from_tensor",
                json={
                    "serialized_named_tensors": [shm_document(foreign, packed.model_dump(mode="json"))],
                    "load_format": "miles_shm",
                },
                headers=auth,
                trust_env=False,
            )
            assert refused.status_code in (400, 404) and says in refused.text, refused.text
    after = httpx.get(f"{url}/get_weight_version", headers=auth, trust_env=False).json()
    assert after == before
    # Still generating on its verified weights.
    assert httpx.post(f"{url}/generate", json=GREEDY, headers=auth, trust_env=False).status_code == 200


def test_a_bucket_document_takes_its_own_types_and_every_digest(
    engine_url: tuple[str, dict[str, str]], v2_weights: dict[str, torch.Tensor]
) -> None:
    """What hostile pushes sent and got 200 for: numbers as text, floats or booleans, an unknown
    key, tensors without digests, an empty table, a segment name with a newline."""
    url, auth = engine_url
    before = httpx.get(f"{url}/get_weight_version", headers=auth, trust_env=False).json()
    with packed_segment(v2_weights, list(v2_weights)[:2]) as (name, _, packed):
        good = packed.model_dump(mode="json")
        first = good["entries"][0]

        def with_first(**changes: object) -> dict:
            return {"entries": [{**first, **changes}, *good["entries"][1:]]}

        shape = first["shape"]
        cases = [
            (with_first(shape=[str(n) for n in shape]), "shape"),
            (with_first(shape=[float(n) for n in shape]), "shape"),
            (with_first(shape=[True, *shape[1:]]), "shape"),
            (with_first(offset="0"), "offset"),
            (with_first(offset=False), "offset"),
            (with_first(offset=0.0), "offset"),
            (with_first(digest=None), "has no digest"),
            ({"entries": []}, "holds no tensors"),
        ]
        for bad, says in cases:
            refused = httpx.post(
                f"{url}/update_weights_from_tensor",
                json={"serialized_named_tensors": [shm_document(name, bad)], "load_format": "miles_shm"},
                headers=auth,
                trust_env=False,
            )
            assert refused.status_code == 400 and says in refused.text, (bad, refused.text)
        # A shape of a hundred thousand dimensions is named, not echoed.
        refused = httpx.post(
            f"{url}/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [shm_document(name, with_first(shape=[1] * 100_000))],
                "load_format": "miles_shm",
            },
            headers=auth,
            trust_env=False,
        )
        assert refused.status_code == 400 and len(refused.content) < 4096, refused.text[:300]
        ref = name.ref.model_dump()
        extra = base64.b64encode(json.dumps({"shm": ref, "table": good, "x": 1}).encode()).decode()
        newline = shm_document({**ref, "name": ref["name"] + "\n"}, good)
        for document, says in ((extra, "x"), (newline, "miles-")):
            refused = httpx.post(
                f"{url}/update_weights_from_tensor",
                json={"serialized_named_tensors": [document], "load_format": "miles_shm"},
                headers=auth,
                trust_env=False,
            )
            assert refused.status_code == 400 and says in refused.text, refused.text
    assert httpx.get(f"{url}/get_weight_version", headers=auth, trust_env=False).json() == before


def test_a_corrupted_bucket_drops_the_whole_push(
    engine_url: tuple[str, dict[str, str]], v2_weights: dict[str, torch.Tensor], checkpoints: dict[str, Path]
) -> None:
    """Digests are checked over the bytes staged: a bad bucket leaves nothing of its push behind, so
    the buckets before it must be pushed again."""
    url, auth = engine_url
    before = httpx.get(f"{url}/get_weight_version", headers=auth, trust_env=False).json()
    names = list(v2_weights)
    head, middle, tail = names[:2], names[2:4], names[4:]
    whole = layout(v2_weights, names)
    segment = Segment(whole.total_bytes)

    def push(part: list[str], *, corrupt: bool = False, last: bool = False) -> httpx.Response:
        packed = pack(v2_weights, layout(v2_weights, part), segment.flat)
        if corrupt:
            segment.flat[packed.entries[0].offset] ^= 0xFF
        body = {
            "serialized_named_tensors": [shm_document(segment, packed.model_dump(mode="json"))],
            "load_format": "miles_shm",
            "weight_version": "7" if last else None,
            "expected_checksum": read_manifest(checkpoints["v2"]).checksum if last else None,
        }
        return httpx.post(f"{url}/update_weights_from_tensor", json=body, headers=auth, trust_env=False, timeout=60)

    try:
        assert push(head).status_code == 200
        refused = push(middle, corrupt=True)
        assert refused.status_code == 400 and middle[0] in refused.text and "digest" in refused.text
        # The head bucket went with the bad one: finishing the push without it does not verify.
        unfinished = push(middle + tail, last=True)
        assert unfinished.status_code == 400 and "hash to" in unfinished.text
        assert httpx.get(f"{url}/get_weight_version", headers=auth, trust_env=False).json() == before
        # Pushed again whole, it serves.
        assert push(head).status_code == 200
        done = push(middle + tail, last=True)
        assert done.status_code == 200, done.text
        assert done.json()["weight_version"] == "7"
    finally:
        segment.close()


def test_a_segment_written_while_the_engine_reads_it_fails_the_push_not_the_engine(
    engine_url: tuple[str, dict[str, str]], v2_weights: dict[str, torch.Tensor], checkpoints: dict[str, Path]
) -> None:
    """A sender cannot cut its segment short under an engine (sealed: a mapped segment cut short
    would kill its reader), and one that offers a memory file it could cut is refused by name; a
    sender that rewrites its bytes while the engine reads them gets each push staged or refused
    with 400 naming the digest, and the engine lives on, on its weights."""
    url, auth = engine_url
    before = httpx.post(f"{url}/generate", json=GREEDY, headers=auth, trust_env=False).json()["text"]
    names = list(v2_weights)
    segment, table = bucket_segment(v2_weights, names)
    with pytest.raises(PermissionError):
        os.ftruncate(segment.ref.fd, table.total_bytes // 3)
    unsealed = os.memfd_create("miles-unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, table.total_bytes)
    body = {
        "serialized_named_tensors": [shm_document(segment, table.model_dump(mode="json"))],
        "load_format": "miles_shm",
    }
    cuttable = {
        **body,
        "serialized_named_tensors": [
            shm_document({"pid": os.getpid(), "fd": unsealed, "name": "miles-unsealed"}, table.model_dump(mode="json"))
        ],
    }
    refused = httpx.post(f"{url}/update_weights_from_tensor", json=cuttable, headers=auth, trust_env=False)
    os.close(unsealed)
    assert refused.status_code == 400 and "not sealed against shrinking" in refused.text, refused.text
    whole = segment.flat.clone()
    stop = threading.Event()

    def scramble_and_write_again() -> None:
        while not stop.is_set():
            segment.flat[: table.total_bytes // 3].fill_(7)
            segment.flat.copy_(whole)

    writer = threading.Thread(target=scramble_and_write_again, daemon=True)
    writer.start()
    statuses: dict[int, int] = {}
    try:
        for _ in range(30):
            answer = httpx.post(
                f"{url}/update_weights_from_tensor", json=body, headers=auth, trust_env=False, timeout=60
            )
            statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
            assert answer.status_code in (200, 400), answer.text
            if answer.status_code == 400:
                assert "digest" in answer.text, answer.text
    finally:
        stop.set()
        writer.join(timeout=10)
        segment.close()
    # Alive, and serving the weights it had: the staged pushes never carried a checksum to activate.
    assert httpx.post(f"{url}/generate", json=GREEDY, headers=auth, trust_env=False).json()["text"] == before
    back = httpx.post(
        f"{url}/update_weights_from_disk",
        json={"model_path": str(checkpoints["v1"])},
        headers=auth,
        trust_env=False,
        timeout=60,
    )
    assert back.status_code == 200 and back.json()["success"], back.text


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


def test_sglang_broadcasts_one_tensor_at_a_time_by_default(
    engine_url: tuple[str, dict[str, str]],
    v2_weights: dict[str, torch.Tensor],
    checkpoints: dict[str, Path],
    greedy_of: dict[str, str],
) -> None:
    """SGLang's own sender (no load_format) broadcasts each tensor on its own, in the order named;
    the engine receives them so. A sender that stops before the last tensor fails the call within
    its timeout, and the live weights never change."""
    url, auth = engine_url
    names = sorted(v2_weights)
    v2 = read_manifest(checkpoints["v2"])
    port = free_port()
    timeout = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(GROUP_NAME, store)
    prefixed.set("joined/0", "1")
    join = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": GROUP_NAME,
        "backend": "gloo",
        "timeout_s": 30,
    }
    bucket = {
        "names": names,
        "dtypes": [str(v2_weights[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(v2_weights[n].shape) for n in names],
        "group_name": GROUP_NAME,
    }

    def post(path: str, body: dict[str, object]) -> httpx.Response:
        return httpx.post(f"{url}{path}", json=body, headers=auth, trust_env=False, timeout=120)

    before = post("/generate", GREEDY).json()["text"]
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(post, "/init_weights_update_group", join)
        group = dist.ProcessGroupGloo(prefixed, 0, 2, timeout)
        assert joining.result().status_code == 200, joining.result().text
        try:
            # Stopping one tensor short: refused once its timeout runs out, nothing changed.
            started = time.monotonic()
            short = pool.submit(post, "/update_weights_from_distributed", {**bucket, "timeout_s": 2})
            for name in names[:-1]:
                group.broadcast(v2_weights[name].contiguous(), 0).wait()
            assert short.result().status_code == 409 and "did not complete" in short.result().text
            assert time.monotonic() - started < 30
            assert post("/generate", GREEDY).json()["text"] == before
        finally:
            assert post("/destroy_weights_update_group", {"group_name": GROUP_NAME}).status_code == 200
            # This side of the group goes now, not at the interpreter's exit.
            del group, prefixed, store
            gc.collect()

        # In a group of its own, every tensor sent: the engine serves exactly them.
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(GROUP_NAME, store)
        prefixed.set("joined/0", "1")
        joining = pool.submit(post, "/init_weights_update_group", {**join, "master_port": port})
        group = dist.ProcessGroupGloo(prefixed, 0, 2, timeout)
        assert joining.result().status_code == 200, joining.result().text
        try:
            body = {**bucket, "weight_version": "7", "expected_checksum": v2.checksum}
            answer = pool.submit(post, "/update_weights_from_distributed", body)
            for name in names:
                group.broadcast(v2_weights[name].contiguous(), 0).wait()
            assert answer.result().status_code == 200, answer.result().text
            assert answer.result().json()["weight_version"] == "7"
            assert post("/generate", GREEDY).json()["text"] == greedy_of["v2"]
        finally:
            assert post("/destroy_weights_update_group", {"group_name": GROUP_NAME}).status_code == 200
            del group, prefixed, store
            gc.collect()
    # Back to what the other tests of this engine start from.
    back = post("/update_weights_from_disk", {"model_path": str(checkpoints["v1"])})
    assert back.status_code == 200 and back.json()["success"], back.text


async def test_a_delta_push_sends_only_what_changed_and_falls_back_when_servers_differ(
    checkpoints: dict[str, Path], v2_weights: dict[str, torch.Tensor]
) -> None:
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (ctl, _):
        publisher = PushPublisher(ctl, path="shm", bucket_bytes=64 * 1024, timeout_s=30)
        await publisher.push(v2_weights, step=7)
        changed = dict(v2_weights)
        name = next(n for n, t in changed.items() if t.dtype.is_floating_point and t.numel() > 16)
        changed[name] = changed[name] + 0.5
        result = await publisher.push(changed, step=8)
        stats = publisher.last
        assert stats is not None and (stats.tensors, stats.skipped) == (1, len(changed) - 1)
        assert result.checksum == checksum_state_dict(changed).checksum
        assert all(s.checksum == result.checksum and s.weight_version == "8" for s in ctl.health().servers)
        # The servers move to other weights behind the publisher's back: its delta would be wrong,
        # the engines' checksum says so, and it pushes in full.
        moved = await ctl.update_rollout_weights(checkpoints["v3"], weight_version="9")
        assert moved.ok, moved.message
        again = await publisher.push(changed, step=10)
        assert publisher.last is not None and publisher.last.skipped == 0
        assert all(s.checksum == again.checksum and s.weight_version == "10" for s in ctl.health().servers)


async def test_a_published_model_is_read_from_shared_memory_where_it_lies(
    checkpoints: dict[str, Path], greedy_of: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = AutoModelForCausalLM.from_pretrained(checkpoints["v2"])
    v2 = read_manifest(checkpoints["v2"])
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (ctl, url):
        publisher = PushPublisher(ctl, path="shm", bucket_bytes=64 * 1024, timeout_s=30)
        result = await publisher.publish(model, None, step=7)
        assert result.checksum == v2.checksum
        # The model's weights moved into the publisher's segment, and the engines read them there:
        # nothing was copied on the trainer's side.
        shared = publisher.shared_segment
        assert shared is not None
        assert all(shared.offset_of(t) is not None for t in saved_state_dict(model).values())
        stats = publisher.last
        assert stats is not None and stats.buckets > 1 and stats.in_place == stats.bytes > 0
        async with httpx.AsyncClient(trust_env=False) as http:
            answers = {(await http.post(f"{url}/generate", json=GREEDY)).json()["text"] for _ in range(3)}
        assert answers == {greedy_of["v2"]}

        # Training changes some weights in place; the next publish sends those, from where they lie.
        changed = [p for p in model.parameters() if p.dim() == 2][:3]
        with torch.no_grad():
            for parameter in changed:
                parameter.add_(0.25)
        trained = checksum_module(model).checksum
        result = await publisher.publish(model, None, step=8)
        stats = publisher.last
        assert result.checksum == trained and stats is not None and stats.tensors == len(changed)
        assert stats.in_place == stats.bytes
        assert all((s.checksum, s.weight_version) == (trained, "8") for s in ctl.health().servers)

        # The trainer writes its weights while a push reads them: the engines find bytes that do not
        # match their digests, the push is refused and the servers stay on the verified step 8.
        post_all = engine_calls.post_all

        async def training_meanwhile(*args: object, **kwargs: object) -> None:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(1.5)
            await post_all(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(engine_calls, "post_all", training_meanwhile)
        with pytest.raises(PublishError, match="digest"):
            await publisher.publish(model, None, step=9)
        monkeypatch.setattr(engine_calls, "post_all", post_all)
        servers = ctl.health().servers
        assert all(s.state is ServerState.SERVING and (s.checksum, s.weight_version) == (trained, "8") for s in servers)
        # Once the model holds still, it publishes.
        result = await publisher.publish(model, None, step=10)
        assert result.checksum == checksum_module(model).checksum
        assert all(s.checksum == result.checksum for s in ctl.health().servers)
        await publisher.close()
    # The publisher let go of the segment (its descriptor is closed); the model keeps its memory.
    assert not await asyncio.to_thread(os.path.exists, shared.ref.path)
    assert checksum_module(model).checksum == result.checksum


TRAINER = """
import asyncio, os, sys
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
import miles.train.engine_calls as engine_calls
import miles.train.push as push
from miles.weights.checksum import checksum_module, checksum_state_dict, saved_state_dict
from miles.weights.transport.segments import Segment

url, checkpoint, die = sys.argv[1], sys.argv[2], sys.argv[3] == "die"
named = saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoint))
if die:  # the trainer is killed after its first bucket reached the engines
    post_all = engine_calls.post_all
    async def dying(*args, **kwargs):
        await post_all(*args, **kwargs)
        os._exit(9)
    engine_calls.post_all = dying
result = asyncio.run(push.PushPublisher(url, bucket_bytes=64 * 1024, ttl_s=3, timeout_s=30).push(named, step=7))
print(result.path, result.checksum)
"""


@pytest.mark.parametrize("die", [False, True], ids=["commits", "dies-mid-push"])
async def test_a_trainer_process_pushes_over_http_or_dies_and_serving_stays_verified(
    checkpoints: dict[str, Path], tmp_path: Path, die: bool
) -> None:
    token = "t" * 32
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    v1, v2 = read_manifest(checkpoints["v1"]), read_manifest(checkpoints["v2"])
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2, admin_token=token) as (ctl, url):
        env = {**os.environ, "MILES_ADMIN_TOKEN": token}
        trainer = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            str(url),
            str(checkpoints["v2"]),
            "die" if die else "live",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        out, err = await asyncio.wait_for(trainer.communicate(), timeout=180)
        if not die:
            assert trainer.returncode == 0, err.decode()[-2000:]
            assert out.decode().split() == ["shm", v2.checksum]
            expected = v2
        else:
            assert trainer.returncode == 9
            # Its window's lease runs out: the servers go back to their verified weights.
            await wait_until(lambda: not ctl.health().lock.held, what="the dead trainer's window to expire")
            await wait_until(
                lambda: all(s.state is ServerState.SERVING for s in ctl.health().servers), what="serving again"
            )
            expected = v1
        servers = ctl.health().servers
        assert all(s.checksum == expected.checksum for s in servers), servers
        async with httpx.AsyncClient(trust_env=False) as http:
            assert (await http.post(f"{url}/generate", json=GREEDY)).status_code == 200
        if die:
            # The next push commits.
            retry = await PushPublisher(ctl, path="shm").push(weights_of(checkpoints["v2"]), step=8)
            assert retry.checksum == v2.checksum
        # No engine holds on to what the trainer left once it is gone (the engines look every second).
        deadline = time.monotonic() + 10
        for server in servers:
            assert server.pid is not None
            while f"memfd:miles-{trainer.pid}-" in await asyncio.to_thread(Path(f"/proc/{server.pid}/maps").read_text):
                assert time.monotonic() < deadline, server.server_id
                await asyncio.sleep(0.1)


@pytest.mark.parametrize("path", ["shm", "distributed"])
async def test_no_request_sees_mixed_weights_during_a_push(
    checkpoints: dict[str, Path], v2_weights: dict[str, torch.Tensor], greedy_of: dict[str, str], path: str
) -> None:
    versions = {greedy_of["v1"]: "1", greedy_of["v2"]: "7"}
    seen: list[tuple[str, str]] = []
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (ctl, url):
        stop = asyncio.Event()

        async def client() -> None:
            async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
                while not stop.is_set():
                    answer = (await http.post(f"{url}/generate", json=GREEDY)).json()
                    seen.append((answer["text"], answer["meta_info"]["weight_version"]))

        clients = [asyncio.create_task(client()) for _ in range(3)]
        try:
            await wait_until(lambda: len(seen) >= 3, what="traffic before the push")
            await PushPublisher(ctl, path=path, bucket_bytes=32 * 1024, timeout_s=30).push(v2_weights, step=7)
            count = len(seen)
            await wait_until(lambda: len(seen) >= count + 3, what="traffic after the push")
        finally:
            stop.set()
            await asyncio.gather(*clients)
    # Every answer is one version's greedy output, labelled with that version.
    assert {(text, versions.get(text)) for text, _ in seen} == {(t, v) for t, v in seen}, seen
    assert {v for _, v in seen} == {"1", "7"}


async def test_a_staged_push_keeps_serving_until_the_commit_swaps_the_weights_in(
    checkpoints: dict[str, Path], v2_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    during: list[tuple[int, str]] = []
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2) as (ctl, url):
        post_all = engine_calls.post_all

        async def and_generate(*args: object, **kwargs: object) -> None:
            await post_all(*args, **kwargs)  # type: ignore[arg-type]
            # Between two buckets of the push, the window is open: requests are still served.
            async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
                answer = await http.post(f"{url}/generate", json=GREEDY)
            during.append((answer.status_code, answer.json()["meta_info"]["weight_version"]))

        monkeypatch.setattr(engine_calls, "post_all", and_generate)
        result = await PushPublisher(ctl, path="shm", bucket_bytes=64 * 1024).push(v2_weights, step=7)
        assert len(during) > 1 and set(during) == {(200, "1")}, during
        assert all(s.checksum == result.checksum and s.weight_version == "7" for s in ctl.health().servers)
        # The commit's swap, not the transfer, is what each server was out of routing for.
        last = ctl.last_update
        outcomes = last.servers if last else ()
        assert outcomes and all("activate" in o.load_timings for o in outcomes)
        # One call per engine: it paused itself for the swap and resumed (the controller sent no
        # pause and no continue), and the window ended there.
        assert last is not None and "pause" not in last.timings, last.timings
        assert all("pause" in o.load_timings for o in outcomes)


async def test_engines_that_cannot_stage_get_the_push_with_their_servers_out_of_routing(
    checkpoints: dict[str, Path], v2_weights: dict[str, torch.Tensor]
) -> None:
    v2 = read_manifest(checkpoints["v2"])
    async with running_controller(
        {"tiny": {"checkpoint": checkpoints["v1"], "num_servers": 2, "engine_args": ("--weight-staging", "off")}}
    ) as (ctl, _):
        result = await PushPublisher(ctl, path="shm").push(v2_weights, step=7)
        assert result.checksum == v2.checksum
        assert all(s.checksum == v2.checksum and s.state is ServerState.SERVING for s in ctl.health().servers)


def test_the_readme_push_through_the_blocking_controller(checkpoints: dict[str, Path]) -> None:
    from miles.inference_controller import InferenceController

    model = AutoModelForCausalLM.from_pretrained(checkpoints["v2"])
    controller = InferenceController(model_checkpoint=checkpoints["v1"], port=0, health_interval_s=0.5)
    try:
        publisher = PushPublisher(controller)
        result = asyncio.run(publisher.publish(model, None, step=42))  # type: ignore[arg-type]
        assert result.checksum == read_manifest(checkpoints["v2"]).checksum
        assert controller.health().models["tiny"].weight_version == "42"
    finally:
        controller.close()

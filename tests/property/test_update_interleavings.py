"""Random interleavings of updates, windows, expired leases and failing servers, against real
engines, while clients generate (hypothesis). After every sequence the protocol's invariants hold:

- the serving version of the model never goes back, and committed versions strictly increase;
- a server serves only verified weights (what its engine reports equals what was verified);
- no request sees a mix of versions, and every answer is exactly what its version's weights give;
- a stale window credential (its window ended, was aborted or expired) never changes a server.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles.controller.results import UpdateStatus
from miles.inference_controller import InferenceController
from miles.protocol.sglang_weights import UpdateWeightsResponse
from miles.rollout.sft_rollout import SFTRollout
from miles.testing import wait_until
from miles.utils.audit_utils.event_analyzer import analyze_events
from miles.utils.audit_utils.event_logger.models import ChecksumMismatchEvent, WeightUpdateCommittedEvent
from miles.weights.checkpoint import read_manifest

WEIGHTS = ("v2", "v3", "v4")
PROMPTS = ([7, 8, 9], [20, 21])


def greedy(prompt: list[int]) -> dict[str, Any]:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


class FlakyRollout(SFTRollout):
    """Fault at the edge: while ``misload`` names a checkpoint, the last server loads the other
    weights it maps to (valid, just not the ones published), as a buggy transfer would."""

    misload: ClassVar[dict[Path, Path]] = {}

    async def load(self, server_id: str, checkpoint: Path, **kwargs: Any) -> UpdateWeightsResponse:
        swapped = self.misload.get(checkpoint)
        if server_id == self.server_ids[-1] and swapped is not None:
            kwargs["expected_checksum"] = read_manifest(swapped).checksum
            checkpoint = swapped
        return await super().load(server_id, checkpoint, **kwargs)


@dataclass
class World:
    controller: InferenceController
    checkpoints: dict[str, Path]
    reference: dict[str, list[list[int]]]
    weights_of: dict[str, str] = field(default_factory=dict)
    versions: Iterator[int] = field(default_factory=lambda: itertools.count(100))


@pytest.fixture(scope="module")
def world(checkpoints: dict[str, Path]) -> Iterator[World]:
    with InferenceController(FlakyRollout, checkpoints["v1"], port=0, num_servers=2, health_interval_s=0.2) as ctl:
        world = World(controller=ctl, checkpoints=checkpoints, reference={})
        for name in WEIGHTS:
            version = str(next(world.versions))
            result = ctl.update_rollout_weights(checkpoints[name], weight_version=version)
            assert result.ok, result.message
            world.weights_of[version] = name
            world.reference[name] = [ctl.run(_generate(ctl.url or "", p))["output_ids"] for p in PROMPTS]
        yield world


async def _generate(url: str, prompt: list[int]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
        return (await http.post("/generate", json=greedy(prompt))).json()


Op = tuple[str, ...]
OPS = st.one_of(
    st.tuples(st.just("update"), st.sampled_from(WEIGHTS), st.sampled_from(["barrier", "rolling"])),
    st.tuples(st.just("stale_update"), st.sampled_from(WEIGHTS)),
    st.tuples(st.just("racing_updates"), st.sampled_from(WEIGHTS), st.sampled_from(WEIGHTS)),
    st.tuples(st.just("window_commit"), st.sampled_from(WEIGHTS)),
    st.tuples(st.just("window_abort"), st.sampled_from(WEIGHTS)),
    st.tuples(st.just("window_expires"), st.sampled_from(WEIGHTS)),
    st.tuples(st.just("misloaded_update"), st.sampled_from(WEIGHTS)),
)


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS, min_size=2, max_size=6))
def test_invariants_hold_under_any_interleaving(world: World, ops: list[Op]) -> None:
    world.controller.run(_play(world, ops), timeout=300)


async def _play(world: World, ops: list[Op]) -> None:
    ctl = world.controller
    url = ctl.url or ""
    mark = len(ctl.event_logger.events)
    serving_seen: list[int] = [_serving(ctl)]
    answers: list[tuple[int, int, dict[str, Any]]] = []
    stop = asyncio.Event()

    async def client(worker: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
            for i in itertools.count(worker):
                if stop.is_set():
                    return
                index = i % len(PROMPTS)
                answer = await http.post("/generate", json=greedy(PROMPTS[index]))
                answers.append((index, answer.status_code, answer.json()))

    clients = [asyncio.create_task(client(w)) for w in range(2)]
    try:
        for op in ops:
            await _apply(world, op)
            serving_seen.append(_serving(ctl))
            # Let traffic through between operations.
            wanted = len(answers) + 2
            await wait_until(lambda w=wanted: len(answers) >= w, what="traffic between operations", interval=0.005)
    finally:
        stop.set()
        await asyncio.gather(*clients)

    # The serving version never went back, and committed versions strictly increased.
    assert serving_seen == sorted(serving_seen), serving_seen
    commits = [
        int(e.weight_version) for e in list(ctl.event_logger.events)[mark:] if isinstance(e, WeightUpdateCommittedEvent)
    ]
    assert commits == sorted(set(commits)), commits
    # Every server serves verified weights, and its engine says so too.
    async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
        for snap in ctl.core.fleet.snapshots("tiny"):
            assert snap.state.value == "serving", snap
            assert snap.verified is not None and snap.checksum == snap.verified.checksum
            identity = (await http.get(f"{snap.url}/get_weight_version")).json()
            assert (identity["weight_version"], identity["checksum"]) == (
                snap.verified.weight_version,
                snap.verified.checksum,
            )
    # No answer failed, mixed versions, or differs from its version's weights.
    for index, status, answer in answers:
        assert status == 200, answer
        meta = answer["meta_info"]
        assert meta["weight_version_start"] == meta["weight_version_end"], meta
        assert answer["output_ids"] == world.reference[world.weights_of[meta["weight_version"]]][index]
    # The audit agrees: versions never went back, and the only checksum findings are the
    # misloads the controller itself caught (a mismatch event for the same server and step).
    events = list(ctl.event_logger.events)
    caught = {(e.server_id, e.step) for e in events if isinstance(e, ChecksumMismatchEvent)}
    for finding in analyze_events(events).findings:
        assert finding.rule == "checksum_consistency", finding
        assert (finding.server_id, finding.step) in caught, finding


async def _apply(world: World, op: Op) -> None:
    ctl, kind = world.controller.core, op[0]
    if kind == "update":
        await _update(world, op[1], strategy=op[2])
    elif kind == "stale_update":
        # An older version than the fleet serves is refused, never committed on top of it.
        result = await ctl.update_rollout_weights(world.checkpoints[op[1]], weight_version="1")
        assert result.status is UpdateStatus.REJECTED and "not newer" in result.message
    elif kind == "racing_updates":
        await asyncio.gather(_update(world, op[1]), _update(world, op[2]))
    elif kind in ("window_commit", "window_abort", "window_expires"):
        await _window(world, op[1], ending=kind.removeprefix("window_"))
    elif kind == "misloaded_update":
        target = world.checkpoints[op[1]]
        other = world.checkpoints[next(w for w in WEIGHTS if w != op[1])]
        FlakyRollout.misload = {target.resolve(): other.resolve()}
        try:
            result = await ctl.update_rollout_weights(target, weight_version=str(next(world.versions)))
        finally:
            FlakyRollout.misload = {}
        assert result.status is UpdateStatus.ROLLED_BACK, result.message


async def _update(world: World, name: str, *, strategy: str = "barrier") -> None:
    version = str(next(world.versions))
    world.weights_of[version] = name
    result = await world.controller.core.update_rollout_weights(
        world.checkpoints[name], weight_version=version, strategy=strategy
    )
    # Racing updates may find a newer one already committed: refused as not newer, nothing else.
    assert result.status is UpdateStatus.COMMITTED or (
        result.status is UpdateStatus.REJECTED and "not newer" in result.message
    ), result.message


async def _window(world: World, name: str, *, ending: str) -> None:
    ctl = world.controller.core
    window = await ctl.start_update_weights(ttl_s=1.0 if ending == "expires" else 30)
    version = str(next(world.versions))
    world.weights_of[version] = name
    auth = {"authorization": f"Bearer {window.credential}"}
    load = {"model_path": str(world.checkpoints[name]), "weight_version": version}
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        for server in window.servers:
            pushed = await http.post(f"{server.url}/update_weights_from_disk", json=load, headers=auth)
            assert pushed.json()["success"], pushed.text
        if ending == "commit":
            checksum = read_manifest(world.checkpoints[name]).checksum
            result = await ctl.end_update_weights(window, checksum=checksum, step=int(version))
            assert result.status is UpdateStatus.COMMITTED, result.message
        elif ending == "abort":
            result = await ctl.abort_update_weights(window)
            assert result.status is UpdateStatus.ABORTED
        else:
            # The lease runs out; the window rolls itself back.
            await wait_until(lambda: not ctl.health().lock.held, what="the lease to run out")
        # Whatever ended the window, its credential is stale now: it changes no server.
        other = next(w for w in WEIGHTS if w != name)
        late = {"model_path": str(world.checkpoints[other]), "weight_version": "999999"}
        for server in window.servers:
            refused = await http.post(f"{server.url}/update_weights_from_disk", json=late, headers=auth)
            assert refused.status_code in (403, 409), refused.text


def _serving(ctl: InferenceController) -> int:
    versions = [s.weight_version for s in ctl.core.fleet.snapshots("tiny") if s.state.value == "serving"]
    return max((int(v) for v in versions if v and v.isdigit()), default=0)

"""The protocol's seven steps happen in order, and every failure path leaves verified weights.

A real controller over two embedded engines. The mismatch case uses a scriptable fake at the edge:
a Rollout that, for one server, loads other (valid) weights than it was asked to, the way a
buggy transfer would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import pytest_asyncio

from miles.controller.results import UpdateStatus
from miles.errors import ConflictError
from miles.protocol.sglang_weights import UpdateWeightsResponse
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.rollout.sft_rollout import SFTRollout
from miles.rollout.state import ServerState
from miles.testing import copy_checkpoint, running_controller
from miles.utils.audit_utils.event_analyzer import analyze_events
from miles.utils.audit_utils.event_logger.models import (
    ChecksumMismatchEvent,
    ChecksumRole,
    InferenceEngineWeightChecksumEvent,
    LockAcquiredEvent,
    LockReleasedEvent,
    ServerStateChangedEvent,
    WeightUpdateAbortedEvent,
    WeightUpdateCommittedEvent,
    WeightUpdateStartedEvent,
)
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.asyncio(loop_scope="module")


class MisloadingRollout(SFTRollout):
    """Fault at the edge: when asked to load a checkpoint listed in ``swap``, the last server loads
    the mapped one instead (valid weights, just not the ones training published)."""

    swap: ClassVar[dict[Path, Path]] = {}

    async def load(self, server_id: str, checkpoint: Path, **kwargs: Any) -> UpdateWeightsResponse:
        if server_id == self.server_ids[-1] and checkpoint in self.swap:
            # A buggy transfer does not know what it should have loaded: nothing checks the
            # bytes against the expected checksum until the confirmation step.
            checkpoint = self.swap[checkpoint]
            kwargs["expected_checksum"] = read_manifest(checkpoint).checksum
        return await super().load(server_id, checkpoint, **kwargs)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def controller(checkpoints: dict[str, Path]) -> AsyncIterator[AsyncInferenceController]:
    async with running_controller(MisloadingRollout, checkpoints["v1"], num_servers=2, http=False) as (ctl, _):
        yield ctl


def events_since(controller: AsyncInferenceController, mark: int) -> list:
    return list(controller.event_logger.events)[mark:]


def all_serving_verified(controller: AsyncInferenceController, version: str, checksum: str) -> None:
    for snap in controller.fleet.rollout(None).snapshot():
        assert snap.state is ServerState.SERVING, snap
        assert snap.weight_version == version
        assert snap.checksum == checksum
        assert snap.verified is not None and snap.verified.checksum == checksum
    assert controller.health().lock.held is False


async def test_the_seven_steps_happen_in_order(
    controller: AsyncInferenceController, checkpoints: dict[str, Path]
) -> None:
    manifest = read_manifest(checkpoints["v2"])
    mark = len(controller.event_logger.events)
    # Step 1-2: training wrote the checkpoint and publishes its checksum.
    controller.event_logger.log(
        InferenceEngineWeightChecksumEvent,
        {"model_name": "tiny", "checksum": manifest.checksum, "step": manifest.step},
        print_log=False,
    )
    result = await controller.update_rollout_weights(checkpoints["v2"])
    assert result.status is UpdateStatus.COMMITTED, result.message
    assert result.checksum_source.value == "published"
    events = events_since(controller, mark)

    def first(predicate) -> int:
        return next(i for i, e in enumerate(events) if predicate(e))

    def last(predicate) -> int:
        return max(i for i, e in enumerate(events) if predicate(e))

    published = first(lambda e: isinstance(e, InferenceEngineWeightChecksumEvent) and e.role is ChecksumRole.PUBLISHED)
    locked = first(lambda e: isinstance(e, LockAcquiredEvent))
    started = first(lambda e: isinstance(e, WeightUpdateStartedEvent))
    paused = [i for i, e in enumerate(events) if isinstance(e, ServerStateChangedEvent) and e.to_state == "updating"]
    confirmed = [
        i
        for i, e in enumerate(events)
        if isinstance(e, InferenceEngineWeightChecksumEvent) and e.role is ChecksumRole.CONFIRMED
    ]
    admitted = [
        i
        for i, e in enumerate(events)
        if isinstance(e, ServerStateChangedEvent) and e.from_state == "updating" and e.to_state == "serving"
    ]
    committed = first(lambda e: isinstance(e, WeightUpdateCommittedEvent))
    released = last(lambda e: isinstance(e, LockReleasedEvent))
    assert len(paused) == len(confirmed) == len(admitted) == 2
    assert published < locked < started < min(paused)
    assert max(paused) < min(confirmed)
    assert max(confirmed) < min(admitted)
    assert max(admitted) < committed < released
    for index in confirmed:
        assert events[index].checksum == manifest.checksum
    all_serving_verified(controller, "2", manifest.checksum)
    assert analyze_events(controller.event_logger.events).passed


async def test_a_malformed_checkpoint_is_rejected_before_any_server_is_touched(
    controller: AsyncInferenceController, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    truncated = copy_checkpoint(checkpoints["v3"], tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    mark = len(controller.event_logger.events)
    result = await controller.update_rollout_weights(truncated)
    assert result.status is UpdateStatus.REJECTED
    assert "truncated_file" in result.message
    assert not any(isinstance(e, ServerStateChangedEvent) for e in events_since(controller, mark))
    assert any(isinstance(e, WeightUpdateAbortedEvent) for e in events_since(controller, mark))
    all_serving_verified(controller, "2", read_manifest(checkpoints["v2"]).checksum)


async def test_corrupt_bytes_are_refused_by_every_server_and_change_nothing(
    controller: AsyncInferenceController, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    corrupt = copy_checkpoint(checkpoints["v3"], tmp_path / "corrupt")
    weights = corrupt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0x40
    weights.write_bytes(bytes(data))
    mark = len(controller.event_logger.events)
    result = await controller.update_rollout_weights(corrupt)
    assert result.status is UpdateStatus.REJECTED
    assert "digest_mismatch" in result.message
    assert all(not o.loaded for o in result.servers)
    events = events_since(controller, mark)
    assert not any(isinstance(e, ChecksumMismatchEvent) for e in events)
    assert not any(
        isinstance(e, InferenceEngineWeightChecksumEvent) and e.role is ChecksumRole.CONFIRMED for e in events
    )
    all_serving_verified(controller, "2", read_manifest(checkpoints["v2"]).checksum)


async def test_an_older_version_is_refused(controller: AsyncInferenceController, checkpoints: dict[str, Path]) -> None:
    result = await controller.update_rollout_weights(checkpoints["v1"])
    assert result.status is UpdateStatus.REJECTED
    assert "not newer" in result.message
    result = await controller.update_rollout_weights(checkpoints["v1"], weight_version="2")
    assert result.status is UpdateStatus.REJECTED


async def test_a_checksum_mismatch_is_caught_quarantined_rolled_back_and_reported(
    controller: AsyncInferenceController, checkpoints: dict[str, Path]
) -> None:
    v2 = read_manifest(checkpoints["v2"])
    v3 = read_manifest(checkpoints["v3"])
    controller.event_logger.log(
        InferenceEngineWeightChecksumEvent,
        {"model_name": "tiny", "checksum": v3.checksum, "step": v3.step},
        print_log=False,
    )
    MisloadingRollout.swap = {checkpoints["v3"].resolve(): checkpoints["v4"].resolve()}
    mark = len(controller.event_logger.events)
    try:
        result = await controller.update_rollout_weights(checkpoints["v3"])
    finally:
        MisloadingRollout.swap = {}
    assert result.status is UpdateStatus.ROLLED_BACK
    bad = result.servers[-1]
    assert bad.matched is False
    assert bad.confirmed_checksum == read_manifest(checkpoints["v4"]).checksum
    assert "checksum mismatch" in (bad.error or "")
    assert result.versions == {"tiny-0": "2", "tiny-1": "2"}
    events = events_since(controller, mark)
    mismatches = [e for e in events if isinstance(e, ChecksumMismatchEvent)]
    assert [m.server_id for m in mismatches] == ["tiny-1"]
    assert any(isinstance(e, ServerStateChangedEvent) and e.to_state == "quarantined" for e in events)
    assert any(isinstance(e, WeightUpdateAbortedEvent) for e in events)
    all_serving_verified(controller, "2", v2.checksum)
    # The audit log says the same: a server confirmed a checksum other than the published one.
    findings = analyze_events(controller.event_logger.events).findings
    assert [(f.rule, f.server_id, f.step) for f in findings] == [("checksum_consistency", "tiny-1", 3)]


async def test_an_aborted_window_releases_the_lock_and_restores(
    controller: AsyncInferenceController, checkpoints: dict[str, Path]
) -> None:
    window = await controller.start_update_weights()
    assert controller.health().lock.held is True
    # Training pushes v3 to one server, then gives up.
    first = controller.fleet.rollout(None)
    await first.load(
        window.servers[0].server_id,
        checkpoints["v3"],
        weight_version="3",
        expected_checksum=read_manifest(checkpoints["v3"]).checksum,
    )
    result = await controller.abort_update_weights(window)
    assert result.status is UpdateStatus.ABORTED
    all_serving_verified(controller, "2", read_manifest(checkpoints["v2"]).checksum)
    with pytest.raises(ConflictError):
        await controller.abort_update_weights(window)  # ending twice is refused


async def test_a_window_commits_what_training_pushed(
    controller: AsyncInferenceController, checkpoints: dict[str, Path]
) -> None:
    v3 = read_manifest(checkpoints["v3"])
    window = await controller.start_update_weights(ttl_s=30)
    server = controller.fleet.rollout(None)
    for target in window.servers:
        response = await server.load(
            target.server_id,
            checkpoints["v3"],
            weight_version="3",
            expected_checksum=read_manifest(checkpoints["v3"]).checksum,
        )
        assert response.success
    result = await controller.end_update_weights(window, checksum=v3.checksum, step=3, checkpoint=checkpoints["v3"])
    assert result.status is UpdateStatus.COMMITTED, result.message
    all_serving_verified(controller, "3", v3.checksum)


async def test_an_expired_lease_is_rolled_back_and_its_token_refused(
    controller: AsyncInferenceController, checkpoints: dict[str, Path]
) -> None:
    v3 = read_manifest(checkpoints["v3"])
    window = await controller.start_update_weights(ttl_s=0.5)
    server = controller.fleet.rollout(None)
    await server.load(
        window.servers[0].server_id,
        checkpoints["v4"],
        weight_version="4",
        expected_checksum=read_manifest(checkpoints["v4"]).checksum,
    )
    deadline = time.monotonic() + 30
    while not (
        controller.last_update is not None
        and controller.last_update.update_id == window.update_id
        and controller.health().lock.held is False
    ):
        assert time.monotonic() < deadline, "the expired window was never rolled back"
        await asyncio.sleep(0.05)
    assert controller.last_update.status is UpdateStatus.ABORTED
    all_serving_verified(controller, "3", v3.checksum)
    with pytest.raises(ConflictError):
        await controller.end_update_weights(window, checksum=v3.checksum, step=4)


async def test_a_window_checkpoint_no_server_could_restart_from_is_not_their_restart_point(
    controller: AsyncInferenceController, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Training ends its window naming the directory it pushed from; its manifest holds the pushed
    weights but its config is broken, so the servers keep an engine's write-out as their restart
    point instead of a directory they could not start from."""
    v4 = read_manifest(checkpoints["v4"])
    pushed_from = copy_checkpoint(checkpoints["v4"], tmp_path / "v4-broken-config")
    (pushed_from / "config.json").write_text("{")
    window = await controller.start_update_weights(ttl_s=30)
    server = controller.fleet.rollout(None)
    for target in window.servers:
        response = await server.load(target.server_id, pushed_from, weight_version="4", expected_checksum=v4.checksum)
        assert response.success
    result = await controller.end_update_weights(window, checksum=v4.checksum, step=4, checkpoint=pushed_from)
    assert result.status is UpdateStatus.COMMITTED, result.message
    all_serving_verified(controller, "4", v4.checksum)
    restart_points = {s.verified_checkpoint for s in controller.health().servers}
    assert str(pushed_from) not in restart_points, restart_points

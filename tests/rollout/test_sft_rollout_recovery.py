"""Recovering weights that exist on no disk: from a serving peer, or not at all (and saying so)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from miles.controller.health import server_health
from miles.rollout.rollout import Rollout
from miles.rollout.sft_rollout import SFTRollout
from miles.rollout.spec import HealthSettings, RolloutSpec
from miles.rollout.state import ServerState, VerifiedWeights
from miles.testing import wait_until
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.asyncio


def spec(checkpoint: Path, tmp: Path, *, num_servers: int) -> RolloutSpec:
    return RolloutSpec(
        name="rec",
        checkpoint=checkpoint,
        num_servers=num_servers,
        health=HealthSettings(interval_s=0.2, timeout_s=2.0, failure_threshold=2),
        num_threads=1,
        log_dir=tmp / "logs",
        snapshot_dir=tmp / "snapshots",
    )


async def push_without_checkpoint(server: Rollout, checkpoint: Path, *, version: str) -> VerifiedWeights:
    """What a training window does: load weights, confirm them, admit them with no checkpoint."""
    manifest = read_manifest(checkpoint)
    verified = VerifiedWeights(checkpoint=None, weight_version=version, checksum=manifest.checksum, step=7)
    for server_id in server.server_ids:
        server.begin_update(server_id, reason="test push")
        assert (
            await server.load(server_id, checkpoint, weight_version=version, expected_checksum=manifest.checksum)
        ).success
        assert (await server.confirm(server_id)).checksum == manifest.checksum
        server.admit(server_id, verified, reason="test push")
    return verified


def kill(server: SFTRollout, server_id: str) -> None:
    os.kill(server.cell(server_id).pid or 0, signal.SIGKILL)


async def test_a_restarted_server_copies_pushed_weights_from_a_peer(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    server = SFTRollout(spec(checkpoints["v1"], tmp_path, num_servers=2))
    await server.start()
    try:
        verified = await push_without_checkpoint(server, checkpoints["v2"], version="70")
        cell = server.cell("rec-0")
        restarts = cell.restarts
        kill(server, "rec-0")
        await wait_until(
            lambda: cell.restarts > restarts and cell.state is ServerState.SERVING, what="the restart", timeout=90
        )
        confirmed = await server.confirm("rec-0")
        assert (confirmed.checksum, confirmed.weight_version) == (verified.checksum, "70")
        # The peer wrote the weights out under the snapshot directory; both servers now reload from there.
        copies = {server.cell(sid).verified.checkpoint for sid in server.server_ids}  # type: ignore[union-attr]
        assert len(copies) == 1
        (copy,) = copies
        assert copy is not None and copy.is_relative_to(tmp_path / "snapshots")
        assert read_manifest(copy).checksum == verified.checksum
    finally:
        await server.stop()


async def test_without_a_copy_anywhere_a_restarted_server_is_quarantined_and_says_what_it_holds(
    checkpoints: dict[str, Path],
    tmp_path: Path,
    supervisor_rounds,
) -> None:
    server = SFTRollout(spec(checkpoints["v1"], tmp_path, num_servers=1))
    await server.start()
    try:
        verified = await push_without_checkpoint(server, checkpoints["v2"], version="71")
        cell = server.cell("rec-0")
        restarts = cell.restarts
        kill(server, "rec-0")
        await wait_until(
            lambda: cell.restarts > restarts and cell.state is ServerState.QUARANTINED, what="quarantine", timeout=90
        )
        v1 = read_manifest(checkpoints["v1"])
        report = server_health(cell.snapshot(), in_flight=0, now=time.time())
        assert report.state == "quarantined"
        # What it holds (the start checkpoint's weights), not what it was verified on.
        assert (report.weight_version, report.checksum) == (v1.weight_version, v1.checksum)
        assert (report.verified_weight_version, report.verified_checkpoint) == ("71", None)
        assert verified.checksum != v1.checksum
        # It never serves the wrong weights, and is probed again without being restarted in a loop.
        await supervisor_rounds(server, 3)
        assert cell.state is ServerState.QUARANTINED
        assert cell.restarts == restarts + 1
    finally:
        await server.stop()

"""Where a server's verified weights can be read from when it must load them again.

Its verified checkpoint, else (pushed weights lie on no disk) a copy a serving peer on the same
checksum writes out, remembered by every server verified on them. Peers may be of any server type
of the model (``miles.rollout.mixed``): all write and load the same sealed checkpoint format.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path
from typing import Protocol

from miles.errors import CheckpointError
from miles.rollout.engine_client import EngineCallError, WeightsExport
from miles.rollout.state import ServerSnapshot, ServerState, VerifiedWeights
from miles.weights.checkpoint import read_manifest

logger = logging.getLogger("miles.rollout")


class ModelServers(Protocol):
    """What finding a copy needs of a model's servers (a ``Rollout`` or a ``MixedRollout``)."""

    def snapshot(self) -> list[ServerSnapshot]: ...

    async def export(self, server_id: str, *, step: int, fence: int | None = None) -> WeightsExport: ...

    def remember_checkpoint(self, checksum: str, checkpoint: Path) -> list[str]: ...

    def copies_dirs(self) -> list[Path]: ...


def peer_holding(servers: ModelServers, verified: VerifiedWeights | None, *, besides: str) -> ServerSnapshot | None:
    """A serving server other than ``besides`` verified on the same weights (same checksum)."""
    if verified is None:
        return None
    serving = (peer for peer in servers.snapshot() if peer.server_id != besides and peer.state is ServerState.SERVING)
    return next((peer for peer in serving if peer.verified and peer.verified.checksum == verified.checksum), None)


async def source_of(
    servers: ModelServers, verified: VerifiedWeights | None, *, besides: str, fence: int | None
) -> Path | None:
    """A checkpoint holding ``verified``: its own, else one a serving peer writes out now; None if none."""
    if verified is None:
        return None
    if verified.checkpoint is not None:
        return verified.checkpoint
    peer = peer_holding(servers, verified, besides=besides)
    if peer is None:
        return None
    try:
        exported = await servers.export(peer.server_id, step=verified.step or 0, fence=fence)
    except EngineCallError as exc:
        logger.warning("%s could not write out its weights for %s: %s", peer.server_id, besides, exc)
        return None
    if exported.checksum != verified.checksum:
        logger.warning("%s wrote weights %s, not the verified %s", peer.server_id, exported.checksum, verified.checksum)
        return None
    servers.remember_checkpoint(verified.checksum, exported.path)
    return exported.path


async def remove_stale_copies(servers: ModelServers, *, newest: Path) -> None:
    """Remove copies written before ``newest`` holding weights no server is verified on (write-outs would fill
    the disk); copies still being written (hidden names) or newer (not recorded yet) are left alone."""
    held = {s.verified.checksum for s in servers.snapshot() if s.verified is not None}
    await asyncio.to_thread(_remove_stale, servers.copies_dirs(), held=held, newest=newest)


def _remove_stale(roots: list[Path], *, held: set[str], newest: Path) -> None:
    try:
        written = newest.stat().st_mtime_ns
    except OSError:
        return
    for root in roots:
        try:
            entries = [e for e in os.scandir(root) if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for entry in entries:
            path = Path(entry.path)
            try:
                if entry.stat(follow_symlinks=False).st_mtime_ns >= written or path.samefile(newest):
                    continue
                if read_manifest(path).checksum in held:
                    continue
            except (OSError, CheckpointError):
                continue  # not a sealed copy: not ours to remove
            # Renamed first, at once, so that nothing finds it half removed.
            hidden = path.with_name(f".{path.name}.removed-{os.getpid()}")
            try:
                path.rename(hidden)
            except OSError as exc:
                logger.warning("could not remove the stale weight copy %s: %s", path, exc)
                continue
            shutil.rmtree(hidden, ignore_errors=True)
            logger.info("removed the stale weight copy %s", path)

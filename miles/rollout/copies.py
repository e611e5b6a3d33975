"""Where a server's verified weights can be read from when it must load them again.

Its verified checkpoint when it has one; pushed weights lie on no disk until an engine writes them
out, so otherwise a serving peer verified on the same checksum writes them out and every server
verified on them remembers that copy. Peers are looked for among all servers of the model, of
every server type that serves it (``miles.rollout.mixed``): an embedded engine and a vLLM server
holding the same weights write the same sealed checkpoint format, which either can load.
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
    """What finding a copy needs of a model's servers (one server type's ``Rollout``, or the
    ``MixedRollout`` of several)."""

    def snapshot(self) -> list[ServerSnapshot]: ...

    async def export(self, server_id: str, *, step: int, fence: int | None = None) -> WeightsExport: ...

    def remember_checkpoint(self, checksum: str, checkpoint: Path) -> list[str]: ...

    def copies_dirs(self) -> list[Path]: ...


def peer_holding(servers: ModelServers, verified: VerifiedWeights | None, *, besides: str) -> ServerSnapshot | None:
    """A serving server other than ``besides`` verified on the same weights (same checksum)."""
    if verified is None:
        return None
    for peer in servers.snapshot():
        if (
            peer.server_id != besides
            and peer.state is ServerState.SERVING
            and peer.verified is not None
            and peer.verified.checksum == verified.checksum
        ):
            return peer
    return None


async def source_of(
    servers: ModelServers, verified: VerifiedWeights | None, *, besides: str, fence: int | None
) -> Path | None:
    """A checkpoint directory holding ``verified`` (the weights verified on server ``besides``),
    or None if there is none: its own checkpoint, else one a serving peer writes out now."""
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
    """Remove, now that ``newest`` was recorded, the weight copies in the servers' own copies
    directories that were written before it and hold weights no server is verified on: a write-out
    every few seconds of training would otherwise fill the disk. A copy still being written (a
    hidden temporary name) or written after ``newest`` (a peer's copy for a restart, not recorded
    yet) is left alone."""
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

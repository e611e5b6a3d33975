"""What an update does, as data: its weights (a target), where they come from (a source), who moves when (a schedule).

``WeightUpdate.run(plan)`` runs the protocol's steps once for every plan; a plan only says what differs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from miles.controller.results import ChecksumSource
from miles.rollout.state import VerifiedWeights


@dataclass(frozen=True)
class Target:
    """The weights an update installs: decided by the checkpoint gate, or by training ending a window."""

    weight_version: str
    step: int
    checksum: str
    source: ChecksumSource
    # Where restarts can reload these weights; None for weights a window pushed (on no disk yet).
    checkpoint: Path | None
    # The weights' size as the checkpoint's manifest records it; None when no manifest says.
    num_bytes: int | None = None

    def verified(self) -> VerifiedWeights:
        return VerifiedWeights(
            checkpoint=self.checkpoint, weight_version=self.weight_version, checksum=self.checksum, step=self.step
        )


class Steps(Protocol):
    """The steps of an update a source calls (``WeightUpdate`` has them)."""

    def load(self, server_ids: list[str]) -> Awaitable[None]: ...

    def activate(self, server_ids: list[str]) -> Awaitable[None]: ...

    def live(self, server_ids: list[str]) -> list[str]: ...

    def loaded(self, server_id: str) -> bool: ...


@dataclass(frozen=True)
class FromCheckpoint:
    """Each server loads the target's checkpoint (verifying its bytes before touching its weights).

    ``pauses``: taking a server out pauses it (else its engine pauses itself, only for the swap);
    ``refusable``: every server refusing the weights before touching its own rejects the update."""

    pauses: bool = True
    refusable: bool = True

    async def load(self, update: Steps, server_ids: list[str]) -> None:
        await update.load(server_ids)


@dataclass(frozen=True)
class FromWindow:
    """Training pushed the weights during a window: unstaged, into the live weights of paused
    servers (nothing left to load); staged, into each engine's stage, which each engine now swaps
    in, ending the window; it is ended on the others (``close``) before anything is rolled back."""

    staged: bool
    close: Callable[[list[str]], Awaitable[None]]
    refusable: bool = False

    @property
    def pauses(self) -> bool:
        return not self.staged

    async def load(self, update: Steps, server_ids: list[str]) -> None:
        if not self.staged:
            return
        await update.activate(server_ids)
        if unfinished := [sid for sid in update.live(server_ids) if not update.loaded(sid)]:
            await self.close(unfinished)


@dataclass(frozen=True)
class Barrier:
    """Every server at once while requests wait at the router; any failure rolls every server back."""

    holds_requests: bool = True
    all_or_nothing: bool = True

    def batches(self, server_ids: list[str]) -> list[list[str]]:
        return [server_ids]


@dataclass(frozen=True)
class Rolling:
    """At most ``batch_size`` servers out of routing at a time; the first failure halts the update."""

    batch_size: int
    holds_requests: bool = False
    all_or_nothing: bool = False

    def batches(self, server_ids: list[str]) -> list[list[str]]:
        size = max(self.batch_size, 1)
        return [server_ids[start : start + size] for start in range(0, len(server_ids), size)]


@dataclass(frozen=True)
class Plan:
    source: FromCheckpoint | FromWindow
    schedule: Barrier | Rolling

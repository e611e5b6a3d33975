"""MixedRollout: one model served by several server types at once, seen by the controller as one.

A model whose specs name several server types (embedded engines and vLLM servers on one
checkpoint) gets one ``Rollout`` per spec, each launching and supervising its own servers, and one
``MixedRollout`` over them: the controller's update transaction, windows, router and health drive
it exactly as they drive a single ``Rollout`` (``ModelRollout`` is either), so the model has one
lock, one ``WeightUpdate`` and one gate at the router whatever runs its servers. Each call about
one server goes to the rollout that owns that server id (ids are unique across the fleet); what is
asked of the model as a whole is answered for the mix: it stages a window's pushes only if every
server type can, and each server says which API its engine speaks (``ServerSnapshot.engine``).
Weights written out by any server are recorded for all, and a restarted server copies pushed
weights from a peer of either type (``miles.rollout.copies``). The fleet starts and stops the
rollouts themselves.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from miles.protocol.sglang import PauseMode
from miles.protocol.sglang_weights import UpdateWeightsResponse
from miles.rollout.engine_client import WeightsChecksum, WeightsExport, WeightsIdentity
from miles.rollout.rollout import Rollout
from miles.rollout.state import RolloutError, RolloutObserver, ServerCell, ServerSnapshot, VerifiedWeights


class MixedRollout:
    """The servers of one model, run by several rollouts (server types); see the module docstring."""

    def __init__(self, rollouts: Sequence[Rollout], *, observer: RolloutObserver | None = None) -> None:
        first = rollouts[0]
        for rollout in rollouts[1:]:
            # The fleet refuses such specs by name before any rollout is built.
            if rollout.model_name != first.model_name or rollout.start_checkpoint != first.start_checkpoint:
                raise RolloutError(
                    "the rollouts of one model must serve one model from one checkpoint",
                    model=first.model_name,
                    other=rollout.model_name,
                    checkpoint=str(first.start_checkpoint),
                    other_checkpoint=str(rollout.start_checkpoint),
                )
        self.rollouts = tuple(rollouts)
        self.observer = observer
        self._owners = {server_id: rollout for rollout in rollouts for server_id in rollout.server_ids}
        if len(self._owners) != sum(len(r.server_ids) for r in rollouts):
            raise RolloutError("two rollouts of one model name the same server id", model=first.model_name)
        for rollout in rollouts:
            rollout.model_servers = self
        # As Rollout.committed_high: the controller's record for the model, not any one rollout's.
        self.committed_high: int | None = None
        self._resume_from: VerifiedWeights | None = None

    # --- the model as a whole ----------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.rollouts[0].model_name

    @property
    def start_checkpoint(self) -> Path:
        return self.rollouts[0].start_checkpoint

    @property
    def stages_pushes(self) -> bool:
        """A window stages only if every server can: one that cannot (vLLM) must be out of routing
        while it is pushed to, and the window's servers commit together."""
        return all(rollout.stages_pushes for rollout in self.rollouts)

    @property
    def resume_from(self) -> VerifiedWeights | None:
        return self._resume_from

    @resume_from.setter
    def resume_from(self, weights: VerifiedWeights | None) -> None:
        self._resume_from = weights
        for rollout in self.rollouts:
            rollout.resume_from = weights

    @property
    def server_ids(self) -> list[str]:
        return list(self._owners)

    def snapshot(self) -> list[ServerSnapshot]:
        return list(itertools.chain.from_iterable(rollout.snapshot() for rollout in self.rollouts))

    @property
    def probe_rounds(self) -> int:
        """Rounds of health probes every rollout's supervisor has completed."""
        return min(rollout.probe_rounds for rollout in self.rollouts)

    def remember_checkpoint(self, checksum: str, checkpoint: Path) -> list[str]:
        """As ``Rollout.remember_checkpoint``, for the servers of every rollout; reported once."""
        changed = [server_id for rollout in self.rollouts for server_id in rollout.record_copy(checksum, checkpoint)]
        if self.observer is not None:
            self.observer.weights_written_out(self.model_name, checksum, checkpoint)
        return changed

    # --- one server: the rollout that owns it ------------------------------------------------

    def owner(self, server_id: str) -> Rollout:
        """The rollout that runs ``server_id``; RolloutError for an id that is not the model's."""
        try:
            return self._owners[server_id]
        except KeyError:
            raise RolloutError("no such server of this model", server_id=server_id, model=self.model_name) from None

    def cell(self, server_id: str) -> ServerCell:
        return self.owner(server_id).cell(server_id)

    def begin_update(self, server_id: str, *, reason: str) -> None:
        self.owner(server_id).begin_update(server_id, reason=reason)

    async def pause(self, server_id: str, mode: PauseMode, *, fence: int | None = None) -> int:
        return await self.owner(server_id).pause(server_id, mode, fence=fence)

    async def resume(self, server_id: str, *, fence: int | None = None) -> None:
        await self.owner(server_id).resume(server_id, fence=fence)

    async def load(
        self,
        server_id: str,
        checkpoint: Path,
        *,
        weight_version: str,
        expected_checksum: str,
        abort_all_requests: bool = False,
        fence: int | None = None,
    ) -> UpdateWeightsResponse:
        return await self.owner(server_id).load(
            server_id,
            checkpoint,
            weight_version=weight_version,
            expected_checksum=expected_checksum,
            abort_all_requests=abort_all_requests,
            fence=fence,
        )

    async def activate(
        self,
        server_id: str,
        *,
        weight_version: str,
        expected_checksum: str,
        pause_mode: PauseMode | None = None,
        fence: int | None = None,
    ) -> UpdateWeightsResponse:
        return await self.owner(server_id).activate(
            server_id,
            weight_version=weight_version,
            expected_checksum=expected_checksum,
            pause_mode=pause_mode,
            fence=fence,
        )

    async def confirm(self, server_id: str, *, fence: int | None = None) -> WeightsChecksum:
        return await self.owner(server_id).confirm(server_id, fence=fence)

    def record_checksum(self, server_id: str, reported: WeightsChecksum) -> WeightsChecksum:
        return self.owner(server_id).record_checksum(server_id, reported)

    async def fence(self, server_id: str, token: int, *, window_open: bool, staged: bool = False) -> None:
        await self.owner(server_id).fence(server_id, token, window_open=window_open, staged=staged)

    async def relabel(self, server_id: str, weight_version: str, *, fence: int | None = None) -> None:
        await self.owner(server_id).relabel(server_id, weight_version, fence=fence)

    async def identity(self, server_id: str) -> WeightsIdentity:
        return await self.owner(server_id).identity(server_id)

    async def export(self, server_id: str, *, step: int, fence: int | None = None) -> WeightsExport:
        return await self.owner(server_id).export(server_id, step=step, fence=fence)

    def admit(self, server_id: str, verified: VerifiedWeights, *, reason: str) -> None:
        self.owner(server_id).admit(server_id, verified, reason=reason)

    def quarantine(self, server_id: str, *, reason: str) -> None:
        self.owner(server_id).quarantine(server_id, reason=reason)

    async def rollback(self, server_id: str, *, reason: str, fence: int | None = None) -> None:
        await self.owner(server_id).rollback(server_id, reason=reason, fence=fence)

    async def restart(self, server_id: str, *, reason: str, fence: int | None = None) -> None:
        await self.owner(server_id).restart(server_id, reason=reason, fence=fence)

    async def restart_on(self, server_id: str, verified: VerifiedWeights, *, reason: str, fence: int | None) -> None:
        await self.owner(server_id).restart_on(server_id, verified, reason=reason, fence=fence)

    async def died(self, server_id: str) -> bool:
        return await self.owner(server_id).died(server_id)

    def lost(self, server_id: str, *, reason: str) -> None:
        self.owner(server_id).lost(server_id, reason=reason)

    def suspect(self, server_id: str) -> None:
        self.owner(server_id).suspect(server_id)


# What the controller drives for one model: the rollout of its one server type, or the mix.
ModelRollout = Rollout | MixedRollout

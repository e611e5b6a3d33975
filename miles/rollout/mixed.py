"""MixedRollout: one model served by several server types at once, seen by the controller as one.

One ``Rollout`` per spec runs and supervises its servers; the ``MixedRollout`` over them is driven
exactly as a single ``Rollout`` (one lock, one update, one gate per model). A call about one server
goes to the rollout that owns it; the fleet starts and stops the rollouts themselves.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

from miles.rollout.rollout import Rollout
from miles.rollout.state import RolloutError, RolloutObserver, ServerSnapshot, VerifiedWeights

P = ParamSpec("P")
R = TypeVar("R")


def _to_owner(method: Callable[Concatenate[Rollout, str, P], R]) -> Callable[Concatenate[MixedRollout, str, P], R]:
    """``method`` of the rollout that runs the server it is called about (its first argument)."""

    @functools.wraps(method)
    def forward(self: MixedRollout, server_id: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return getattr(self.owner(server_id), method.__name__)(server_id, *args, **kwargs)

    return forward


class MixedRollout:
    """The servers of one model, run by several rollouts (server types); see the module docstring."""

    def __init__(self, rollouts: Sequence[Rollout], *, observer: RolloutObserver | None = None) -> None:
        """``rollouts`` serve one model from one checkpoint, under server ids of their own: the fleet
        (``models_of``, ``Fleet._check_ids``) refuses specs that would not, naming the spec to change."""
        self.rollouts = tuple(rollouts)
        self.observer = observer
        self._owners = {server_id: rollout for rollout in rollouts for server_id in rollout.server_ids}
        for rollout in rollouts:
            rollout.model_servers = self
        # As Rollout.committed_high: the controller's record for the model, not any one rollout's.
        self.committed_high: int | None = None

    # --- the model as a whole ----------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.rollouts[0].model_name

    @property
    def start_checkpoint(self) -> Path:
        return self.rollouts[0].start_checkpoint

    @property
    def stages_pushes(self) -> bool:
        """A window stages only if every server can (the window's servers commit together)."""
        return all(rollout.stages_pushes for rollout in self.rollouts)

    @property
    def resume_from(self) -> VerifiedWeights | None:
        return self.rollouts[0].resume_from

    @resume_from.setter
    def resume_from(self, weights: VerifiedWeights | None) -> None:
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

    def copies_dirs(self) -> list[Path]:
        return [path for rollout in self.rollouts for path in rollout.copies_dirs()]

    # --- one server: the rollout that owns it ------------------------------------------------

    def owner(self, server_id: str) -> Rollout:
        """The rollout that runs ``server_id``; RolloutError for an id that is not the model's."""
        try:
            return self._owners[server_id]
        except KeyError:
            raise RolloutError("no such server of this model", server_id=server_id, model=self.model_name) from None

    cell = _to_owner(Rollout.cell)
    begin_update = _to_owner(Rollout.begin_update)
    pause = _to_owner(Rollout.pause)
    resume = _to_owner(Rollout.resume)
    load = _to_owner(Rollout.load)
    activate = _to_owner(Rollout.activate)
    confirm = _to_owner(Rollout.confirm)
    record_checksum = _to_owner(Rollout.record_checksum)
    fence = _to_owner(Rollout.fence)
    relabel = _to_owner(Rollout.relabel)
    export = _to_owner(Rollout.export)
    admit = _to_owner(Rollout.admit)
    quarantine = _to_owner(Rollout.quarantine)
    rollback = _to_owner(Rollout.rollback)
    restart_on = _to_owner(Rollout.restart_on)
    died = _to_owner(Rollout.died)
    lost = _to_owner(Rollout.lost)
    suspect = _to_owner(Rollout.suspect)


# What the controller drives for one model: the rollout of its one server type, or the mix.
ModelRollout = Rollout | MixedRollout

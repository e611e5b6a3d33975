"""Where a controller resumes: the weights its event log says were last committed and verified.

A controller started again on the same events directory must not go back (the audit's
version-order rule would flag it): docs/ARCHITECTURE.md, "Resuming from the log".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from miles.controller.gate import restart_point_problem
from miles.controller.health import ResumedFrom
from miles.errors import CheckpointError, EventLogError, MilesError
from miles.rollout.mixed import ModelRollout
from miles.utils.audit_utils.event_logger.logger import read_events
from miles.utils.audit_utils.event_logger.models import (
    ChecksumRole,
    Event,
    InferenceEngineWeightChecksumEvent,
    WeightsWrittenOutEvent,
    WeightUpdateCommittedEvent,
    WeightUpdateStartedEvent,
)
from miles.utils.weight_version import version_number
from miles.weights.checkpoint import MANIFEST_NAME, read_manifest
from miles.weights.checksum import model_checksum
from miles.weights.paths import roots_problem

logger = logging.getLogger("miles.controller")


@dataclass
class ModelHistory:
    """What a model's log says: its commits in order, where copies of weights lie."""

    model_name: str
    commits: list[WeightUpdateCommittedEvent] = field(default_factory=list)
    # Checksum -> directories said to hold those weights, the latest recorded first.
    copies: dict[str, list[Path]] = field(default_factory=dict)
    committed_high: int | None = None

    def copy_at(self, checksum: str, path: str) -> None:
        place = Path(path)
        self.copies[checksum] = [place, *(p for p in self.copies.get(checksum, []) if p != place)]


@dataclass(frozen=True)
class History:
    """The log, read for resuming: per model, and every checksum training published."""

    models: dict[str, ModelHistory]
    published: tuple[InferenceEngineWeightChecksumEvent, ...]


def history(events: Iterable[Event]) -> History:
    """What ``events`` (in log order, as ``read_events`` gives them) say for resuming."""
    models: dict[str, ModelHistory] = {}
    started_at: dict[str, str] = {}  # update id -> the checkpoint its started event named
    published = []
    for event in events:
        if isinstance(event, WeightUpdateStartedEvent) and event.checkpoint:
            started_at[event.update_id] = event.checkpoint
        elif isinstance(event, WeightUpdateCommittedEvent):
            model = models.setdefault(event.model_name, ModelHistory(event.model_name))
            model.commits.append(event)
            # Logs written before commits named their checkpoint: the started event's.
            if checkpoint := event.checkpoint or started_at.get(event.update_id):
                model.copy_at(event.checksum, checkpoint)
            if (number := version_number(event.weight_version)) is not None:
                model.committed_high = number if model.committed_high is None else max(number, model.committed_high)
        elif isinstance(event, WeightsWrittenOutEvent):
            written = models.setdefault(event.model_name, ModelHistory(event.model_name))
            written.copy_at(event.checksum, event.checkpoint)
        elif isinstance(event, InferenceEngineWeightChecksumEvent) and event.role is ChecksumRole.PUBLISHED:
            published.append(event)
    return History(models=models, published=tuple(published))


@dataclass(frozen=True)
class Resumption:
    """What training published, and per model where it resumes."""

    published: tuple[InferenceEngineWeightChecksumEvent, ...]
    models: dict[str, ResumedFrom]


def resume_fleet(directory: Path, rollouts: Iterable[ModelRollout], *, readable_roots: tuple[Path, ...]) -> Resumption:
    """Where each rollout's model resumes, by the event log in ``directory`` (blocking). Raises
    MilesError when the log cannot be read: starting anyway could serve older weights than its."""
    try:
        past = history(read_events(directory))
    except EventLogError as exc:
        raise MilesError(
            f"the event log in {directory} cannot be read ({exc}); repair or move the file aside to "
            "start without resuming from it"
        ) from exc
    points = {
        r.model_name: resume_point(model, start_checkpoint=r.start_checkpoint, readable_roots=readable_roots)
        for r in rollouts
        if (model := past.models.get(r.model_name)) is not None
    }
    return Resumption(published=past.published, models={name: p for name, p in points.items() if p is not None})


def resume_point(
    model: ModelHistory, *, start_checkpoint: Path, readable_roots: tuple[Path, ...]
) -> ResumedFrom | None:
    """The newest committed weights of ``model`` a readable copy on disk still holds (hashed to
    check), else ``weights()`` is None; None when the log committed nothing for the model."""
    if not model.commits:
        return None
    last = model.commits[-1]
    for commit in reversed(model.commits):
        for path in model.copies.get(commit.checksum, []):
            if (problem := _copy_problem(path, commit.checksum, start_checkpoint, readable_roots)) is not None:
                version = commit.weight_version
                logger.warning("cannot resume %s from %s (version %s): %s", model.model_name, path, version, problem)
                continue
            note = None
            if commit is not last:
                note = (
                    f"version {last.weight_version}, committed last, has no copy on disk that holds its checksum "
                    f"{last.checksum}; resumed from the newest committed version that has one"
                )
            return ResumedFrom(
                **commit.model_dump(include={"weight_version", "step", "checksum", "update_id"}),
                checkpoint=str(path),
                committed_at=commit.timestamp,
                last_committed_version=last.weight_version,
                committed_high=model.committed_high,
                note=note,
            )
    bar = model.committed_high if model.committed_high is not None else last.weight_version
    return ResumedFrom(
        last_committed_version=last.weight_version,
        committed_high=model.committed_high,
        note=(
            f"no committed weights have a copy on disk that holds them; started from {start_checkpoint}, and "
            f"updates must still be newer than version {bar}"
        ),
    )


def _copy_problem(path: Path, checksum: str, start_checkpoint: Path, roots: tuple[Path, ...]) -> str | None:
    """Why ``path`` cannot be resumed from as weights hashing to ``checksum``, or None."""
    if not path.is_dir():
        return "it is gone"
    if roots and (outside := roots_problem(path.resolve(), roots)):
        return outside
    if problem := restart_point_problem(path, start_checkpoint):
        return problem
    try:
        # The manifest first: a copy it says holds other weights is not read at all.
        manifest = read_manifest(path) if (path / MANIFEST_NAME).exists() else None
        if manifest is not None and manifest.checksum != checksum:
            return f"its manifest says it holds {manifest.checksum}"
        actual = model_checksum(path)
    except (CheckpointError, OSError) as exc:
        return f"it cannot be read: {exc}"
    if actual != checksum:
        return f"its files hash to {actual}, not {checksum} (changed since)"
    return None

"""The checksums training published: the expected checksum per model and step.

Filled from ``published``-role ``InferenceEngineWeightChecksumEvent``s, logged here or posted over
HTTP; safe from any thread (the seed's ``event_logger.log(...)`` runs on the caller's thread).
Bounded, since anyone allowed to post events could otherwise grow it without end: the latest
``MAX_STEPS_PER_MODEL`` steps of at most ``MAX_MODELS`` models (the least recently published to is
forgotten first). A forgotten step reads as never published.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from miles.utils.audit_utils.event_logger.models import ChecksumRole, Event, InferenceEngineWeightChecksumEvent

MAX_STEPS_PER_MODEL = 4096
MAX_MODELS = 1024


@dataclass(frozen=True)
class PublishedChecksum:
    step: int
    checksum: str
    weight_version: str | None


class PublishedChecksums:
    def __init__(self, *, max_steps_per_model: int = MAX_STEPS_PER_MODEL, max_models: int = MAX_MODELS) -> None:
        self._guard = threading.Lock()
        # model name -> step -> record; models in the order they were last published to.
        self._by_model: dict[str, dict[int, PublishedChecksum]] = {}
        self._max_steps = max_steps_per_model
        self._max_models = max_models

    def observe(self, event: Event) -> None:
        """Event-logger listener: remember every checksum training published (the latest wins)."""
        if isinstance(event, InferenceEngineWeightChecksumEvent) and event.role is ChecksumRole.PUBLISHED:
            record = PublishedChecksum(step=event.step, checksum=event.checksum, weight_version=event.weight_version)
            with self._guard:
                # Taken out and put back: the model is now the one published to last.
                steps = self._by_model[event.model_name] = self._by_model.pop(event.model_name, {})
                steps[event.step] = record
                if len(steps) > self._max_steps:
                    del steps[min(steps)]
                if len(self._by_model) > self._max_models:
                    del self._by_model[next(iter(self._by_model))]

    def expected(self, model_name: str, step: int) -> PublishedChecksum | None:
        with self._guard:
            return self._by_model.get(model_name, {}).get(step)

    def matching(self, model_name: str, checksum: str) -> PublishedChecksum | None:
        """The latest step training published ``checksum`` for, if it ever did (and it is kept)."""
        with self._guard:
            hits = [r for r in self._by_model.get(model_name, {}).values() if r.checksum == checksum]
        return max(hits, key=lambda r: r.step, default=None)

    def latest(self, model_name: str) -> PublishedChecksum | None:
        with self._guard:
            steps = self._by_model.get(model_name, {})
            return steps[max(steps)] if steps else None

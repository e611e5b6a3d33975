"""The checksums training published: the expected checksum per model and step.

Filled from ``InferenceEngineWeightChecksumEvent``s with the ``published`` role, whether they were
logged in this process or posted over HTTP by a trainer elsewhere. Safe to call from any thread
(the seed's ``controller.event_logger.log(...)`` runs on the caller's thread).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from miles.utils.audit_utils.event_logger.models import ChecksumRole, Event, InferenceEngineWeightChecksumEvent


@dataclass(frozen=True)
class PublishedChecksum:
    model_name: str
    step: int
    checksum: str
    weight_version: str | None
    event_id: str


class PublishedChecksums:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._by_key: dict[tuple[str, int], PublishedChecksum] = {}

    def observe(self, event: Event) -> None:
        """Event-logger listener: remember every checksum training published (the latest wins)."""
        if isinstance(event, InferenceEngineWeightChecksumEvent) and event.role is ChecksumRole.PUBLISHED:
            record = PublishedChecksum(
                model_name=event.model_name,
                step=event.step,
                checksum=event.checksum,
                weight_version=event.weight_version,
                event_id=event.event_id,
            )
            with self._guard:
                self._by_key[(event.model_name, event.step)] = record

    def expected(self, model_name: str, step: int) -> PublishedChecksum | None:
        with self._guard:
            return self._by_key.get((model_name, step))

    def matching(self, model_name: str, checksum: str) -> PublishedChecksum | None:
        """The latest step training published ``checksum`` for, if it ever did."""
        with self._guard:
            hits = [r for (m, _), r in self._by_key.items() if m == model_name and r.checksum == checksum]
        return max(hits, key=lambda r: r.step, default=None)

    def latest(self, model_name: str) -> PublishedChecksum | None:
        with self._guard:
            steps = [r for (m, _), r in self._by_key.items() if m == model_name]
        return max(steps, key=lambda r: r.step, default=None)

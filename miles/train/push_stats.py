"""What one push sent and what it cost (``PushStats``, ``PushPublisher.last``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class PushStats:
    path: str
    tensors: int = 0  # sent
    skipped: int = 0  # unchanged since the last committed push (delta)
    buckets: int = 0
    calls: int = 0
    # Each sent tensor's digest, computed while it was packed.
    digests: dict[str, str] = field(default_factory=dict)
    # What each engine reported each update call cost it (seconds per phase), in call order.
    engine_timings: list[dict[str, float]] = field(default_factory=list)
    bytes: int = 0
    # Of ``bytes``, those the engines read where they lie in the trainer's shared memory (no copy
    # on this side: ``PushPublisher.share_memory``).
    in_place: int = 0
    # Seconds: "open", "push" and "commit" of the window; within the push, the sender's own
    # phases, summed over buckets: "pack" (copy and digest), "join" (forming the group),
    # "broadcast", and "engines" (waiting for the engines' answers once their bytes are sent).
    timings: dict[str, float] = field(default_factory=dict)

    def spent(self, phase: str, since: float) -> None:
        """Add the time from ``since`` (a ``time.perf_counter()``) to now to ``phase``."""
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - since

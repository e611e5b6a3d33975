"""What SGLang's weights checker reports, mapped onto miles' canonical checksum.

SGLang digests the weights as it holds them (fused, sharded, padded; ``per_engine_checksum`` over
the ranks' digests), which cannot be computed from a checkpoint. So the book learns which digest D
canonical checksum C produces under a parallel layout (``tp-dp-pp``), from the first server that
loads files hashed to C, and translates D back to C after. A server that loaded C but reports
another digest holds other weights: it is reported as ``sglang:<digest>``, which equals no
canonical checksum, so the gate quarantines it. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

UNTRANSLATED_PREFIX = "sglang:"


@dataclass
class DigestBook:
    """SGLang digests seen for canonical checksums, per parallel layout."""

    # (layout, sglang digest) -> canonical checksum
    _canonical: dict[tuple[str | None, str], str] = field(default_factory=dict)
    # (layout, canonical checksum) -> sglang digest
    _digest: dict[tuple[str | None, str], str] = field(default_factory=dict)

    def translate(self, digest: str, *, layout: str | None, loaded: str | None) -> str:
        """The canonical checksum a server reporting ``digest`` holds, or ``sglang:<digest>`` when it
        cannot be tied to canonical weights (``loaded``: the checksum of the files it was last given)."""
        known = self._canonical.get((layout, digest))
        if known is not None:
            return known
        # Not tied to loaded weights, or another server loaded the same weights under this layout
        # and digested them otherwise (a digest recorded for them that is not this one).
        if loaded is None or self._digest.get((layout, loaded), digest) != digest:
            return UNTRANSLATED_PREFIX + digest
        self._canonical[(layout, digest)] = loaded
        self._digest[(layout, loaded)] = digest
        return loaded

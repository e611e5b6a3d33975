"""What SGLang's weights checker reports, mapped onto miles' canonical checksum.

A real SGLang server digests the weights it holds (``POST /weights_checker``, action
``checksum``) as SGLang holds them: per parameter of its own model classes (``qkv_proj``,
``gate_up_proj``: fused, sharded per tensor-parallel rank, padded), then ``per_engine_checksum``,
SHA-256 over the ranks' digests. That value cannot be computed from a checkpoint without SGLang's
loader, so it is never compared with the canonical checksum directly. Instead the book learns
which SGLang digest a canonical checksum produces, from loads whose source was verified:

- a server is told to load a checkpoint (or launched on one) whose files the rollout hashed to
  canonical checksum C; the digest D it then reports is recorded as C's digest under its
  parallel layout (``tp-dp-pp``): the same weights digest alike only under the same layout;
- every later report is translated back: D is C. A server that loaded C but reports another
  digest than the one C already has under that layout holds other weights (a partial or corrupt
  load): it is reported as ``sglang:<digest>``, which equals no canonical checksum, so the gate
  quarantines it as it would any mismatch.

The first server to load C under a layout defines C's digest there; the servers after it are
checked against it. Pure bookkeeping, no I/O: tested from tables.
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
        """The canonical checksum a server reporting ``digest`` holds.

        ``loaded``: the canonical checksum of the verified weights the server was last given (a
        launch or a load whose files the rollout hashed), or None. Returns ``sglang:<digest>``
        when the digest cannot be tied to canonical weights.
        """
        known = self._canonical.get((layout, digest))
        if known is not None:
            return known
        if loaded is None:
            return UNTRANSLATED_PREFIX + digest
        recorded = self._digest.get((layout, loaded))
        if recorded is not None and recorded != digest:
            # Another server loaded the same weights under this layout and digested them
            # otherwise: this one holds something else.
            return UNTRANSLATED_PREFIX + digest
        self._canonical[(layout, digest)] = loaded
        self._digest[(layout, loaded)] = digest
        return loaded

    def digest_of(self, checksum: str, *, layout: str | None) -> str | None:
        """The SGLang digest recorded for canonical ``checksum`` under ``layout``, if any."""
        return self._digest.get((layout, checksum))

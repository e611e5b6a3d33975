"""Protocol step 3: decide whether a checkpoint may be loaded at all, before any server is touched.

The gate checks what only the coordinator can know: the path is allowed, the checkpoint is
well-formed and for this model, its checksum is the one training published for its step, and its
version is newer than the one serving. It does not hash the tensors: every server verifies the
bytes against the manifest before it touches its own weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles.config import ControllerSettings
from miles.errors import InvalidRequestError
from miles.ray.rollout.checksums import PublishedChecksums
from miles.ray.rollout.update_types import ChecksumSource
from miles.utils.weight_version import is_newer
from miles.weights.checkpoint import Manifest, verify_checkpoint
from miles.weights.paths import checked_path


class CheckpointRejected(Exception):
    """The gate refused a checkpoint; ``message`` says why and what to do."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


@dataclass(frozen=True)
class AdmittedCheckpoint:
    path: Path
    manifest: Manifest
    expected_checksum: str
    checksum_source: ChecksumSource
    weight_version: str


def admit_checkpoint(
    checkpoint: Path,
    *,
    model_name: str,
    settings: ControllerSettings,
    published: PublishedChecksums,
    weight_version: str | None,
    serving_version: str | None,
) -> AdmittedCheckpoint:
    """Check ``checkpoint`` for an update of ``model_name``; raises CheckpointRejected if it fails.

    ``serving_version`` must be read under the controller's lock, by the update that is about
    to run: a value read earlier may have been overtaken by an update that queued ahead.
    """
    try:
        path = checked_path(str(checkpoint), field="checkpoint")
    except InvalidRequestError as exc:
        raise CheckpointRejected(exc.message) from exc
    roots = settings.allowed_checkpoint_roots
    if roots and not any(path.is_relative_to(root) for root in roots):
        raise CheckpointRejected(
            f"checkpoint {path} is outside the allowed checkpoint roots ({', '.join(map(str, roots))}); "
            "move it under one of them or extend MILES_ALLOWED_CHECKPOINT_ROOTS"
        )
    if not path.is_dir():
        raise CheckpointRejected(f"checkpoint {path} is not a directory")
    # Structure only (manifest, files, headers): every server hashes the bytes against the
    # manifest before it touches its weights, so a second full pass here would only add a read of
    # the whole checkpoint per update (minutes for large models on disk).
    report = verify_checkpoint(path, digests=False)
    if not report.ok or report.manifest is None:
        problems = "; ".join(f"{p.kind.value}: {p.message}" for p in report.problems[:5])
        raise CheckpointRejected(f"checkpoint {path} failed verification: {problems}")
    manifest = report.manifest
    if manifest.model_name != model_name:
        raise CheckpointRejected(
            f"checkpoint {path} is for model {manifest.model_name!r}, but these servers serve {model_name!r}"
        )
    record = published.expected(model_name, manifest.step)
    if record is not None:
        if record.checksum != manifest.checksum:
            raise CheckpointRejected(
                f"checksum mismatch: training published {record.checksum} for {model_name} step "
                f"{manifest.step}, but checkpoint {path} holds {manifest.checksum}; it is not the "
                "checkpoint training meant (stale, overwritten or corrupted before sealing)"
            )
        expected, source = record.checksum, ChecksumSource.PUBLISHED
    elif settings.require_published_checksum:
        raise CheckpointRejected(
            f"no checksum was published for {model_name} step {manifest.step}; log an "
            "InferenceEngineWeightChecksumEvent first (require_published_checksum is on)"
        )
    else:
        expected, source = manifest.checksum, ChecksumSource.MANIFEST
    version = weight_version or manifest.weight_version
    if is_newer(version, serving_version) is False:
        raise CheckpointRejected(
            f"weight version {version} is not newer than the version the fleet already serves "
            f"({serving_version}); serving versions never go back. Pass a newer weight_version to "
            "republish older weights on purpose"
        )
    return AdmittedCheckpoint(
        path=path, manifest=manifest, expected_checksum=expected, checksum_source=source, weight_version=version
    )

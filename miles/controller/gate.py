"""Protocol step 3: decide whether a checkpoint may be loaded at all, before any server is touched.

The gate checks what only the coordinator can know: the path and every file in it are allowed,
the checkpoint is well-formed and for this model, its weights are the ones training published
(matched by checksum, the identity of the weights), and its version is newer than the one
serving. It does not hash the tensors: every server hashes the bytes before it touches its own
weights, against the manifest of a sealed checkpoint, or against the published checksum for a
plain Hugging Face directory (``save_pretrained`` output, no manifest).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles.config import ControllerSettings
from miles.controller.published import PublishedChecksum, PublishedChecksums
from miles.controller.results import ChecksumSource
from miles.errors import InvalidRequestError
from miles.utils.weight_version import is_newer
from miles.weights.checkpoint import MANIFEST_NAME, Manifest, verify_checkpoint
from miles.weights.paths import checked_path, files_outside_roots, inside_roots
from miles.weights.verification import plain_checkpoint_problems


class CheckpointRejected(Exception):
    """The gate refused a checkpoint; ``message`` says why and what to do."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


@dataclass(frozen=True)
class AdmittedCheckpoint:
    path: Path
    # None for a plain Hugging Face directory: servers verify it against ``expected_checksum``.
    manifest: Manifest | None
    expected_checksum: str
    checksum_source: ChecksumSource
    weight_version: str
    step: int


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
    if not inside_roots(path, roots):
        raise CheckpointRejected(
            f"checkpoint {path} is outside the allowed checkpoint roots ({', '.join(map(str, roots))}); "
            "move it under one of them or extend MILES_ALLOWED_CHECKPOINT_ROOTS"
        )
    if not path.is_dir():
        raise CheckpointRejected(f"checkpoint {path} is not a directory")
    escaping = files_outside_roots(path, roots)
    if escaping:
        raise CheckpointRejected(
            f"checkpoint {path} has files that resolve outside the allowed checkpoint roots "
            f"({', '.join(escaping[:5])}); copy the files in instead of linking to them"
        )
    if not (path / MANIFEST_NAME).exists():
        return _admit_plain(
            path,
            model_name=model_name,
            published=published,
            weight_version=weight_version,
            serving_version=serving_version,
        )
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
    matched = published.matching(model_name, manifest.checksum)
    same_step = published.expected(model_name, manifest.step)
    latest = published.latest(model_name)
    if matched is not None:
        # Matched by checksum: these are the weights training published for that step, whatever
        # step the manifest was sealed with.
        expected, source, step = matched.checksum, ChecksumSource.PUBLISHED, matched.step
        version = weight_version or matched.weight_version or str(matched.step)
    elif same_step is not None:
        raise CheckpointRejected(
            f"checksum mismatch: training published {same_step.checksum} for {model_name} step "
            f"{manifest.step}, but checkpoint {path} holds {manifest.checksum}; it is not the "
            "checkpoint training meant (stale, overwritten or corrupted before sealing)"
        )
    elif latest is not None and latest.step > manifest.step and weight_version is None:
        # Training published a newer step and this is none of its checkpoints: stale or foreign.
        # An older checkpoint is refused as such first; a newer one as weights nobody published.
        # (An explicit weight_version republishes sealed weights on purpose.)
        _check_newer(manifest.weight_version, serving_version)
        raise _unpublished(path, model_name=model_name, checksum=manifest.checksum, latest=latest)
    elif settings.require_published_checksum:
        raise CheckpointRejected(
            f"no checksum was published for {model_name} step {manifest.step}; log an "
            "InferenceEngineWeightChecksumEvent first (require_published_checksum is on)"
        )
    else:
        expected, source, step = manifest.checksum, ChecksumSource.MANIFEST, manifest.step
        version = weight_version or manifest.weight_version
    _check_newer(version, serving_version)
    return AdmittedCheckpoint(
        path=path,
        manifest=manifest,
        expected_checksum=expected,
        checksum_source=source,
        weight_version=version,
        step=step,
    )


def _admit_plain(
    path: Path,
    *,
    model_name: str,
    published: PublishedChecksums,
    weight_version: str | None,
    serving_version: str | None,
) -> AdmittedCheckpoint:
    """A directory as ``save_pretrained`` writes it: admitted as the latest published step.

    Its weights are identified by the checksum training published last for the model; each
    server computes the checkpoint's checksum in the pass that verifies it before loading and
    refuses it when they differ, so no second pass over the files is made here.
    """
    latest = published.latest(model_name)
    if latest is None:
        raise CheckpointRejected(
            f"checkpoint {path} has no miles manifest and training published no checksum for model "
            f"{model_name!r}, so nothing says what these weights should be. Either log an "
            "InferenceEngineWeightChecksumEvent(model_name, checksum, step) with the checksum of the "
            "saved weights (miles.weights.checksum.model_checksum(model_or_dir)), or seal the "
            "directory with `miles checkpoint seal DIR --model-name NAME --step N`"
        )
    problems = plain_checkpoint_problems(path)
    if problems:
        raise CheckpointRejected(f"checkpoint {path} failed verification: {'; '.join(problems[:5])}")
    version = weight_version or latest.weight_version or str(latest.step)
    _check_newer(version, serving_version)
    return AdmittedCheckpoint(
        path=path,
        manifest=None,
        expected_checksum=latest.checksum,
        checksum_source=ChecksumSource.PUBLISHED,
        weight_version=version,
        step=latest.step,
    )


def refused_plain_message(
    admitted: AdmittedCheckpoint, *, model_name: str, published: PublishedChecksums, actual: str
) -> str:
    """Why servers refused a plain checkpoint whose weights hash to ``actual``."""
    older = published.matching(model_name, actual)
    if older is not None:
        return (
            f"checkpoint {admitted.path} holds the weights training published for step {older.step} "
            f"({actual}), not the latest published step {admitted.step} ({admitted.expected_checksum})"
        )
    return _unpublished_message(
        admitted.path, model_name=model_name, checksum=actual, step=admitted.step, latest=admitted.expected_checksum
    )


def _unpublished(path: Path, *, model_name: str, checksum: str, latest: PublishedChecksum) -> CheckpointRejected:
    return CheckpointRejected(
        _unpublished_message(path, model_name=model_name, checksum=checksum, step=latest.step, latest=latest.checksum)
    )


def _unpublished_message(path: Path, *, model_name: str, checksum: str, step: int, latest: str) -> str:
    return (
        f"checkpoint {path} holds weights with checksum {checksum}, which training never published "
        f"for {model_name!r}; the latest published checksum is {latest} (step {step}). Publish this "
        "checkpoint's checksum, or load the checkpoint training published"
    )


def _check_newer(version: str, serving_version: str | None) -> None:
    if is_newer(version, serving_version) is False:
        raise CheckpointRejected(
            f"weight version {version} is not newer than the version the fleet already serves "
            f"({serving_version}); serving versions never go back. Pass a newer weight_version to "
            "republish older weights on purpose"
        )

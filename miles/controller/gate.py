"""Protocol step 3: decide whether a checkpoint may be loaded at all, before any server is touched.

What it refuses: docs/ARCHITECTURE.md, "The life of an update", step 2. It does not hash the
tensors: every server does, before it touches its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from miles.config import ControllerSettings
from miles.controller.plans import Target
from miles.controller.published import PublishedChecksums
from miles.controller.results import ChecksumSource
from miles.errors import CheckpointFileInvalidError, InvalidRequestError
from miles.utils.weight_version import is_newer
from miles.weights.checkpoint import MANIFEST_NAME, verify_checkpoint
from miles.weights.paths import checked_path, roots_problem
from miles.weights.safetensors_io import open_regular
from miles.weights.verification import plain_checkpoint_problems


class CheckpointRejected(Exception):
    """The gate refused a checkpoint; ``message`` says why and what to do."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


def vet_checkpoint(
    checkpoint: Path,
    *,
    model_name: str,
    settings: ControllerSettings,
    published: PublishedChecksums,
    weight_version: str | None,
    serving_version: str | None,
    start_checkpoint: Path | None = None,
) -> Target:
    """The weights ``checkpoint`` holds for an update of ``model_name`` (``num_bytes`` None for a plain
    directory, whose checksum servers check before loading); raises CheckpointRejected if it fails.

    ``serving_version`` must be read under the controller's lock, by the update about to run (a
    value read earlier may have been overtaken by an update that queued ahead)."""
    # An OS error under the gate's checks (an I/O error, no permission) is a refusal too.
    try:
        try:
            path = checked_path(str(checkpoint), field="checkpoint")
        except InvalidRequestError as exc:
            raise CheckpointRejected(exc.message) from exc
        if problem := roots_problem(path, settings.allowed_checkpoint_roots):
            raise CheckpointRejected(problem)
        if not path.is_dir():
            raise CheckpointRejected(f"checkpoint {path} is not a directory")
        if problem := restart_point_problem(path, start_checkpoint):
            raise CheckpointRejected(problem)
        # lexists: a manifest that is there but cannot be opened (a symlink loop) is refused as such.
        if not os.path.lexists(path / MANIFEST_NAME):
            target = _vet_plain(path, model_name=model_name, published=published, weight_version=weight_version)
            _check_newer(target.weight_version, serving_version)
            return target
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
            raise CheckpointRejected(
                _unpublished_message(
                    path, model_name=model_name, checksum=manifest.checksum, step=latest.step, latest=latest.checksum
                )
            )
        elif settings.require_published_checksum:
            raise CheckpointRejected(
                f"no checksum was published for {model_name} step {manifest.step}; log an "
                "InferenceEngineWeightChecksumEvent first (require_published_checksum is on)"
            )
        else:
            expected, source, step = manifest.checksum, ChecksumSource.MANIFEST, manifest.step
            version = weight_version or manifest.weight_version
        _check_newer(version, serving_version)
        return Target(
            weight_version=version,
            step=step,
            checksum=expected,
            source=source,
            checkpoint=path,
            num_bytes=manifest.num_bytes,
        )
    except OSError as exc:
        raise CheckpointRejected(f"checkpoint {checkpoint} cannot be read: {exc.strerror or exc}") from None


def _vet_plain(path: Path, *, model_name: str, published: PublishedChecksums, weight_version: str | None) -> Target:
    """A directory as ``save_pretrained`` writes it: accepted as the latest published step, whose
    checksum each server checks before loading."""
    latest = published.latest(model_name)
    if latest is None:
        raise CheckpointRejected(
            f"checkpoint {path} has no miles manifest and training published no checksum for model "
            f"{model_name!r}, so nothing says what these weights should be. Either log an "
            "InferenceEngineWeightChecksumEvent(model_name, checksum, step) with the checksum of the "
            "saved weights (miles.weights.checksum.model_checksum(model_or_dir)), or seal the "
            "directory with `miles checkpoint seal DIR --model-name NAME --step N`"
        )
    if problems := plain_checkpoint_problems(path):
        raise CheckpointRejected(f"checkpoint {path} failed verification: {'; '.join(problems[:5])}")
    return Target(
        weight_version=weight_version or latest.weight_version or str(latest.step),
        step=latest.step,
        checksum=latest.checksum,
        source=ChecksumSource.PUBLISHED,
        checkpoint=path,
    )


def refused_plain_message(target: Target, *, model_name: str, published: PublishedChecksums, actual: str) -> str:
    """Why servers refused a plain checkpoint whose weights hash to ``actual``."""
    if (older := published.matching(model_name, actual)) is not None:
        return (
            f"checkpoint {target.checkpoint} holds the weights training published for step {older.step} "
            f"({actual}), not the latest published step {target.step} ({target.checksum})"
        )
    return _unpublished_message(
        target.checkpoint, model_name=model_name, checksum=actual, step=target.step, latest=target.checksum
    )


def _unpublished_message(path: Path | None, *, model_name: str, checksum: str, step: int, latest: str) -> str:
    return (
        f"checkpoint {path} holds weights with checksum {checksum}, which training never published "
        f"for {model_name!r}; the latest published checksum is {latest} (step {step}). Publish this "
        "checkpoint's checksum, or load the checkpoint training published"
    )


def not_newer(version: str, serving_version: str | None) -> str | None:
    """Why ``version`` may not follow ``serving_version``, the newest the fleet has served, or None."""
    if is_newer(version, serving_version) is False:
        return (
            f"weight version {version} is not newer than the newest version the fleet has served "
            f"({serving_version}); serving versions never go back"
        )
    return None


def _check_newer(version: str, serving_version: str | None) -> None:
    if problem := not_newer(version, serving_version):
        raise CheckpointRejected(f"{problem}. Pass a newer weight_version to republish older weights on purpose")


CONFIG_NAME = "config.json"
# What a config says about the file or the run rather than the model: saved by other library
# versions or settings, they differ between checkpoints of one model.
_NOT_THE_MODEL = frozenset(
    "transformers_version _name_or_path _commit_hash torch_dtype dtype use_cache output_attentions "
    "output_hidden_states return_dict".split()
)
# Configs are a few kilobytes; this bounds what a hostile file can make the gate read.
MAX_CONFIG_BYTES = 16 * 1024 * 1024


# A tokenizer's vocabulary, in whichever form it was saved: an engine loads its tokenizer from the
# checkpoint it starts on. The other tokenizer files (tokenizer_config.json, special_tokens_map.json,
# a chat template) come and go between library versions, so their absence is no reason to refuse.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def restart_point_problem(checkpoint: Path, start_checkpoint: Path | None) -> str | None:
    """Why servers could not restart from ``checkpoint`` as they run now (no readable config, a
    config that disagrees with the start checkpoint's, no tokenizer), or None. Raises OSError."""
    config = _read_config(checkpoint)
    if isinstance(config, str):
        return (
            f"checkpoint {checkpoint} {config}: a server that restarts from it could not start; save the "
            f"model's config with its weights (save_pretrained writes {CONFIG_NAME})"
        )
    if start_checkpoint is None:
        return None

    def has_vocabulary(directory: Path) -> bool:
        return any((directory / name).is_file() for name in VOCABULARY_FILES)

    if has_vocabulary(start_checkpoint) and not has_vocabulary(checkpoint):
        return (
            f"checkpoint {checkpoint} has no tokenizer (none of {', '.join(VOCABULARY_FILES)}), and a server "
            "that restarts from it could not start: save the tokenizer with the weights "
            f"(tokenizer.save_pretrained(DIR)) or copy its files in from the start checkpoint {start_checkpoint}"
        )
    reference = _read_config(start_checkpoint)
    if isinstance(reference, str):
        return None  # the start checkpoint is gone or unreadable: nothing to compare with
    differing = sorted(
        key for key in (config.keys() & reference.keys()) - _NOT_THE_MODEL if config[key] != reference[key]
    )
    if differing:
        shown = "; ".join(
            f"{key} is {_short(config[key])} there and {_short(reference[key])} in the start checkpoint"
            for key in differing[:5]
        )
        return (
            f"checkpoint {checkpoint} is for another model than the one these servers run ({shown}; "
            f"start checkpoint {start_checkpoint}). An update replaces weights only: start the servers "
            "on a checkpoint of the new architecture instead"
        )
    return None


def _read_config(directory: Path) -> dict[str, Any] | str:
    """The checkpoint's config as a JSON object, or what is wrong with it."""
    path = directory / CONFIG_NAME
    try:
        with open_regular(path) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return f"has no {CONFIG_NAME}"
    except CheckpointFileInvalidError as exc:
        return f"has a {CONFIG_NAME} that cannot be read ({exc.message})"
    except OSError as exc:
        return f"has a {CONFIG_NAME} that cannot be read ({exc.strerror})"
    if len(raw) > MAX_CONFIG_BYTES:
        return f"has a {CONFIG_NAME} larger than {MAX_CONFIG_BYTES} bytes"
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        return f"has a {CONFIG_NAME} that is not JSON ({exc})"
    if not isinstance(config, dict):
        return f"has a {CONFIG_NAME} that is not a JSON object"
    return config


def _short(value: object) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."

"""Where a controller started again on its event log resumes, read from logged events and the
copies on disk (no engines): the newest committed weights a copy still holds, checked by hashing,
and what /health says when that is not the version committed last."""

from __future__ import annotations

import shutil
from pathlib import Path

from miles.controller.resume import history, resume_point
from miles.testing import copy_checkpoint
from miles.utils.audit_utils.event_logger.models import (
    Event,
    InferenceEngineWeightChecksumEvent,
    WeightsWrittenOutEvent,
    WeightUpdateCommittedEvent,
    WeightUpdateStartedEvent,
)
from miles.weights.checkpoint import read_manifest


def committed(update_id: str, version: str, checksum: str, checkpoint: Path | None) -> WeightUpdateCommittedEvent:
    return WeightUpdateCommittedEvent(
        update_id=update_id,
        model_name="tiny",
        weight_version=version,
        step=int(version) if version.isdigit() else None,
        checksum=checksum,
        server_ids=("tiny-0",),
        duration_s=0.1,
        checkpoint=str(checkpoint) if checkpoint else None,
    )


def test_the_newest_commit_with_a_copy_is_resumed_and_the_highest_version_kept(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    v2, v3, v4 = (read_manifest(checkpoints[n]) for n in ("v2", "v3", "v4"))
    moving = copy_checkpoint(checkpoints["v3"], tmp_path / "moving")
    written = copy_checkpoint(checkpoints["v4"], tmp_path / "written-out")
    events: list[Event] = [
        InferenceEngineWeightChecksumEvent(model_name="tiny", checksum=v2.checksum, step=5),
        # An older log: the commit names no checkpoint, its started event does.
        WeightUpdateStartedEvent(
            update_id="u5",
            model_name="tiny",
            weight_version="5",
            checkpoint=str(checkpoints["v2"]),
            strategy="barrier",
            pause_mode="drain",
            server_ids=("tiny-0",),
        ),
        committed("u5", "5", v2.checksum, None),
        committed("u10", "10", v3.checksum, moving),
        committed("uabc", "abc", v3.checksum, moving),  # a label: resumed, but no integer bar
        committed("u12", "12", v4.checksum, None),  # pushed, then written out
        WeightsWrittenOutEvent(model_name="tiny", checksum=v4.checksum, checkpoint=str(written)),
    ]
    past = history(events)
    assert [e.checksum for e in past.published] == [v2.checksum]
    model = past.models["tiny"]
    assert model.committed_high == 12

    def point() -> tuple[str | None, str | None, str | None]:
        reported = resume_point(model, start_checkpoint=checkpoints["v1"], readable_roots=())
        assert reported is not None
        assert reported.last_committed_version == "12" and reported.committed_high == 12
        return reported.weight_version, reported.checkpoint, reported.note

    assert point() == ("12", str(written), None)
    # The written-out copy is gone: v4's weights have no other copy, so the newest commit with one.
    shutil.rmtree(written)
    version, where, note = point()
    assert (version, where) == ("abc", str(moving)) and note is not None and "version 12" in note
    # Someone saved other weights over the directory (manifest and all): hashing tells.
    for name in ("model.safetensors", "miles_manifest.json"):
        (moving / name).write_bytes((checkpoints["v4"] / name).read_bytes())
    assert point()[:2] == ("5", str(checkpoints["v2"]))
    # A manifest that lies about the files is caught too: the files are hashed.
    lying = copy_checkpoint(checkpoints["v2"], tmp_path / "lying")
    (lying / "model.safetensors").write_bytes((checkpoints["v3"] / "model.safetensors").read_bytes())
    model.copies[v2.checksum] = [lying]
    found = resume_point(model, start_checkpoint=checkpoints["v1"], readable_roots=())
    assert found is not None and found.weights() is None
    assert found.note is not None and "updates must still be newer than version 12" in found.note


def test_a_copy_outside_the_checkpoint_roots_is_not_resumed(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    v2 = read_manifest(checkpoints["v2"])
    model = history([committed("u5", "5", v2.checksum, checkpoints["v2"])]).models["tiny"]
    outside = resume_point(model, start_checkpoint=checkpoints["v1"], readable_roots=(tmp_path,))
    assert outside is not None and outside.weights() is None
    inside = resume_point(model, start_checkpoint=checkpoints["v1"], readable_roots=(checkpoints["v2"].parent,))
    weights = inside.weights() if inside is not None else None
    assert weights is not None and (weights.weight_version, weights.checkpoint) == ("5", checkpoints["v2"])
    # Nothing committed: nothing to resume.
    assert history([]).models == {}

"""DiskPublisher on real files: write, announce the checksum, wait for ready, apply, prune."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.errors import PublishError, PublishNotReadyError
from miles.models.presets import build_model
from miles.models.tokenizer import build_tokenizer
from miles.train.publisher import DiskPublisher
from miles.utils.audit_utils.event_logger import EventLogger, InferenceEngineWeightChecksumEvent
from miles.weights.checkpoint import Manifest, read_manifest, verify_checkpoint


class RecordingApply:
    """An ``ApplyFn`` that records what it was given and can be told to fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, Manifest]] = []
        self.fail_with: Exception | None = None

    async def __call__(self, checkpoint_dir: Path, manifest: Manifest) -> None:
        self.calls.append((checkpoint_dir, manifest))
        if self.fail_with is not None:
            raise self.fail_with


class ScriptedReady:
    """A ``ReadyFn`` that says no ``refusals`` times, then yes, and counts the polls."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.polls = 0

    async def __call__(self) -> bool:
        self.polls += 1
        return self.polls > self.refusals


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def publisher(tmp_path: Path, apply: RecordingApply, **kwargs) -> tuple[DiskPublisher, EventLogger]:
    events = EventLogger(None)
    return DiskPublisher(tmp_path / "ckpt", model_name="tiny-test", event_logger=events, apply=apply, **kwargs), events


async def test_publish_writes_announces_then_applies(tmp_path: Path, model, tokenizer) -> None:
    apply = RecordingApply()
    events = EventLogger(None)
    seen_at_apply: list[int] = []

    async def apply_checking_order(checkpoint_dir: Path, manifest: Manifest) -> None:
        # The expected checksum must be on record before any server is asked to load.
        seen_at_apply.append(len(events.events))
        await apply(checkpoint_dir, manifest)

    pub = DiskPublisher(tmp_path / "ckpt", model_name="tiny-test", event_logger=events, apply=apply_checking_order)
    result = await pub.publish(model, tokenizer, step=3)

    assert result.step == 3 and result.weight_version == "3"
    assert result.checkpoint_dir == pub.checkpoint_dir(3) and result.checkpoint_dir.name == "step-000003"
    manifest = read_manifest(result.checkpoint_dir)
    assert manifest.checksum == result.checksum and manifest.step == 3 and manifest.model_name == "tiny-test"
    assert verify_checkpoint(result.checkpoint_dir).ok
    (event,) = events.events
    assert isinstance(event, InferenceEngineWeightChecksumEvent)
    announced = (event.model_name, event.checksum, event.step, event.weight_version)
    assert announced == ("tiny-test", manifest.checksum, 3, "3")
    assert seen_at_apply == [1]
    assert apply.calls == [(result.checkpoint_dir, manifest)]
    assert result.latency_s >= result.save_s + result.apply_s


async def test_publish_waits_for_ready(tmp_path: Path, model, tokenizer) -> None:
    apply, ready = RecordingApply(), ScriptedReady(refusals=3)
    pub, _ = publisher(tmp_path, apply, ready=ready, ready_poll_s=0.001)
    await pub.publish(model, tokenizer, step=1)
    assert ready.polls == 4
    assert len(apply.calls) == 1


async def test_never_ready_pushes_nothing(tmp_path: Path, model, tokenizer) -> None:
    apply = RecordingApply()
    never = ScriptedReady(refusals=10**9)
    pub, _ = publisher(tmp_path, apply, ready=never, ready_timeout_s=0.05, ready_poll_s=0.005)
    with pytest.raises(PublishNotReadyError) as info:
        await pub.publish(model, tokenizer, step=2)
    assert info.value.context["step"] == 2
    assert apply.calls == []


async def test_apply_failure_is_a_publish_error_with_context(tmp_path: Path, model, tokenizer) -> None:
    apply = RecordingApply()
    apply.fail_with = RuntimeError("server 1 said no")
    pub, _ = publisher(tmp_path, apply)
    with pytest.raises(PublishError, match="server 1 said no") as info:
        await pub.publish(model, tokenizer, step=5)
    assert info.value.context["step"] == 5 and len(info.value.context["checksum"]) == 32
    assert isinstance(info.value.__cause__, RuntimeError)


async def test_existing_checkpoint_is_not_overwritten(tmp_path: Path, model, tokenizer) -> None:
    pub, _ = publisher(tmp_path, RecordingApply())
    await pub.publish(model, tokenizer, step=1)
    fresh, _ = publisher(tmp_path, RecordingApply())
    with pytest.raises(PublishError, match="writing the checkpoint failed"):
        await fresh.publish(model, tokenizer, step=1)


async def test_keeps_the_last_two_checkpoints(tmp_path: Path, model, tokenizer) -> None:
    pub, _ = publisher(tmp_path, RecordingApply())
    for step in range(1, 5):
        await pub.publish(model, tokenizer, step=step)
    assert sorted(p.name for p in pub.root.iterdir()) == ["step-000003", "step-000004"]


def test_keep_last_must_leave_a_rollback_target(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        publisher(tmp_path, RecordingApply(), keep_last=1)

"""Reading an engine's weights whole (an export's copy, a checksum), a slice at a time under the
read side of its lock."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles.engine.weights.live import LiveWeights, _require_room, copy_weights
from miles.engine.weights.lock import WeightsLock
from miles.engine.weights.memory import WeightMemory
from miles.engine.weights.stage import LiveStage
from miles.errors import ConflictError, InsufficientStorageError
from miles.models import build_tokenizer
from miles.models.presets import build_model
from miles.protocol.sglang_weights import ExportWeightsRequest
from miles.utils.http import status_of
from miles.weights.checksum import checksum_module


def test_the_copy_holds_the_same_weights_in_memory_of_its_own_and_keeps_ties() -> None:
    model = build_model("tiny-tied", seed=3)
    lock = WeightsLock()
    copied = copy_weights(model, lock, writes=lock.writes, what="weights 1")
    assert checksum_module(copied).checksum == checksum_module(model).checksum
    assert copied.get_output_embeddings().weight is copied.get_input_embeddings().weight
    live = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert not live & {t.data_ptr() for t in [*copied.parameters(), *copied.buffers()]}
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert checksum_module(copied).checksum != checksum_module(model).checksum


def test_a_write_meanwhile_waits_for_one_slice_and_ends_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer gets the lock between two slices, long before the copy would have ended; the
    copy then refuses to go on with weights that are no longer the ones it started from."""
    monkeypatch.setattr("miles.engine.weights.live.READ_SECTION_BYTES", 64)  # thousands of read sections
    model = build_model("tiny", seed=3)
    lock = WeightsLock()
    writes = lock.writes
    outcome: dict[str, object] = {}
    wrote = threading.Event()

    def copy() -> None:
        try:
            copy_weights(model, lock, writes=writes, what="weights 1")
            outcome["copied"] = True
        except ConflictError as exc:
            outcome["refused"] = str(exc)
            outcome["writer_was_done"] = wrote.is_set()

    copier = threading.Thread(target=copy)
    copier.start()
    with lock.write():
        pass
    wrote.set()
    copier.join(timeout=60)
    assert not copier.is_alive()
    if "copied" in outcome:
        pytest.fail("the copy ended before the writer could take the lock once: make the model larger")
    assert "weights changed while they were read (weights 1 then)" in str(outcome["refused"])
    # The copy noticed the write after it: the writer did not wait for the copy to end.
    assert outcome["writer_was_done"] is True


def test_a_write_before_the_copy_starts_is_noticed_at_its_first_slice() -> None:
    model = build_model("tiny", seed=3)
    lock = WeightsLock()
    writes = lock.writes
    with lock.write():
        pass
    with pytest.raises(ConflictError, match="ask again"):
        copy_weights(model, lock, writes=writes, what="weights 1")


def test_a_checksum_is_hashed_in_sections_a_write_waits_for_one_and_the_hash_starts_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checksum of the live weights (``/weights_checker``) never holds a change back for a whole
    pass: the writer gets the lock between two slices, and the checksum, which would otherwise mix
    two versions, is hashed again and recorded as the weights held after the write."""
    monkeypatch.setattr("miles.engine.weights.live.READ_SECTION_BYTES", 64)
    model = build_model("tiny", seed=3)
    lock = WeightsLock()
    weights = LiveWeights(
        lock=lock,
        model=lambda: model,
        tokenizer=None,
        served_model_name="tiny",
        snapshot_dir=None,
        version="1",
        loaded_from=Path("."),
        manifest_checksum=None,
    )
    sections = threading.Semaphore(0)
    read = lock.read

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        with read():
            yield
        sections.release()

    monkeypatch.setattr(lock, "read", counted)
    changed = torch.full_like(next(model.parameters()), 0.5)
    hashed: dict[str, str] = {}
    hasher = threading.Thread(target=lambda: hashed.setdefault("checksum", asyncio.run(weights.checksum()).checksum))
    hasher.start()
    for _ in range(10):  # well inside the first pass
        assert sections.acquire(timeout=30)
    with lock.write(), torch.no_grad():
        next(model.parameters()).copy_(changed)
    hasher.join(timeout=60)
    assert hashed["checksum"] == checksum_module(model).checksum == weights.held.checksum


def test_a_change_that_opens_its_stage_ends_a_copy_at_its_next_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy ends when a change begins, not at the change's swap: the swap then finds no reader
    in a section to wait for."""
    monkeypatch.setattr("miles.engine.weights.live.READ_SECTION_BYTES", 64)
    model = build_model("tiny", seed=3)
    lock = WeightsLock()
    writes = lock.writes
    lock.announce()
    with pytest.raises(ConflictError, match="changed while they were read"):
        copy_weights(model, lock, writes=writes, what="weights 1")


def announced_stage(lock: WeightsLock, model: torch.nn.Module) -> LiveStage:
    """A change's stage as the engine opens one: announced, withdrawn once it is closed."""
    lock.announce()
    stage = LiveStage(model)
    stage.when_closed(lock.withdraw)
    return stage


def swap_soon(lock: WeightsLock, stage: LiveStage) -> None:
    """Activate ``stage`` under the write lock a little later, as a change's swap does."""
    time.sleep(0.1)
    stage.checksum()
    with lock.write():
        stage.activate()


def test_a_long_read_starts_once_the_announced_change_swapped_or_was_withdrawn() -> None:
    model = build_model("tiny", seed=3)
    lock = WeightsLock()
    assert lock.wait_for_no_change(0.0)
    stage = announced_stage(lock, model)
    started = time.monotonic()
    assert not lock.wait_for_no_change(0.2)  # bounded: a change left open does not stop reads for good
    assert time.monotonic() - started >= 0.2
    stage.discard()
    assert lock.wait_for_no_change(0.0)

    for end in (swap_soon, lambda lock, stage: (time.sleep(0.1), stage.discard())):
        stage = announced_stage(lock, model)
        ender = threading.Thread(target=end, args=(lock, stage))
        ender.start()
        assert lock.wait_for_no_change(30)
        ender.join()
    assert lock.wait_for_no_change(0.0)


def exporting(model: torch.nn.Module, lock: WeightsLock, snapshot_dir: Path) -> LiveWeights:
    """The live weights of ``model`` as an engine holds them, exported under ``snapshot_dir``."""
    return LiveWeights(
        lock=lock,
        model=lambda: model,
        tokenizer=build_tokenizer(),
        served_model_name="tiny",
        snapshot_dir=snapshot_dir,
        version="1",
        loaded_from=Path("."),
        manifest_checksum=None,
    )


async def test_an_export_waits_for_a_change_under_way_and_refuses_one_left_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export asked while a change's stage is open starts once the change swapped (so that the
    swap never waits for the export's reads); a change left open longer gets a 409 that says so."""
    monkeypatch.setattr("miles.engine.weights.live.EXPORT_WAITS_FOR_CHANGE_S", 0.5)
    model = build_model("tiny", seed=3)
    lock = WeightsLock()
    weights = exporting(model, lock, tmp_path)
    await weights.checksum()  # recorded, as an engine records it before it serves
    stage = announced_stage(lock, model)
    with pytest.raises(ConflictError, match="weight change has been under way"):
        await weights.export(ExportWeightsRequest(step=1))

    swapper = threading.Thread(target=swap_soon, args=(lock, stage))
    swapper.start()
    exported = await weights.export(ExportWeightsRequest(step=1))
    swapper.join()
    assert exported.success and exported.checksum == checksum_module(model).checksum


def test_an_export_without_room_on_disk_is_refused_with_507_and_says_where(tmp_path: Path) -> None:
    target = tmp_path / "not-made-yet" / "snapshots"  # the export makes it: its ancestor is measured
    _require_room(target, 1)
    with pytest.raises(InsufficientStorageError) as refused:
        _require_room(target, shutil.disk_usage(tmp_path).free + 2**30)
    assert str(target) in str(refused.value) and "--snapshot-dir" in str(refused.value)
    assert status_of(refused.value) == (507, "insufficient_storage")
    assert not target.exists()


async def test_an_export_already_written_is_answered_on_a_full_disk_and_a_new_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sealed snapshot of the weights held is reused without a copy, so it needs no room; other
    weights on the same full disk get the 507."""
    model = build_model("tiny", seed=3)
    weights = exporting(model, WeightsLock(), tmp_path)
    await weights.checksum()
    first = await weights.export(ExportWeightsRequest(step=1))
    written = times_written(Path(first.path))

    monkeypatch.setattr(shutil, "disk_usage", lambda _path: shutil._ntuple_diskusage(2**40, 2**40, 0))  # type: ignore[attr-defined]
    again = await weights.export(ExportWeightsRequest(step=2))
    assert again == first
    assert times_written(Path(first.path)) == written

    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    await weights.checksum()
    with pytest.raises(InsufficientStorageError, match="no room to write the weights"):
        await weights.export(ExportWeightsRequest(step=3))
    assert list(times_written(tmp_path)) == [first.path]


def times_written(directory: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in directory.iterdir()}


async def test_an_export_holds_no_view_of_the_live_weights_between_its_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A swap refuses while a tensor it does not know views the live memory (it would go on
    serving the old weights): an export paused between two of its slices holds no such view."""
    monkeypatch.setattr("miles.engine.weights.live.READ_SECTION_BYTES", 4096)
    model = build_model("tiny", seed=3)
    memory = WeightMemory.of(model)
    assert memory.unknown_viewers() == []
    lock = WeightsLock()
    weights = exporting(model, lock, tmp_path)
    await weights.checksum()
    between, go_on = threading.Event(), threading.Event()
    read, sections = lock.read, itertools.count()

    @contextlib.contextmanager
    def pausing() -> Iterator[None]:
        with read():
            yield
        if next(sections) == 3:  # inside the copy, between two slices
            between.set()
            go_on.wait(30)

    monkeypatch.setattr(lock, "read", pausing)
    export = asyncio.create_task(weights.export(ExportWeightsRequest(step=1)))
    try:
        assert await asyncio.to_thread(between.wait, 30)
        gc.collect()
        assert memory.unknown_viewers() == []
    finally:
        go_on.set()
    assert (await export).success

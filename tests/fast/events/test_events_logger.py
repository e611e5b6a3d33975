"""EventLogger writes whole lines from many threads and tasks, notifies listeners, reads logs back."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import re
import socket
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from miles.errors import EventLogError, EventTypeMismatchError, EventValidationError
from miles.utils.audit_utils.event_logger import (
    Event,
    EventLogger,
    EventSource,
    InferenceEngineWeightChecksumEvent,
    LockAcquiredEvent,
    LockReleasedEvent,
    iter_logged_events,
    parse_event,
    read_events,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def lock_event(token: int, *, seconds: float = 0.0, holder: str = "h") -> dict[str, object]:
    return {"lock_name": "L", "holder": holder, "token": token, "waited_s": 0.0, "timestamp": at(seconds)}


def file_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


# --- writing -------------------------------------------------------------------------------------


def test_seed_log_call_writes_one_line(tmp_path: Path) -> None:
    with EventLogger(tmp_path) as logger:
        event = InferenceEngineWeightChecksumEvent(model_name="gpt-xyz", checksum="abc123def456", step=42)
        logged = logger.log(InferenceEngineWeightChecksumEvent, event, print_log=False)

        assert logged is event
        assert logger.path is not None and logger.path.parent == tmp_path
        assert file_lines(logger.path) == [event.model_dump_json()]
        assert logger.events == (event,)
    assert read_events(tmp_path) == [event]


def test_file_name_names_host_and_pid_and_the_directory_is_created(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "b"
    with EventLogger(directory) as first, EventLogger(directory) as second:
        assert first.path is not None and second.path is not None
        assert first.path != second.path
        assert directory.is_dir()
        for path in (first.path, second.path):
            assert path.suffix == ".jsonl"
            assert str(os.getpid()) in path.name
            assert re.sub(r"[^A-Za-z0-9._-]+", "_", socket.gethostname()) in path.name


def test_log_from_a_dict_fills_type_and_source(tmp_path: Path) -> None:
    with EventLogger(tmp_path, component="controller", source_id="ctl-1") as logger:
        logged = logger.log(
            InferenceEngineWeightChecksumEvent,
            {"model_name": "m", "checksum": "c", "step": 3, "role": "confirmed", "server_id": "s0"},
            print_log=False,
        )
        with_type = logger.log(LockAcquiredEvent, {"type": "lock_acquired", **lock_event(1)}, print_log=False)
        explicit_source = logger.log(
            LockAcquiredEvent, {**lock_event(2), "source": {"component": "x", "id": "y"}}, print_log=False
        )

    assert isinstance(logged, InferenceEngineWeightChecksumEvent)
    assert logged.source == EventSource(component="controller", id="ctl-1")
    assert logged.server_id == "s0"
    assert with_type.token == 1
    assert explicit_source.source == EventSource(component="x", id="y")
    assert [item.event for item in iter_logged_events(tmp_path)] == [logged, with_type, explicit_source]


def test_source_id_defaults_to_host_and_pid() -> None:
    logger = EventLogger(None, component="trainer")
    logged = logger.log(LockAcquiredEvent, lock_event(1), print_log=False)
    assert logged.source == EventSource(component="trainer", id=f"{socket.gethostname()}:{os.getpid()}")


def test_invalid_dict_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    with EventLogger(tmp_path) as logger:
        with pytest.raises(EventValidationError, match="step"):
            logger.log(InferenceEngineWeightChecksumEvent, {"model_name": "m", "checksum": "c"}, print_log=False)
        with pytest.raises(EventValidationError, match="lock_released"):
            logger.log(LockReleasedEvent, {"type": "lock_acquired", **lock_event(1)}, print_log=False)
        assert logger.path is not None and logger.path.read_bytes() == b""


def test_wrong_event_class_is_refused(tmp_path: Path) -> None:
    event = InferenceEngineWeightChecksumEvent(model_name="m", checksum="c", step=1)
    with EventLogger(tmp_path) as logger:
        with pytest.raises(EventTypeMismatchError, match="LockAcquiredEvent") as raised:
            logger.log(LockAcquiredEvent, event, print_log=False)  # type: ignore[arg-type]
        assert isinstance(raised.value, TypeError)
        with pytest.raises(EventTypeMismatchError, match="not an event model"):
            logger.log(dict, {"a": 1}, print_log=False)  # type: ignore[arg-type]
        assert logger.path is not None and logger.path.read_bytes() == b""
        assert logger.events == ()


def test_print_log_writes_a_compact_info_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    event = InferenceEngineWeightChecksumEvent(model_name="gpt-xyz", checksum="abc123def4567890", step=42)
    with caplog.at_level(logging.INFO, logger="miles.events"), EventLogger(tmp_path) as logger:
        logger.log(InferenceEngineWeightChecksumEvent, event, print_log=False)
        assert caplog.records == []
        logger.log(InferenceEngineWeightChecksumEvent, event)

    [record] = caplog.records
    assert record.name == "miles.events" and record.levelno == logging.INFO
    assert record.getMessage() == "inference_engine_weight_checksum model_name=gpt-xyz step=42 published abc123def456…"


def test_memory_only_logger_keeps_events_and_calls_listeners() -> None:
    seen: list[Event] = []
    with EventLogger(None, memory_limit=2) as logger:
        logger.subscribe(seen.append)
        events = [logger.log(LockAcquiredEvent, lock_event(token), print_log=False) for token in range(3)]

        assert logger.path is None
        assert seen == events
        assert logger.events == tuple(events[1:])


def test_fsync_mode_writes_durably(tmp_path: Path) -> None:
    with EventLogger(tmp_path, fsync=True) as logger:
        logger.log(LockAcquiredEvent, lock_event(1), print_log=False)
    assert [event.token for event in read_events(tmp_path)] == [1]  # type: ignore[union-attr]


def _log_from_child(logger: EventLogger) -> None:
    logger.log(LockAcquiredEvent, {**lock_event(2, seconds=2), "holder": "child"}, print_log=False)


def test_a_forked_child_writes_its_own_file(tmp_path: Path) -> None:
    with EventLogger(tmp_path) as logger:
        logger.log(LockAcquiredEvent, {**lock_event(1, seconds=1), "holder": "parent"}, print_log=False)
        child = multiprocessing.get_context("fork").Process(target=_log_from_child, args=(logger,))
        child.start()
        child.join(timeout=30)
        assert child.exitcode == 0
        logger.log(LockAcquiredEvent, {**lock_event(3, seconds=3), "holder": "parent"}, print_log=False)

    assert len(list(tmp_path.glob("*.jsonl"))) == 2
    assert logger.path is not None
    events = read_events(tmp_path)
    assert [event.holder for event in events] == ["parent", "child", "parent"]  # type: ignore[union-attr]
    parent_lines = [parse_event(line) for line in file_lines(logger.path)]
    assert [event.holder for event in parent_lines] == ["parent", "parent"]  # type: ignore[union-attr]
    assert events[1].source.id == f"{socket.gethostname()}:{child.pid}"
    assert events[0].source.id == f"{socket.gethostname()}:{os.getpid()}"


def test_a_closed_logger_refuses_to_log(tmp_path: Path) -> None:
    logger = EventLogger(tmp_path)
    logger.close()
    logger.close()
    with pytest.raises(EventLogError, match="closed"):
        logger.log(LockAcquiredEvent, lock_event(1), print_log=False)


async def test_threads_and_tasks_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    threads_n, per_thread, tasks_n, per_task = 8, 500, 50, 20
    go = threading.Event()
    seen: list[Event] = []
    logger = EventLogger(tmp_path, source_id="stress")
    logger.subscribe(seen.append)

    def thread_writer(index: int) -> None:
        go.wait()
        for token in range(per_thread):
            logger.log(LockAcquiredEvent, {**lock_event(token), "holder": f"thread-{index}"}, print_log=False)

    async def task_writer(index: int) -> None:
        await asyncio.to_thread(go.wait)
        for token in range(per_task):
            logger.log(LockAcquiredEvent, {**lock_event(token), "holder": f"task-{index}"}, print_log=False)
            await asyncio.sleep(0)  # let the other tasks interleave with this one

    threads = [threading.Thread(target=thread_writer, args=(index,)) for index in range(threads_n)]
    for thread in threads:
        thread.start()
    tasks = [asyncio.create_task(task_writer(index)) for index in range(tasks_n)]
    await asyncio.sleep(0)
    go.set()
    await asyncio.gather(*tasks)
    for thread in threads:
        await asyncio.to_thread(thread.join)
    logger.close()

    assert logger.path is not None
    lines = file_lines(logger.path)
    assert len(lines) == threads_n * per_thread + tasks_n * per_task
    parsed = [parse_event(line) for line in lines]
    assert len({event.event_id for event in parsed}) == len(parsed)
    # Listeners run under the write lock, so they see exactly the file's order.
    assert [event.event_id for event in seen] == [event.event_id for event in parsed]
    by_writer: dict[str, list[int]] = {}
    for event in parsed:
        assert isinstance(event, LockAcquiredEvent)
        by_writer.setdefault(event.holder, []).append(event.token)
    assert len(by_writer) == threads_n + tasks_n
    for holder, tokens in by_writer.items():
        expected = per_thread if holder.startswith("thread-") else per_task
        assert tokens == list(range(expected)), holder


# --- listeners -----------------------------------------------------------------------------------


def test_listeners_get_events_in_subscription_order_and_can_unsubscribe() -> None:
    calls: list[tuple[str, int]] = []
    logger = EventLogger(None)
    first = logger.subscribe(lambda event: calls.append(("first", event.token)))  # type: ignore[union-attr]
    with logger.subscribe(lambda event: calls.append(("second", event.token))):  # type: ignore[union-attr]
        logger.log(LockAcquiredEvent, lock_event(1), print_log=False)
    logger.log(LockAcquiredEvent, lock_event(2), print_log=False)
    first.close()
    first.close()
    logger.log(LockAcquiredEvent, lock_event(3), print_log=False)

    assert calls == [("first", 1), ("second", 1), ("first", 2)]


def test_a_raising_listener_does_not_break_others(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen_before: list[Event] = []
    seen_after: list[Event] = []

    def explode(event: Event) -> None:
        raise RuntimeError("listener bug")

    with EventLogger(tmp_path) as logger:
        logger.subscribe(seen_before.append)
        logger.subscribe(explode)
        logger.subscribe(seen_after.append)
        with caplog.at_level(logging.ERROR, logger="miles.events"):
            event = logger.log(LockAcquiredEvent, lock_event(1), print_log=False)
            again = logger.log(LockAcquiredEvent, lock_event(2), print_log=False)

    assert seen_before == seen_after == [event, again]
    assert read_events(tmp_path) == [event, again]
    failures = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(failures) == 2
    assert failures[0].exc_info is not None and "listener bug" in str(failures[0].exc_info[1])


def test_a_listener_may_log_in_reaction_to_an_event(tmp_path: Path) -> None:
    with EventLogger(tmp_path) as logger:

        def react(event: Event) -> None:
            if isinstance(event, LockAcquiredEvent):
                logger.log(LockReleasedEvent, {"lock_name": "L", "holder": "h", "token": event.token, "held_s": 0})

        logger.subscribe(react)
        logger.log(LockAcquiredEvent, lock_event(7), print_log=False)

    assert [event.type for event in read_events(tmp_path)] == ["lock_acquired", "lock_released"]


# --- reading -------------------------------------------------------------------------------------


def test_two_loggers_in_one_directory_read_back_in_timestamp_order(tmp_path: Path) -> None:
    with EventLogger(tmp_path, source_id="proc-a") as a, EventLogger(tmp_path, source_id="proc-b") as b:
        # Each file is in its own order; only merging by timestamp interleaves them.
        for seconds, logger in [(1, a), (2, b), (3, a), (5, a), (4, b), (6, b)]:
            logger.log(LockAcquiredEvent, lock_event(seconds, seconds=seconds), print_log=False)

    events = read_events(tmp_path)

    assert [event.token for event in events] == [1, 2, 3, 4, 5, 6]  # type: ignore[union-attr]
    assert [event.source.id for event in events] == ["proc-a", "proc-b", "proc-a", "proc-b", "proc-a", "proc-b"]
    assert len(list(tmp_path.glob("*.jsonl"))) == 2


def test_equal_timestamps_are_ordered_by_file_name_then_line(tmp_path: Path) -> None:
    same = [LockAcquiredEvent(**lock_event(token)) for token in range(4)]  # type: ignore[arg-type]
    (tmp_path / "b.jsonl").write_text(same[0].model_dump_json() + "\n" + same[1].model_dump_json() + "\n")
    (tmp_path / "a.jsonl").write_text(same[2].model_dump_json() + "\n" + same[3].model_dump_json() + "\n")
    (tmp_path / "notes.txt").write_text("not a log")

    assert read_events(tmp_path) == [same[2], same[3], same[0], same[1]]
    assert [item.event for item in iter_logged_events(tmp_path)] == [same[2], same[3], same[0], same[1]]
    assert [(logged.path.name, logged.line) for logged in iter_logged_events(tmp_path)] == [
        ("a.jsonl", 1),
        ("a.jsonl", 2),
        ("b.jsonl", 1),
        ("b.jsonl", 2),
    ]


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with EventLogger(tmp_path) as logger:
        kept = [logger.log(LockAcquiredEvent, lock_event(token), print_log=False) for token in range(2)]
        torn = logger.log(LockAcquiredEvent, lock_event(9), print_log=False)
    assert logger.path is not None
    whole = logger.path.read_bytes()
    cut = whole[: len(whole) - len(torn.model_dump_json()) // 2 - 1]  # half the last line, no newline
    logger.path.write_bytes(cut)

    with caplog.at_level(logging.WARNING, logger="miles.events"):
        events = read_events(tmp_path)

    assert events == kept
    [warning] = caplog.records
    assert "torn last line" in warning.getMessage() and f"{logger.path}:3" in warning.getMessage()


def test_a_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    event = LockAcquiredEvent(**lock_event(1))  # type: ignore[arg-type]
    (tmp_path / "x.jsonl").write_text(event.model_dump_json())

    assert read_events(tmp_path) == [event]


def test_a_corrupt_middle_line_raises_naming_file_and_line(tmp_path: Path) -> None:
    good = LockAcquiredEvent(**lock_event(1)).model_dump_json()  # type: ignore[arg-type]
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join([good, good, '{"type": "lock_acq', good]) + "\n")

    with pytest.raises(EventLogError, match=f"{path}:3") as raised:
        read_events(tmp_path)
    assert raised.value.context["line"] == 3


def test_an_invalid_last_line_that_was_fully_written_is_corruption(tmp_path: Path) -> None:
    good = LockAcquiredEvent(**lock_event(1)).model_dump_json()  # type: ignore[arg-type]
    bad = json.dumps({"type": "lock_acquired", "lock_name": "L"})
    path = tmp_path / "x.jsonl"
    path.write_text(f"{good}\n{bad}\n")

    with pytest.raises(EventLogError, match=f"{path}:2"):
        read_events(tmp_path)


def test_reading_a_missing_directory_or_a_file_fails(tmp_path: Path) -> None:
    with pytest.raises(EventLogError, match="does not exist"):
        read_events(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(EventLogError, match="not a directory"):
        read_events(tmp_path / "file")
    assert read_events(tmp_path) == []

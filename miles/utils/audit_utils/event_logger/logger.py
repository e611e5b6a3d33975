"""Write events as JSON lines to a per-process file, tell listeners about them, read logs back.

Each ``EventLogger`` appends to its own file in the log directory (host, pid, start time and a
random suffix in the name), so processes and loggers never share a file and never need to
coordinate. A log directory is read back by merging every ``*.jsonl`` file in it by timestamp.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, BinaryIO, Self, TypeVar

from miles.errors import EventLogError, EventTypeMismatchError, EventValidationError
from miles.utils.audit_utils.event_logger.models import EVENT_CLASSES, Event, EventSource, build_event, parse_event

_LOG = logging.getLogger("miles.events")

# One of the concrete event models (the members of ``Event``), not any BaseEvent: ``log`` refuses others.
_E = TypeVar("_E", bound=Event)

EventListener = Callable[[Event], None]
"""Called with each event right after it was written; must be quick and must not block."""

_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


class _LoggerState(StrEnum):
    OPEN = "open"
    CLOSED = "closed"


class _ClosedOnExit:
    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Subscription(_ClosedOnExit):
    """A listener's registration with an ``EventLogger``; ``close()`` (or leaving a ``with``)
    unsubscribes it. Closing twice is harmless."""

    __slots__ = ("_unsubscribe",)

    def __init__(self, unsubscribe: Callable[[], None]) -> None:
        self._unsubscribe = unsubscribe

    def close(self) -> None:
        """Stop delivering events to the listener (an event being delivered may still arrive)."""
        self._unsubscribe()


class EventLogger(_ClosedOnExit):
    """Record events: one JSON line each in this logger's own file (none for ``directory=None``),
    then every listener. Thread- and task-safe: lines are written whole, and listeners see events
    in file order.

    ``log`` writes on the caller's thread, the controller's loop included, by design: a flushed
    line costs microseconds, less than a hop to a worker thread, and writing it where the event
    happens keeps the file in the order of the state changes. ``fsync=True`` (``events_fsync``)
    waits for the disk as well, on the loop (``tests/blocking/no_blocking.py`` allows exactly these).
    """

    def __init__(
        self,
        directory: str | Path | None,
        *,
        component: str = "miles",
        source_id: str | None = None,
        fsync: bool = False,
        memory_limit: int = 10_000,
    ) -> None:
        """Open a new log file in ``directory`` (EventLogError if it cannot); ``memory_limit`` bounds ``events``."""
        self._component = component
        self._source_id = source_id
        self._source = self._make_source()
        self._fsync = fsync
        self._directory = None if directory is None else Path(directory)
        self._pid = os.getpid()
        # Reentrant so that a listener may itself log (say, a mismatch event in reaction to a
        # checksum event) without deadlocking on the lock held around dispatch.
        self._lock = threading.RLock()
        self._listeners: dict[int, EventListener] = {}
        self._listener_keys = itertools.count()
        self._recent: deque[Event] = deque(maxlen=memory_limit)
        self._state = _LoggerState.OPEN
        self._file: BinaryIO | None = None
        self._path: Path | None = None
        if self._directory is not None:
            self._path, self._file = self._open_file(self._directory)

    @property
    def path(self) -> Path | None:
        """The file this logger appends to, or None when it keeps events in memory only."""
        return self._path

    @property
    def events(self) -> tuple[Event, ...]:
        """The most recent events this logger logged (at most ``memory_limit``), oldest first."""
        with self._lock:
            return tuple(self._recent)

    def log(self, event_cls: type[_E], event: _E | Mapping[str, Any], *, print_log: bool = True) -> _E:
        """Write ``event`` (an ``event_cls``, or a dict of its fields whose ``source`` defaults to
        this logger's), flushed before listeners run; returns it as written. A listener that
        raises is logged and skipped.

        Raises:
            EventTypeMismatchError: ``event_cls`` is not an event model, or ``event`` is not one.
            EventValidationError: the dict does not fit ``event_cls``.
            EventLogError: the logger is closed, or the line could not be written.
        """
        if self._pid != os.getpid():
            self._follow_fork()
        record = self._coerce(event_cls, event)
        line = (record.model_dump_json() + "\n").encode()
        with self._lock:
            if self._state is _LoggerState.CLOSED:
                raise EventLogError("event logger is closed", event_type=record.type, path=_display(self._path))
            self._write(line)
            self._recent.append(record)
            listeners = tuple(self._listeners.values())
            # Dispatch under the lock: that is what makes every listener see events in file order.
            for listener in listeners:
                self._notify(listener, record)
        if print_log:
            _LOG.info("%s", _describe(record))
        return record

    def subscribe(self, listener: EventListener) -> Subscription:
        """Call ``listener`` with every event logged from now on, after earlier subscribers."""
        with self._lock:
            key = next(self._listener_keys)
            self._listeners[key] = listener
        return Subscription(lambda: self._unsubscribe(key))

    def close(self) -> None:
        """Flush and close the file; later ``log`` calls raise. Closing twice is harmless."""
        with self._lock:
            if self._state is _LoggerState.CLOSED:
                return
            self._state = _LoggerState.CLOSED
            self._listeners.clear()
            if self._file is not None:
                self._file.close()

    def _make_source(self) -> EventSource:
        if self._source_id is None:
            return EventSource.of_this_process(self._component)
        return EventSource(component=self._component, id=self._source_id)

    def _follow_fork(self) -> None:
        """Give a forked child its own file (and source id): processes must never share a file."""
        with self._lock:
            if self._pid == os.getpid():
                return  # another thread of this child got here first
            self._pid = os.getpid()
            self._source = self._make_source()
            if self._state is _LoggerState.CLOSED or self._directory is None:
                return
            if self._file is not None:
                # Closes only the child's copy of the descriptor; the parent keeps writing. Nothing
                # is left in the buffer to flush into the parent's file: every write is flushed
                # under the lock, and the lock was free when this child was forked.
                self._file.close()
            self._path, self._file = self._open_file(self._directory)

    def _coerce(self, event_cls: type[_E], event: _E | Mapping[str, Any]) -> _E:
        if event_cls not in EVENT_CLASSES:
            raise EventTypeMismatchError(
                "not an event model", event_cls=getattr(event_cls, "__name__", repr(event_cls))
            )
        if isinstance(event, Mapping):
            return build_event(event_cls, {"source": self._source, **event})
        if type(event) is not event_cls:
            raise EventTypeMismatchError(
                f"logged as {event_cls.__name__} but is a {type(event).__name__}",
                expected=event_cls.__name__,
                actual=type(event).__name__,
            )
        return event

    def _open_file(self, directory: Path) -> tuple[Path, BinaryIO]:
        host = _UNSAFE_FILE_CHARS.sub("_", socket.gethostname()) or "host"
        started = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        # The random suffix keeps two loggers of one process (same host, pid and microsecond)
        # apart; the rest of the name is for the humans listing the directory.
        name = f"events-{host}-{os.getpid()}-{started}-{uuid.uuid4().hex[:8]}.jsonl"
        path = directory / name
        try:
            directory.mkdir(parents=True, exist_ok=True)
            handle = open(path, "ab")
            if self._fsync:
                _fsync_directory(directory)
        except OSError as exc:
            raise EventLogError("cannot create event log file", path=str(path), error=str(exc)) from exc
        return path, handle

    def _write(self, line: bytes) -> None:
        if self._file is None:
            return
        try:
            self._file.write(line)
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
        except OSError as exc:
            raise EventLogError("cannot write event", path=_display(self._path), error=str(exc)) from exc

    def _notify(self, listener: EventListener, event: Event) -> None:
        try:
            listener(event)
        except Exception:  # noqa: BLE001  # logged with its traceback below
            # A listener is someone else's code: its failure must neither lose the event for the
            # other listeners nor fail the caller that logged it.
            _LOG.exception("event listener %r failed on %s %s", listener, event.type, event.event_id)

    def _unsubscribe(self, key: int) -> None:
        with self._lock:
            self._listeners.pop(key, None)


def _describe(event: Event) -> str:
    """One compact line for humans: type, model, server, step, version, payload summary."""
    fields = ("model_name", "server_id", "step", "weight_version")
    named = [f"{field}={value}" for field in fields if (value := getattr(event, field, None)) is not None]
    return " ".join(filter(None, [event.type, *named, event.summary()]))


def _fsync_directory(directory: Path) -> None:
    """Make a newly created file's directory entry durable, not only its contents."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _display(path: Path | None) -> str | None:
    """A path as error context: plain text, so the rendered message reads '/a/b', not PosixPath."""
    return None if path is None else str(path)


# --- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    """An event read from a log, with where it was read from."""

    event: Event
    path: Path
    line: int


def iter_logged_events(directory: str | Path) -> Iterator[LoggedEvent]:
    """Yield the events of every ``*.jsonl`` file in ``directory``: files by name, lines in order.
    A last line without a newline that does not parse (a write torn by a crash) is skipped.

    Raises:
        EventLogError: the directory is missing or unreadable, or another line is not a valid
            event (named by file and line number).
    """
    for path in _log_files(Path(directory)):
        yield from _read_file(path)


def read_events(directory: str | Path) -> list[Event]:
    """Every event in ``directory`` by timestamp, then file and line; raises as ``iter_logged_events``."""
    logged = sorted(iter_logged_events(directory), key=lambda item: (item.event.timestamp, item.path.name, item.line))
    return [item.event for item in logged]


def _log_files(directory: Path) -> list[Path]:
    if not directory.exists():
        raise EventLogError("event log directory does not exist", path=str(directory))
    if not directory.is_dir():
        raise EventLogError("event log path is not a directory", path=str(directory))
    try:
        return sorted(path for path in directory.glob("*.jsonl") if path.is_file())
    except OSError as exc:
        raise EventLogError("cannot list event log directory", path=str(directory), error=str(exc)) from exc


def _read_file(path: Path) -> Iterator[LoggedEvent]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EventLogError("cannot read event log file", path=str(path), error=str(exc)) from exc
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            event = parse_event(raw)
        except EventValidationError as exc:
            # After the final newline comes either b"" (the file ends cleanly) or the unterminated
            # tail of a write that a crash cut short.
            if number == len(lines):
                _LOG.warning(
                    "skipping torn last line %s:%d (%d bytes without a newline; a write cut short)",
                    path,
                    number,
                    len(raw),
                )
                return
            raise EventLogError(
                f"corrupt event log line {path}:{number}", path=str(path), line=number, errors=exc.context.get("errors")
            ) from exc
        yield LoggedEvent(event, path, number)

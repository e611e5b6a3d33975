"""Bounds on an HTTP server's connections: a request head must arrive in time, and open
connections are capped, with stalled ones closed first to make room (docs/SECURITY.md).

uvicorn (0.54, httptools) arms a timer only once a response completes, and any byte received
cancels it: 1500 clients sending part of a head, then a byte every few seconds, held 1500
descriptors after 75 s. ``limit_concurrency`` answers 503 only once a head is complete.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Generic, TypeVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from miles.errors import MilesError
from miles.utils.http import error_body

logger = logging.getLogger("miles.connections")

T = TypeVar("T")

# Answered connections (408, 503) are half-closed and read until the client leaves, at most this
# long: closing a socket with unread input resets it, and the reset can destroy the answer before
# the client reads it. At most MAX_CLOSING of them linger; past that the oldest is closed at once.
LINGER_S = 2.0
MAX_CLOSING = 64


class Phase(Enum):
    """What one connection is doing, as far as its limits are concerned."""

    HEAD = "head"  # no request running: waiting for a head, or reading one (its deadline runs)
    REQUEST = "request"  # a head is complete and its request runs (pipelined ones queue behind it)
    IDLE = "idle"  # keep-alive between requests, nothing of the next head yet (uvicorn's timer runs)
    CLOSING = "closing"  # answered (408, 503) and half-closed; not counted against the cap


# The one table of allowed moves. HEAD -> IDLE: the bytes that ended IDLE were the rest of an
# answered request's body. REQUEST -> REQUEST: a pipelined head completed during a request, or a
# response completed with another one queued. CLOSING is entered only through ``closing``.
_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.HEAD: frozenset({Phase.REQUEST, Phase.IDLE}),
    Phase.REQUEST: frozenset({Phase.REQUEST, Phase.IDLE}),
    Phase.IDLE: frozenset({Phase.HEAD}),
    Phase.CLOSING: frozenset(),
}
# Whom a full table closes to admit a newcomer: a stalled head before a pooled idle connection,
# the oldest of each first. A running request is never closed for room.
_EVICTABLE = (Phase.HEAD, Phase.IDLE)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """How long a head may take, and how many connections a server holds at once."""

    head_timeout_s: float
    max_connections: int

    def __post_init__(self) -> None:
        if not self.head_timeout_s > 0:
            raise MilesError(
                "head_timeout_s must be a positive number of seconds; 10 gives slow clients ample time",
                head_timeout_s=self.head_timeout_s,
            )
        if self.max_connections < 1:
            raise MilesError(
                "max_connections must be at least 1; keep it well under the file-descriptor limit (ulimit -n)",
                max_connections=self.max_connections,
            )


@dataclass(frozen=True, slots=True)
class Eviction(Generic[T]):
    """A connection to close now, and what it was doing (which says whether it is told why)."""

    member: T
    was: Phase


@dataclass(frozen=True, slots=True)
class Admission(Generic[T]):
    """Whether a newcomer is served (else it is refused, already CLOSING), and whom to close for it."""

    admitted: bool
    evicts: Eviction[T] | None = None


class ConnectionTable(Generic[T]):
    """The phases of one server's connections, each in the order its members entered it: pure
    bookkeeping (no sockets, no clock) that decides whom to close. At most ``max_connections`` are
    HEAD, REQUEST or IDLE, at most ``max_closing`` CLOSING. Runs on the server's loop only."""

    def __init__(self, *, max_connections: int, max_closing: int = MAX_CLOSING) -> None:
        self.max_connections = max_connections
        self.max_closing = max_closing
        # Dicts as ordered sets: the first key is the member longest in that phase.
        self._members: dict[Phase, dict[T, None]] = {phase: {} for phase in Phase}
        self._phase: dict[T, Phase] = {}

    def __len__(self) -> int:
        """The connections counted against the cap (every phase but CLOSING)."""
        return len(self._phase) - len(self._members[Phase.CLOSING])

    def __contains__(self, member: object) -> bool:
        return member in self._phase

    def count(self, phase: Phase) -> int:
        return len(self._members[phase])

    def phase(self, member: T) -> Phase:
        """``member``'s phase; CLOSING for one the table no longer holds (it is being closed)."""
        return self._phase.get(member, Phase.CLOSING)

    def admit(self, member: T) -> Admission[T]:
        """Enter a new connection: HEAD while there is room or one to close for it, else CLOSING."""
        evicts: Eviction[T] | None = None
        if len(self) >= self.max_connections:
            victim = next((self._oldest(phase) for phase in _EVICTABLE if self._members[phase]), None)
            if victim is None:
                return Admission(admitted=False, evicts=self.closing(member))
            evicts = Eviction(victim, self._phase[victim])
            self.remove(victim)
        self._enter(member, Phase.HEAD)
        return Admission(admitted=True, evicts=evicts)

    def move(self, member: T, to: Phase) -> None:
        """Record ``member``'s move to ``to`` (a member no longer held stays out). Raises MilesError
        for a move the table does not allow (a bug in the protocol)."""
        was = self._phase.get(member)
        if was is None:
            return
        if to not in _NEXT[was]:
            raise MilesError("illegal connection phase change", was=was.value, to=to.value)
        del self._members[was][member]
        self._enter(member, to)

    def closing(self, member: T) -> Eviction[T] | None:
        """Move ``member`` to CLOSING; returns the oldest closing one to close past ``max_closing``."""
        if member in self._phase:
            del self._members[self._phase.pop(member)][member]
        self._enter(member, Phase.CLOSING)
        if self.count(Phase.CLOSING) <= self.max_closing:
            return None
        oldest = self._oldest(Phase.CLOSING)
        self.remove(oldest)
        return Eviction(oldest, Phase.CLOSING)

    def remove(self, member: T) -> None:
        """Forget ``member`` (its connection was lost or is being closed); a no-op when it is not held."""
        phase = self._phase.pop(member, None)
        if phase is not None:
            del self._members[phase][member]

    def _enter(self, member: T, phase: Phase) -> None:
        self._phase[member] = phase
        self._members[phase][member] = None

    def _oldest(self, phase: Phase) -> T:
        return next(iter(self._members[phase]))


def connection_cap(requested: int, *, fd_limit: int) -> int:
    """The cap a server can keep: ``requested``, lowered to half the process's descriptor limit
    (``fd_limit``, the soft ``RLIMIT_NOFILE``; ``resource.RLIM_INFINITY`` for none). The other half
    is for what else the process opens: upstream connections, logs, checkpoint files."""
    if fd_limit == resource.RLIM_INFINITY or fd_limit < 0:
        return requested
    return max(1, min(requested, fd_limit // 2))


def guarded_http(limits: ConnectionLimits, *, server: str) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for one server's ``uvicorn.Config(http=...)``, its connections sharing
    one ConnectionTable; ``server`` names it in the log. The cap is lowered (with a warning) to
    what ``connection_cap`` allows."""
    fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cap = connection_cap(limits.max_connections, fd_limit=fd_limit)
    if cap < limits.max_connections:
        logger.warning(
            "%s: holding at most %d connections, not %d: the file-descriptor limit (ulimit -n) is %d; raise it "
            "to hold more",
            server,
            cap,
            limits.max_connections,
            fd_limit,
        )
    table: ConnectionTable[GuardedHttpToolsProtocol] = ConnectionTable(max_connections=cap)

    class ServerHttpProtocol(GuardedHttpToolsProtocol):
        _table = table
        _limits = limits

    return ServerHttpProtocol


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head deadline and a connection cap, bound to a server's
    table and limits by ``guarded_http``. Callbacks run on the server's loop: the table needs no lock."""

    _table: ClassVar[ConnectionTable[GuardedHttpToolsProtocol]]
    _limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Runs whenever the connection is HEAD (the head's deadline) or CLOSING (the linger).
        self._deadline: asyncio.TimerHandle | None = None

    # --- asyncio's and the parser's callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        admission = self._table.admit(self)
        _close_now(admission.evicts)
        if admission.admitted:
            self._arm(self._limits.head_timeout_s)
            return
        self._answer(
            503,
            "unavailable",
            f"the server is at its limit of {self._table.max_connections} connections, every one of them "
            "running a request; try again shortly, or raise its max_connections",
            headers=b"retry-after: 1\r\n",
        )
        self._linger()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._table.remove(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._table.phase(self) is Phase.CLOSING:
            return  # answered (or being closed): read and dropped until the client leaves
        if self._table.phase(self) is Phase.IDLE:
            # Bytes after a response: from now the connection has head_timeout_s to complete a
            # head (uvicorn cancels its keep-alive timer on any byte, so a client sending a
            # blank line every few seconds would otherwise hold it forever).
            self._move(Phase.HEAD)
        super().data_received(data)

    def on_message_begin(self) -> None:
        # IDLE here only just after on_message_complete below, in the same read.
        if self._table.phase(self) is Phase.IDLE:
            self._move(Phase.HEAD)
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._move(Phase.REQUEST)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._table.phase(self) is Phase.HEAD:
            # The bytes that ended IDLE were the rest of a body whose request was already
            # answered (an app may answer before reading it): the connection is idle again,
            # under uvicorn's keep-alive timer as after any response. A head in the same read
            # begins next (on_message_begin).
            self._move(Phase.IDLE)
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        # uvicorn started the next pipelined request, if one was queued (it is then self.cycle).
        running = self.cycle is not None and not self.cycle.response_complete
        self._move(Phase.REQUEST if running else Phase.IDLE)

    # --- deadlines and closing ----------------------------------------------------------------

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self not in self._table:
            return
        if self._table.phase(self) is Phase.CLOSING:
            self.transport.close()  # the client did not leave after its answer
            return
        _close_now(self._table.closing(self))
        self._answer(
            408,
            "invalid_request_error",
            f"the request head was not complete within {self._limits.head_timeout_s:g}s; send the request "
            "line and headers without pausing",
        )
        self._linger()

    def _close_for_room(self, was: Phase) -> None:
        """Close at once (the table let go of it to make room); a stalled head is told why."""
        self._disarm()
        if self.transport.is_closing():
            return
        if was is Phase.HEAD:
            self._answer(
                408,
                "invalid_request_error",
                "closed to make room for another client: the server is at its connection limit and this "
                "request head was not complete",
            )
        self.transport.close()

    def _linger(self) -> None:
        """After an answer (CLOSING already): half-close, read and drop until the client leaves or LINGER_S."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # The client's EOF ends the connection (eof_received returns None: the transport closes).
        self.transport.write_eof()
        self._arm(LINGER_S)

    def _answer(self, status: int, kind: str, message: str, *, headers: bytes = b"") -> None:
        """Write a whole JSON error response in the API's shape, outside any request cycle."""
        body = json.dumps(error_body(message, code=status, kind=kind)).encode()
        default = b"".join(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)
        head = f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n"
        self.transport.write(STATUS_LINE[status] + default + head.encode() + headers + b"\r\n" + body)

    def _move(self, to: Phase) -> None:
        self._table.move(self, to)
        if to is Phase.HEAD:
            self._arm(self._limits.head_timeout_s)
        else:
            self._disarm()

    def _arm(self, delay_s: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, self._deadline_passed)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


def _close_now(eviction: Eviction[GuardedHttpToolsProtocol] | None) -> None:
    if eviction is not None:
        eviction.member._close_for_room(eviction.was)

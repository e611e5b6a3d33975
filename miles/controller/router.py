"""Routing: which serving server gets a request, and waiting when none may take it yet.

Which requests wait, what a failed request excludes (an *incarnation*, one launch of a server's
process) and how many may wait: docs/ARCHITECTURE.md, "Routing and retries".
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from miles.config import RoutingPolicy
from miles.errors import ControllerBusyError, InvalidRequestError, UnavailableError
from miles.rollout.state import EngineApi, ServerSnapshot, ServerState
from miles.utils.weight_version import at_least, comparable

_MAX_SESSIONS = 10_000


class NoServerAvailableError(UnavailableError):
    """No serving server could take the request before its deadline."""


@dataclass(frozen=True)
class RouteLease:
    """A request's claim on one server; give it back with ``Router.release``."""

    model_name: str
    server_id: str
    incarnation: int
    url: str
    # Someone else runs the server: it is sent nothing of the controller's own credentials.
    attached: bool = False
    # The API its engine speaks: what shape the request must take for it.
    engine: EngineApi = "sglang"


@dataclass(frozen=True)
class Exclusion:
    """One incarnation of a server a request could not reach, and when (wall clock)."""

    server_id: str
    incarnation: int
    since: float

    @staticmethod
    def of(lease: RouteLease) -> Exclusion:
        return Exclusion(server_id=lease.server_id, incarnation=lease.incarnation, since=time.time())

    def excludes(self, server: ServerSnapshot) -> bool:
        if server.server_id != self.server_id or server.incarnation != self.incarnation:
            return False
        probe = server.last_probe
        # A probe that answered after the failure clears it: the process is alive and serving.
        return probe is None or not probe.ok or probe.at <= self.since


class Router:
    """Picks servers for requests; every method runs on the controller's event loop."""

    def __init__(
        self,
        *,
        servers: Callable[[str], list[ServerSnapshot]],
        policy: Callable[[], RoutingPolicy],
        max_waiting: Callable[[], int] = lambda: 1 << 62,
    ) -> None:
        self._servers = servers
        self._policy = policy
        self._max_waiting = max_waiting
        self._outstanding: dict[str, int] = {}
        self._sessions: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._gates: dict[str, asyncio.Event] = {}
        self._changed = asyncio.Condition()
        self._turn = itertools.count()
        self._closed: str | None = None
        self._waiting = 0
        # Seconds each model's gate has been closed in all, and since when it is closed now: an
        # update reads the difference as how long it held requests (serving blocked).
        self._blocked: dict[str, float] = {}
        self._closed_since: dict[str, float] = {}

    # --- what the controller tells the router -----------------------------------------------

    def close_gate(self, model_name: str) -> None:
        """Hold new requests for ``model_name`` (a barrier update is switching every server)."""
        gate = self._gate(model_name)
        if gate.is_set():
            self._closed_since[model_name] = time.monotonic()
        gate.clear()

    def open_gate(self, model_name: str) -> None:
        if (since := self._closed_since.pop(model_name, None)) is not None:
            self._blocked[model_name] = self._blocked.get(model_name, 0.0) + time.monotonic() - since
        self._gate(model_name).set()
        self.fleet_changed()

    def blocked_seconds(self, model_name: str) -> float:
        """How long requests for ``model_name`` have been held at its gate, in all, until now."""
        since = self._closed_since.get(model_name)
        return self._blocked.get(model_name, 0.0) + (time.monotonic() - since if since is not None else 0.0)

    def gate_open(self, model_name: str) -> bool:
        return self._gate(model_name).is_set()

    def fleet_changed(self) -> None:
        """Wake waiting requests: a server's state or version changed."""

        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(notify())

    def outstanding(self, server_id: str) -> int:
        return self._outstanding.get(server_id, 0)

    def waiting(self) -> int:
        """How many requests are waiting for a server right now."""
        return self._waiting

    def close(self, reason: str) -> None:
        """End every waiting request (503 with ``reason``) and refuse new ones: shutting down."""
        self._closed = reason
        self.fleet_changed()

    # --- per request -------------------------------------------------------------------------

    async def acquire(
        self,
        model_name: str,
        *,
        timeout_s: float,
        session_id: str | None = None,
        min_weight_version: str | None = None,
        exclude: tuple[Exclusion, ...] = (),
        engine: EngineApi | None = None,
    ) -> RouteLease:
        """Wait (up to ``timeout_s``) for a serving server that may take the request, and claim it.
        Raises NoServerAvailableError when none became available in time, or the router closed,
        and ControllerBusyError when the request would have to wait and ``max_waiting`` already do."""
        deadline = time.monotonic() + timeout_s
        waiting = False
        try:
            while True:
                if self._closed is not None:
                    raise NoServerAvailableError(self._closed, model=model_name)
                if min_weight_version is not None:
                    self._check_reachable(model_name, min_weight_version)
                gate = self._gate(model_name)
                if gate.is_set():
                    if (lease := self._claim(model_name, session_id, min_weight_version, exclude, engine)) is not None:
                        return lease
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NoServerAvailableError(
                        self._why_none(model_name, min_weight_version, gate.is_set(), engine),
                        model=model_name,
                        min_weight_version=min_weight_version,
                    )
                if not waiting:
                    if self._waiting >= (limit := self._max_waiting()):
                        raise ControllerBusyError(
                            f"{self._waiting} requests are already waiting for a server; try again "
                            "shortly, or raise the controller's max_waiting_requests "
                            "(MILES_MAX_WAITING_REQUESTS)",
                            model=model_name,
                            max_waiting_requests=limit,
                        )
                    waiting = True
                    self._waiting += 1
                await self._wait_for_change(remaining)
        finally:
            if waiting:
                self._waiting -= 1

    def try_acquire(
        self,
        model_name: str,
        *,
        session_id: str | None,
        min_weight_version: str | None,
        exclude: tuple[Exclusion, ...],
        engine: EngineApi | None = None,
    ) -> RouteLease | None:
        """A server that may take the request right now, claimed; None when none may (no waiting)."""
        if self._closed is not None or not self._gate(model_name).is_set():
            return None
        return self._claim(model_name, session_id, min_weight_version, exclude, engine)

    def release(self, lease: RouteLease) -> None:
        self._outstanding[lease.server_id] = left = self.outstanding(lease.server_id) - 1
        if left <= 0:
            del self._outstanding[lease.server_id]

    # --- internals ---------------------------------------------------------------------------

    def _gate(self, model_name: str) -> asyncio.Event:
        gate = self._gates.get(model_name)
        if gate is None:
            gate = self._gates[model_name] = asyncio.Event()
            gate.set()
        return gate

    def _claim(
        self,
        model_name: str,
        session_id: str | None,
        min_version: str | None,
        exclude: tuple[Exclusion, ...],
        engine: EngineApi | None,
    ) -> RouteLease | None:
        candidates = [
            s
            for s in self._servers(model_name)
            if s.state is ServerState.SERVING
            and s.url is not None
            and (engine is None or s.engine == engine)
            and not any(e.excludes(s) for e in exclude)
            and (min_version is None or at_least(s.weight_version, min_version))
        ]
        if not candidates:
            return None
        chosen = None
        if session_id is not None:
            bound = self._sessions.get((model_name, session_id))
            chosen = next((s for s in candidates if s.server_id == bound), None)
        if chosen is None:
            if self._policy() is RoutingPolicy.ROUND_ROBIN:
                chosen = candidates[next(self._turn) % len(candidates)]
            else:
                # Least outstanding; ties rotate so equal servers share the load.
                offset, n = next(self._turn), len(candidates)
                best = min(range(n), key=lambda i: (self.outstanding(candidates[i].server_id), (i - offset) % n))
                chosen = candidates[best]
            if session_id is not None:
                self._bind(model_name, session_id, chosen.server_id)
        assert chosen.url is not None
        self._outstanding[chosen.server_id] = self.outstanding(chosen.server_id) + 1
        return RouteLease(
            model_name=model_name,
            server_id=chosen.server_id,
            incarnation=chosen.incarnation,
            url=chosen.url,
            attached=chosen.placement is not None and chosen.placement.attached,
            engine=chosen.engine,
        )

    def _bind(self, model_name: str, session_id: str, server_id: str) -> None:
        key = (model_name, session_id)
        self._sessions[key] = server_id
        self._sessions.move_to_end(key)
        while len(self._sessions) > _MAX_SESSIONS:
            self._sessions.popitem(last=False)

    async def _wait_for_change(self, timeout_s: float) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(timeout_s, 1.0))
            except TimeoutError:
                pass  # re-check anyway: a bounded wait guards against a missed notification

    def _check_reachable(self, model_name: str, min_version: str) -> None:
        """Refuse (InvalidRequestError) a minimum version that no server of the model could meet
        by waiting: none holds it, nor an integer version when it is one. Waiting for "0" while
        every server serves "abc" would wait out the whole request timeout."""
        held = sorted({s.weight_version for s in self._servers(model_name) if s.weight_version is not None})
        if held and not any(comparable(v, min_version) for v in held):
            raise InvalidRequestError(
                f"min_weight_version {min_version!r} cannot be compared with the weight versions of model "
                f"{model_name!r} ({', '.join(map(repr, held))}): integer versions are ordered, any other label "
                "only matches itself; ask for a version the servers hold, or an integer one once they serve one",
                model=model_name,
                min_weight_version=min_version,
            )

    def _why_none(self, model_name: str, min_version: str | None, gate_open: bool, engine: EngineApi | None) -> str:
        if not gate_open:
            return f"model {model_name!r} is being updated and the update did not finish in time; retry later"
        servers = [s for s in self._servers(model_name) if engine is None or s.engine == engine]
        if not servers:
            return f"no servers for model {model_name!r}" + (f" whose engines speak {engine}'s API" if engine else "")
        states = ", ".join(f"{s.server_id}={s.state.value}@{s.weight_version}" for s in servers)
        if min_version is not None:
            return f"no serving server of {model_name!r} has weight version >= {min_version} ({states})"
        return f"no serving server for model {model_name!r} ({states}); retry later"

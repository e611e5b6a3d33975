"""Whom a full server closes to make room, and whom it refuses (ConnectionTable), from tables:
stalled heads go first, oldest first, then idle keep-alive connections; running requests never."""

from __future__ import annotations

import resource

import pytest

from miles.errors import MilesError
from miles.utils.connections import (
    Admission,
    ConnectionLimits,
    ConnectionTable,
    Eviction,
    Phase,
    connection_cap,
)

# Each connection of a full table (cap 4), in the order they connected, and the phase it is in.
# The newcomer "new" then arrives; the answer is whom the table closes for it (None: nobody),
# and whether "new" is served.
EVICTIONS = [
    pytest.param(
        [("a", Phase.HEAD), ("b", Phase.HEAD), ("c", Phase.REQUEST), ("d", Phase.IDLE)],
        Eviction("a", Phase.HEAD),
        True,
        id="the-oldest-stalled-head",
    ),
    pytest.param(
        [("a", Phase.IDLE), ("b", Phase.REQUEST), ("c", Phase.HEAD), ("d", Phase.HEAD)],
        Eviction("c", Phase.HEAD),
        True,
        id="a-stalled-head-before-an-older-idle-one",
    ),
    pytest.param(
        [("a", Phase.REQUEST), ("b", Phase.IDLE), ("c", Phase.IDLE), ("d", Phase.REQUEST)],
        Eviction("b", Phase.IDLE),
        True,
        id="the-oldest-idle-one-when-no-head-stalls",
    ),
    pytest.param(
        [("a", Phase.REQUEST), ("b", Phase.REQUEST), ("c", Phase.REQUEST), ("d", Phase.REQUEST)],
        None,
        False,
        id="nobody-when-every-one-runs-a-request",
    ),
]


def _table(members: list[tuple[str, Phase]], *, cap: int = 4, max_closing: int = 2) -> ConnectionTable[str]:
    """A table holding ``members`` in ``cap`` slots, each brought to its phase the way a protocol
    would (a connection starts HEAD; IDLE passes through REQUEST)."""
    table: ConnectionTable[str] = ConnectionTable(max_connections=cap, max_closing=max_closing)
    for name, phase in members:
        assert table.admit(name) == Admission(admitted=True)
        if phase in (Phase.REQUEST, Phase.IDLE):
            table.move(name, Phase.REQUEST)
        if phase is Phase.IDLE:
            table.move(name, Phase.IDLE)
    return table


@pytest.mark.parametrize(("members", "evicts", "admitted"), EVICTIONS)
def test_a_newcomer_at_the_cap(members: list[tuple[str, Phase]], evicts: Eviction[str] | None, admitted: bool) -> None:
    table = _table(members)
    assert table.admit("new") == Admission(admitted=admitted, evicts=evicts)
    assert len(table) == 4
    assert table.phase("new") is (Phase.HEAD if admitted else Phase.CLOSING)
    if evicts is not None:
        assert evicts.member not in table
    assert all(table.phase(name) is Phase.REQUEST for name, phase in members if phase is Phase.REQUEST)


def test_below_the_cap_every_newcomer_is_served_and_closes_nobody() -> None:
    table = _table([("a", Phase.HEAD), ("b", Phase.REQUEST), ("c", Phase.IDLE)])
    assert table.admit("d") == Admission(admitted=True)
    assert [table.count(phase) for phase in Phase] == [2, 1, 1, 0]


def test_a_head_that_begins_after_a_response_counts_from_then() -> None:
    """The order among stalled heads is when each began: an IDLE connection that starts a head is
    the youngest head, however long ago it connected."""
    table = _table([("a", Phase.IDLE), ("b", Phase.HEAD), ("c", Phase.REQUEST), ("d", Phase.REQUEST)])
    table.move("a", Phase.HEAD)
    assert table.admit("new").evicts == Eviction("b", Phase.HEAD)
    assert table.admit("newer").evicts == Eviction("a", Phase.HEAD)
    assert table.admit("newest").evicts == Eviction("new", Phase.HEAD)


def test_refused_and_timed_out_connections_are_not_counted_and_at_most_max_closing_linger() -> None:
    table = _table([(name, Phase.REQUEST) for name in "abcd"], max_closing=2)
    assert table.admit("r1") == Admission(admitted=False)
    assert table.admit("r2") == Admission(admitted=False)
    assert table.admit("r3") == Admission(admitted=False, evicts=Eviction("r1", Phase.CLOSING))
    assert (len(table), table.count(Phase.CLOSING)) == (4, 2)
    # A request ends and its connection times out on its next head: it closes, freeing its slot.
    table.move("a", Phase.IDLE)
    table.move("a", Phase.HEAD)
    assert table.closing("a") == Eviction("r2", Phase.CLOSING)
    assert len(table) == 3
    assert table.admit("fresh") == Admission(admitted=True)


def test_a_lost_connection_frees_its_slot_and_later_moves_of_a_closed_one_change_nothing() -> None:
    table = _table([(name, Phase.REQUEST) for name in "abcd"])
    table.remove("b")
    table.remove("b")
    table.move("b", Phase.IDLE)
    assert "b" not in table and table.phase("b") is Phase.CLOSING and len(table) == 3
    assert table.admit("new") == Admission(admitted=True)


@pytest.mark.parametrize(
    ("start", "to"),
    [(Phase.HEAD, Phase.HEAD), (Phase.IDLE, Phase.REQUEST), (Phase.CLOSING, Phase.HEAD), (Phase.HEAD, Phase.CLOSING)],
)
def test_moves_the_transition_table_does_not_allow_are_refused(start: Phase, to: Phase) -> None:
    if start is Phase.CLOSING:
        table: ConnectionTable[str] = ConnectionTable(max_connections=4)
        table.closing("a")
    else:
        table = _table([("a", start)])
    with pytest.raises(MilesError, match="illegal connection phase change"):
        table.move("a", to)
    assert table.phase("a") is start


@pytest.mark.parametrize(
    ("requested", "fd_limit", "cap"),
    [
        (8192, 1_048_576, 8192),
        (8192, 1024, 512),
        (100, 1024, 100),
        (8192, resource.RLIM_INFINITY, 8192),
        (8, 3, 1),
    ],
)
def test_the_cap_leaves_half_the_descriptors_for_everything_else(requested: int, fd_limit: int, cap: int) -> None:
    assert connection_cap(requested, fd_limit=fd_limit) == cap


@pytest.mark.parametrize(("timeout", "cap", "names"), [(0.0, 8, "head_timeout_s"), (1.0, 0, "max_connections")])
def test_limits_that_would_disable_the_guard_are_refused(timeout: float, cap: int, names: str) -> None:
    with pytest.raises(MilesError, match=names):
        ConnectionLimits(head_timeout_s=timeout, max_connections=cap)

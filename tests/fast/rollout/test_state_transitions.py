"""The server state machine, pair by pair: every transition the table allows is applied and
reported; every other one is refused and leaves the server as it was."""

from __future__ import annotations

import itertools

import pytest

from miles.errors import MilesError
from miles.rollout.state import TRANSITIONS, IllegalTransitionError, ServerCell, ServerState

PAIRS = list(itertools.product(ServerState, ServerState))


def test_the_table_names_every_state() -> None:
    assert set(TRANSITIONS) == set(ServerState)
    for targets in TRANSITIONS.values():
        assert targets <= set(ServerState)
    # Every state can be left for stopped, and serving is reachable only through a confirmation.
    assert all(ServerState.STOPPED in TRANSITIONS[s] for s in ServerState if s is not ServerState.STOPPED)
    assert {s for s in ServerState if ServerState.SERVING in TRANSITIONS[s]} == {
        ServerState.PENDING_WEIGHTS,
        ServerState.UPDATING,
    }


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{a.value}->{b.value}" for a, b in PAIRS])
def test_each_pair_is_applied_or_refused_as_the_table_says(source: ServerState, target: ServerState) -> None:
    cell = ServerCell(server_id="m-0", model_name="m", device="cpu", state=source, weight_version="3")
    since = cell.state_since
    if target in TRANSITIONS[source]:
        change = cell.transition(target, reason="test")
        assert (change.from_state, change.to_state, change.weight_version) == (source, target, "3")
        assert cell.state is target and cell.state_since >= since
    else:
        with pytest.raises(IllegalTransitionError, match=f"from {source.value} to {target.value}") as refused:
            cell.transition(target, reason="test")
        assert isinstance(refused.value, MilesError) and refused.value.context["server_id"] == "m-0"
        assert cell.state is source and cell.state_since == since

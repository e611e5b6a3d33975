"""Routing decisions and the health verdict, on server snapshots (pure logic, no processes)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from miles.config import RoutingPolicy
from miles.controller.health import model_health, overall
from miles.controller.router import Exclusion, NoServerAvailableError, Router
from miles.errors import InvalidRequestError
from miles.rollout.state import ProbeResult, ServerSnapshot, ServerState
from miles.testing import server_snapshot, wait_until
from miles.utils.weight_version import at_least as version_at_least


def snap(
    server_id: str,
    state: ServerState = ServerState.SERVING,
    version: str | None = "1",
    *,
    incarnation: int = 1,
    probe: ProbeResult | None = None,
) -> ServerSnapshot:
    return server_snapshot(server_id, state=state, weight_version=version, last_probe=probe, incarnation=incarnation)


def test_version_order() -> None:
    assert version_at_least("10", "9")
    assert not version_at_least("9", "10")
    assert version_at_least("abc", "abc")
    assert not version_at_least("abc", "abd")
    assert not version_at_least(None, "1")


def test_health_verdicts() -> None:
    serving = model_health("m", [snap("a"), snap("b")], accepting=True)
    assert overall({"m": serving}) == ("ok", True)
    one_down = model_health("m", [snap("a"), snap("b", ServerState.RESTARTING)], accepting=True)
    assert overall({"m": one_down}) == ("degraded", True)
    none_serving = model_health("m", [snap("a", ServerState.QUARANTINED)], accepting=True)
    assert overall({"m": none_serving}) == ("unavailable", False)
    updating = model_health("m", [snap("a", ServerState.UPDATING)], accepting=False)
    assert overall({"m": updating}) == ("updating", True)
    mixed = model_health("m", [snap("a", version="1"), snap("b", version="2")], accepting=True)
    assert mixed.weight_version is None and mixed.versions == {"1": 1, "2": 1}


async def test_least_outstanding_skips_non_serving_and_balances() -> None:
    servers = [snap("a"), snap("b"), snap("c", ServerState.UPDATING)]
    router = Router(servers=lambda _: servers, policy=lambda: RoutingPolicy.LEAST_OUTSTANDING)
    leases = [await router.acquire("m", timeout_s=1) for _ in range(4)]
    assert sorted(lease.server_id for lease in leases) == ["a", "a", "b", "b"]
    router.release(leases[0])
    assert router.outstanding(leases[0].server_id) == 1


async def test_a_closed_gate_holds_requests_until_it_opens() -> None:
    servers = [snap("a")]
    router = Router(servers=lambda _: servers, policy=lambda: RoutingPolicy.ROUND_ROBIN)
    router.close_gate("m")
    waiting = asyncio.create_task(router.acquire("m", timeout_s=5))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    router.open_gate("m")
    assert (await waiting).server_id == "a"


async def test_no_server_in_time_says_why() -> None:
    router = Router(servers=lambda _: [snap("a", ServerState.QUARANTINED)], policy=lambda: RoutingPolicy.ROUND_ROBIN)
    with pytest.raises(NoServerAvailableError, match="a=quarantined"):
        await router.acquire("m", timeout_s=0.1)
    router2 = Router(servers=lambda _: [snap("a", version="3")], policy=lambda: RoutingPolicy.ROUND_ROBIN)
    with pytest.raises(NoServerAvailableError, match=">= 4"):
        await router2.acquire("m", timeout_s=0.1, min_weight_version="4")


@pytest.mark.parametrize(
    ("held", "minimum", "refused"),
    [
        (["abc"], "0", True),  # an integer against a label: never ordered
        (["abc", "abc"], "rc-2", True),  # two labels: only equal or not
        (["3"], "abc", True),
        (["abc", "3"], "5", False),  # one server's integer version may reach it
        (["3"], "5", False),
        (["abc"], "abc", False),
        ([None], "5", False),  # nothing known yet: wait
    ],
)
async def test_a_minimum_version_no_server_could_reach_is_refused_at_once(
    held: list[str | None], minimum: str, refused: bool
) -> None:
    servers = [snap(f"s{i}", version=v) for i, v in enumerate(held)]
    router = Router(servers=lambda _: servers, policy=lambda: RoutingPolicy.ROUND_ROBIN)
    if refused:
        with pytest.raises(InvalidRequestError, match=f"min_weight_version '{minimum}' cannot be compared"):
            await router.acquire("m", timeout_s=30, min_weight_version=minimum)
    else:  # served at once, or waited for until the timeout
        with contextlib.suppress(NoServerAvailableError):
            await router.acquire("m", timeout_s=0.05, min_weight_version=minimum)


async def test_an_exclusion_names_one_incarnation_until_a_newer_probe_clears_it() -> None:
    servers = [snap("a", incarnation=1)]
    router = Router(servers=lambda _: servers, policy=lambda: RoutingPolicy.ROUND_ROBIN)
    lease = await router.acquire("m", timeout_s=1)
    router.release(lease)
    excluded = (Exclusion.of(lease),)
    # The same process, unprobed since the failure: not offered again.
    assert router.try_acquire("m", session_id=None, min_weight_version=None, exclude=excluded) is None
    waiting = asyncio.create_task(router.acquire("m", timeout_s=5, exclude=excluded))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    # The server was restarted: a new incarnation of the same id takes the request at once.
    servers[0] = snap("a", incarnation=2)
    router.fleet_changed()
    assert (await waiting).incarnation == 2
    # A probe that found the old incarnation answering after the failure clears it too.
    servers[0] = snap("a", incarnation=1, probe=ProbeResult(at=time.time() + 1, ok=True, latency_s=0.001))
    assert router.try_acquire("m", session_id=None, min_weight_version=None, exclude=excluded) is not None


async def test_closing_the_router_ends_every_waiting_request() -> None:
    router = Router(servers=lambda _: [snap("a", ServerState.RESTARTING)], policy=lambda: RoutingPolicy.ROUND_ROBIN)
    waiting = [asyncio.create_task(router.acquire("m", timeout_s=600)) for _ in range(3)]
    await wait_until(lambda: router.waiting() >= 3, what="three waiting requests", interval=0.01)
    router.close("shutting down")
    results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), timeout=5)
    assert all(isinstance(r, NoServerAvailableError) and "shutting down" in str(r) for r in results)
    assert router.waiting() == 0

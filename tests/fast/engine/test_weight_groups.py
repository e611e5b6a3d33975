"""An engine's weight-update groups over real gloo, in one process: the sender is rank 0 on a
thread, the engine's ``WeightGroups`` rank 1 (the HTTP side is tested in tests/train/test_push.py).

What is pinned here is the receive buffer's life: a bucket's tensors view the group's buffer until
they are copied out, so neither the group's next broadcast nor another group may write into it
meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from miles.engine.receiver import JOIN_GRACE_S, MAX_PENDING_JOINS, WeightGroups
from miles.errors import ConflictError, InvalidRequestError, NotFoundError
from miles.protocol.sglang_weights import (
    FLAT_LOAD_FORMAT,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
)
from miles.weights.buckets import BucketTable
from miles.weights.transport.groups import broadcast

N = 1024  # float32 elements per bucket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_request(port: int, name: str, *, timeout_s: float = 20) -> InitWeightsUpdateGroupRequest:
    """The engine's join of group ``name`` as rank 1 of 2, with rank 0's store at ``port``."""
    return InitWeightsUpdateGroupRequest(
        master_address="127.0.0.1",
        master_port=port,
        rank_offset=1,
        world_size=2,
        group_name=name,
        backend="gloo",
        timeout_s=timeout_s,
    )


class Sender:
    """Rank 0 of a two-member gloo group, formed on a thread while the engine joins."""

    def __init__(self, groups: WeightGroups, name: str) -> None:
        port = free_port()
        self.name = name
        made: dict[str, Any] = {}

        def rank0() -> None:
            store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=20))
            made["store"] = store
            made["group"] = dist.ProcessGroupGloo(dist.PrefixStore(name, store), 0, 2, timedelta(seconds=20))

        thread = threading.Thread(target=rank0)
        thread.start()
        groups.join(join_request(port, name))
        thread.join()
        self._store, self._group = made["store"], made["group"]

    def send(self, value: float) -> threading.Thread:
        """Broadcast one bucket of ``N`` floats equal to ``value``, queued now so that buckets go out
        in call order, and waited for on a thread (which ends once the engine has received it)."""
        flat = torch.full((N,), value).view(torch.uint8)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self._group.broadcast([flat], options)
        # Queued on threads of their own, two broadcasts could go out in either order, and a test
        # that waits for the first would wait for one the engine takes only later.
        thread = threading.Thread(target=lambda: work.wait(timedelta(seconds=20)))
        thread.start()
        return thread

    def request(self) -> UpdateWeightsFromDistributedRequest:
        return UpdateWeightsFromDistributedRequest(
            names=["w"], dtypes=["float32"], shapes=[[N]], group_name=self.name, timeout_s=20
        )


def unchecked(_: BucketTable) -> None:
    pass


@pytest.fixture
def groups() -> WeightGroups:
    return WeightGroups(device=torch.device("cpu"))


def test_a_buffer_being_copied_out_is_not_handed_to_the_next_group(groups: WeightGroups) -> None:
    async def scenario() -> None:
        first = Sender(groups, "first")
        sent = first.send(1.0)
        async with groups.bucket(first.request(), unchecked) as bucket:
            sent.join()
            # The pusher leaves and another group forms while the bucket is still being copied out.
            groups.destroy("first")
            second = await asyncio.to_thread(Sender, groups, "second")
            sent = second.send(2.0)
            async with groups.bucket(second.request(), unchecked) as other:
                sent.join()
                assert torch.equal(other.tensors["w"], torch.full((N,), 2.0))
            assert torch.equal(bucket.tensors["w"], torch.full((N,), 1.0))
        groups.destroy("second")

    asyncio.run(scenario())


def test_a_group_takes_buckets_in_order_into_two_buffers_in_turn(groups: WeightGroups) -> None:
    """The next bucket lands in the group's other buffer while the last one's tensors are still
    being copied out; the one after that waits for the first buffer, and none lands in a buffer
    whose tensors are still viewed."""

    async def scenario() -> None:
        sender = Sender(groups, "one")
        sent = [sender.send(1.0), sender.send(2.0), sender.send(3.0)]
        seen: list[float] = []

        async def take(hold: asyncio.Event | None) -> None:
            async with groups.bucket(sender.request(), unchecked) as bucket:
                if hold is not None:
                    await hold.wait()
                seen.append(float(bucket.tensors["w"][0]))

        hold = asyncio.Event()
        first = asyncio.create_task(take(hold))
        await asyncio.sleep(0)  # the first call holds the group's receive before the others ask
        second = asyncio.create_task(take(None))
        await asyncio.to_thread(sent[0].join)
        await asyncio.wait_for(second, timeout=20)  # its own buffer: no wait for the first
        third = asyncio.create_task(take(None))
        await asyncio.to_thread(sent[1].join)
        # The third broadcast cannot land in the buffer the first bucket's tensors still view.
        await asyncio.sleep(0.2)
        assert not third.done()
        hold.set()
        await asyncio.gather(first, third)
        for thread in sent:
            thread.join()
        assert seen == [2.0, 1.0, 3.0]
        groups.destroy("one")

    asyncio.run(scenario())


def test_a_group_left_hands_its_buffer_to_the_next_one(groups: WeightGroups) -> None:
    async def scenario() -> None:
        first = Sender(groups, "first")
        sent = first.send(1.0)
        async with groups.bucket(first.request(), unchecked) as bucket:
            sent.join()
            buffer = bucket.tensors["w"].untyped_storage().data_ptr()
        groups.destroy("first")
        second = await asyncio.to_thread(Sender, groups, "second")
        sent = second.send(2.0)
        async with groups.bucket(second.request(), unchecked) as bucket:
            sent.join()
            assert bucket.tensors["w"].untyped_storage().data_ptr() == buffer
        groups.destroy("second")

    asyncio.run(scenario())


def test_a_second_join_of_a_group_being_joined_is_refused_and_the_first_forms(groups: WeightGroups) -> None:
    port = free_port()
    made: dict[str, Any] = {}
    request = join_request(port, "raced")
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    first = threading.Thread(target=lambda: made.setdefault("answer", groups.join(request)))
    first.start()
    # The first join waits in the store for rank 0, which has not come yet: it is joining.
    prefixed = dist.PrefixStore("raced", store)
    prefixed.wait(["joined/1"])
    with pytest.raises(ConflictError, match="already joining group 'raced' at 127.0.0.1"):
        groups.join(request)
    rank0 = dist.ProcessGroupGloo(prefixed, 0, 2, timedelta(seconds=20))
    first.join()
    assert "joined group 'raced'" in made["answer"]
    flat = torch.full((N,), 3.0).view(torch.uint8)
    sent = threading.Thread(target=lambda: broadcast(rank0, [flat], timeout_s=20))
    sent.start()

    async def take() -> float:
        request = UpdateWeightsFromDistributedRequest(
            names=["w"],
            dtypes=["float32"],
            shapes=[[N]],
            group_name="raced",
            timeout_s=20,
            load_format=FLAT_LOAD_FORMAT,
        )
        async with groups.bucket(request, unchecked) as bucket:
            return float(bucket.tensors["w"][0])

    assert asyncio.run(take()) == 3.0
    sent.join()
    groups.destroy("raced")


def test_a_bucket_naming_a_tensor_twice_is_refused_before_any_byte_arrives(groups: WeightGroups) -> None:
    async def scenario() -> None:
        sender = Sender(groups, "twice")
        request = UpdateWeightsFromDistributedRequest(
            names=["w", "w"], dtypes=["float32"] * 2, shapes=[[N]] * 2, group_name="twice", timeout_s=20
        )
        # No broadcast is coming: a refusal that waited for one would take the 20 s timeout.
        with pytest.raises(InvalidRequestError, match="'w' appears twice"):
            async with asyncio.timeout(5):
                async with groups.bucket(request, unchecked):
                    pass
        sent = sender.send(4.0)
        async with groups.bucket(sender.request(), unchecked) as bucket:
            sent.join()
            assert float(bucket.tensors["w"][0]) == 4.0
        groups.destroy("twice")

    asyncio.run(scenario())


def test_a_new_group_of_a_name_forms_while_a_join_of_it_still_waits_for_a_rank_0_that_gave_up(
    groups: WeightGroups,
) -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    stale = join_request(port, "again", timeout_s=2)
    failed: list[BaseException] = []

    def join_stale() -> None:
        try:
            groups.join(stale)
        except ConflictError as exc:
            failed.append(exc)

    waiting = threading.Thread(target=join_stale)
    waiting.start()
    dist.PrefixStore("again", store).wait(["joined/1"])  # it waits for a rank 0 that never forms
    sender = Sender(groups, "again")  # the pusher's next try, at another port
    waiting.join()
    assert len(failed) == 1 and "ranks [0] never joined" in str(failed[0])

    async def take() -> float:
        sent = sender.send(5.0)
        async with groups.bucket(sender.request(), unchecked) as bucket:
            sent.join()
            return float(bucket.tensors["w"][0])

    assert asyncio.run(take()) == 5.0
    groups.destroy("again")


class SilentRank0:
    """A "rank 0" that accepts every connection to its port and never says a word: torch's store
    handshake has no time limit of its own against it."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                self._accepted.append(self._listener.accept()[0])

    def close(self) -> None:
        self._listener.close()
        for conn in self._accepted:
            conn.close()
        self._thread.join(timeout=10)


def test_a_join_whose_rank_0_never_answers_is_refused_in_bounded_time_and_leaves_nothing(
    groups: WeightGroups,
) -> None:
    silent = SilentRank0()

    async def scenario() -> None:
        started = time.monotonic()
        with pytest.raises(ConflictError, match=r"'mute' did not form within 1s: still connecting") as refused:
            await groups.join_within(join_request(silent.port, "mute", timeout_s=1))
        assert time.monotonic() - started < 1 + JOIN_GRACE_S + 2, refused.value
        # Every thread a join may hold is taken by joins still waiting on such a rank 0 (the one
        # given up on included): one more is refused at once, rather than queued behind them.
        waiting = [
            asyncio.create_task(groups.join_within(join_request(silent.port, f"mute-{i}", timeout_s=2)))
            for i in range(MAX_PENDING_JOINS - 1)
        ]
        while groups.pending_joins < MAX_PENDING_JOINS:  # noqa: ASYNC110 - threads of their own: nothing to await
            await asyncio.sleep(0.02)
        with pytest.raises(ConflictError, match="joins of weight-update groups are still waiting"):
            await asyncio.wait_for(groups.join_within(join_request(silent.port, "one-more", timeout_s=2)), 1)
        for task in waiting:
            with pytest.raises(ConflictError, match="did not form within 2s"):
                await task

    try:
        asyncio.run(scenario())
    finally:
        silent.close()  # rank 0 goes away: the joins given up on end
    deadline = time.monotonic() + 60
    while groups.pending_joins:
        assert time.monotonic() < deadline, "the joins given up on never ended"
        time.sleep(0.05)  # threads of their own: nothing to wait on
    # None of them left a group behind, and a real group forms again.
    sender = Sender(groups, "after")
    groups.destroy(sender.name)
    for name in ("mute", *(f"mute-{i}" for i in range(MAX_PENDING_JOINS - 1))):
        with pytest.raises(NotFoundError):
            groups.destroy(name)

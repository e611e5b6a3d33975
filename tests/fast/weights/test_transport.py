"""Both ends of a push's transport in one process: what the trainer encodes the engine decodes (and
nothing else), a group the trainer forms as rank 0 is joined by a member that receives its
broadcast, a member that never comes is named, and a segment's removal never deadlocks its loop.
(Pushes between processes: tests/train/test_push.py.)"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from miles.errors import ConflictError, InvalidRequestError
from miles.protocol.sglang_weights import InitWeightsUpdateGroupRequest
from miles.weights.buckets import BucketEntry, BucketTable
from miles.weights.transport import groups
from miles.weights.transport.cuda_ipc import CudaIpcHandle
from miles.weights.transport.documents import (
    CUDA_IPC_LOAD_FORMAT,
    SHM_LOAD_FORMAT,
    CudaIpcDocument,
    ShmDocument,
    decode,
)
from miles.weights.transport.segments import Segment, SegmentRef

REF = SegmentRef(pid=1, fd=3, name="miles-1-abc")
TABLE = BucketTable(
    entries=(BucketEntry(name="w", dtype="float32", shape=(2, 3), offset=64, nbytes=24, digest="0" * 32),)
)
HANDLE = CudaIpcHandle(
    device=0,
    numel=128,
    storage_offset=0,
    storage_handle="AAAA",
    storage_size_bytes=128,
    storage_offset_bytes=0,
    ref_counter_handle="AAAA",
    ref_counter_offset=0,
)


def test_what_the_trainer_encodes_the_engine_decodes() -> None:
    shm = ShmDocument(shm=REF, table=TABLE)
    assert decode(SHM_LOAD_FORMAT, [shm.encode()]) == shm
    ipc = CudaIpcDocument(cuda_ipc=HANDLE, table=TABLE)
    assert decode(CUDA_IPC_LOAD_FORMAT, [ipc.encode()]) == ipc


def test_a_document_is_decoded_only_as_its_own_format_and_whole() -> None:
    shm = ShmDocument(shm=REF, table=TABLE).encode()
    with pytest.raises(InvalidRequestError, match="pickled tensors"):
        decode(None, [shm])
    with pytest.raises(InvalidRequestError, match=r'base64 of \{"cuda_ipc": \.\.\., "table"'):
        decode(CUDA_IPC_LOAD_FORMAT, [shm])
    with pytest.raises(InvalidRequestError, match="one document"):
        decode(SHM_LOAD_FORMAT, [shm, shm])
    unsigned = BucketTable(entries=(TABLE.entries[0].model_copy(update={"digest": None}),))
    with pytest.raises(InvalidRequestError, match="'w' has no digest"):
        decode(SHM_LOAD_FORMAT, [ShmDocument(shm=REF, table=unsigned).encode()])


def member_of(rank0: groups.Rank0, *, rank: int, timeout_s: float) -> InitWeightsUpdateGroupRequest:
    return InitWeightsUpdateGroupRequest(
        master_address=rank0.address,
        master_port=rank0.port,
        rank_offset=rank,
        world_size=rank0.world,
        group_name="test",
        backend="gloo",
        timeout_s=timeout_s,
    )


def test_a_group_formed_by_rank_0_is_joined_and_broadcast_to() -> None:
    async def scenario() -> None:
        rank0 = groups.Rank0(address="127.0.0.1", world=2, group_name="test", timeout_s=20)
        joined: list[groups.Joined] = []
        member = threading.Thread(
            target=lambda: joined.append(
                groups.join(member_of(rank0, rank=1, timeout_s=20), device=torch.device("cpu"))
            )
        )
        member.start()
        try:
            group = await rank0.form("gloo")
            await asyncio.to_thread(member.join)
            received = torch.zeros(4)
            receiving = threading.Thread(target=lambda: groups.broadcast(joined[0].group, [received], timeout_s=20))
            receiving.start()
            await asyncio.to_thread(groups.broadcast, group, [torch.arange(4.0)], timeout_s=20)
            await asyncio.to_thread(receiving.join)
            assert torch.equal(received, torch.arange(4.0)) and rank0.missing() == []
        finally:
            rank0.close()

    asyncio.run(scenario())


def test_a_member_that_never_joins_is_named_on_both_sides() -> None:
    async def scenario() -> None:
        rank0 = groups.Rank0(address="127.0.0.1", world=3, group_name="test", timeout_s=1)
        try:
            with pytest.raises(ConflictError, match=r"ranks \[2\] never joined"):
                await asyncio.to_thread(groups.join, member_of(rank0, rank=1, timeout_s=1), device=torch.device("cpu"))
            assert rank0.missing() == [2]
        finally:
            rank0.close()

    asyncio.run(scenario())


def test_a_segment_collected_inside_the_loops_executor_is_closed_later_not_never() -> None:
    """A collection can run a segment's finalizer anywhere on the loop, even inside the default
    executor's ``submit`` while it holds its lock: closing it must not wait on that lock."""

    def held(segment: Segment) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{segment.ref.fd}") == f"/memfd:{segment.name} (deleted)"
        except OSError:
            return False

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(1)
        loop.set_default_executor(executor)
        segment = Segment(64)
        # Held as ``submit`` holds it when a collection interrupts it.
        with executor._shutdown_lock:
            segment.close()
        for _ in range(500):
            if not held(segment):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{segment.name} was never closed")

    asyncio.run(scenario())

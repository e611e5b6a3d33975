"""The trainer's end of a torch.distributed push: a group of its own with this process as rank 0,
joined by every engine of the window, one flat broadcast per bucket, left when the push ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from miles.errors import PublishError
from miles.protocol.sglang_weights import (
    FLAT_LOAD_FORMAT,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
)
from miles.train.engine_calls import EngineCalls
from miles.weights.buckets import BucketTable, layout, plan, regions
from miles.weights.transport import groups

GROUP_NAME = "miles_weight_push"
# How long a group-forming thread whose store was dropped is waited for (it ends at once).
_THREAD_END_S = 5.0


class DistributedPush:
    """Pushes by broadcast, keeping the host buffers buckets are packed into (faulted in once)."""

    def __init__(self, *, master_address: str, timeout_s: float, bucket_bytes: int) -> None:
        self.master_address, self.timeout_s, self.bucket_bytes = master_address, timeout_s, bucket_bytes
        self._buffers: list[torch.Tensor] = []

    def _host_buffers(self, count: int, size: int) -> list[torch.Tensor]:
        if len(self._buffers) < count or any(b.numel() < size for b in self._buffers[:count]):
            self._buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(count)]
        return self._buffers[:count]

    def close(self) -> None:
        self._buffers = []

    @contextlib.asynccontextmanager
    async def push(self, named: Mapping[str, torch.Tensor], calls: EngineCalls) -> AsyncIterator[_Broadcasts]:
        """The buckets of one push of ``named``, once every engine of ``calls`` joined this push's
        group (left when the block ends). Raises PublishError when the group does not form."""
        world = len(calls.window.servers) + 1
        rank0 = groups.Rank0(address=self.master_address, world=world, group_name=GROUP_NAME, timeout_s=self.timeout_s)
        try:
            # NCCL between GPUs when the trainer's weights are on one (the engines receive on
            # theirs), gloo between CPUs otherwise.
            device = next((t.device for t in named.values() if t.device.type == "cuda"), None)
            joined = time.perf_counter()
            group = await self._form(rank0, calls, backend="nccl" if device is not None else "gloo")
            calls.stats.spent("join", joined)
            tables = [layout(named, names) for names in plan(named, bucket_bytes=self.bucket_bytes)]
            buffers = self._host_buffers(regions(len(tables)), max(max(t.total_bytes for t in tables), 1))
            try:
                yield _Broadcasts(
                    calls=calls, tables=tables, buffers=buffers, group=group, device=device, timeout_s=self.timeout_s
                )
            finally:
                leave = DestroyWeightsUpdateGroupRequest(group_name=GROUP_NAME)
                await asyncio.gather(
                    calls.post("/destroy_weights_update_group", lambda _: leave), return_exceptions=True
                )
        finally:
            rank0.close()

    async def _form(self, rank0: groups.Rank0, calls: EngineCalls, *, backend: str) -> Any:
        """The group, formed while every engine joins it."""

        def join(index: int) -> InitWeightsUpdateGroupRequest:
            return InitWeightsUpdateGroupRequest(
                master_address=rank0.address,
                master_port=rank0.port,
                rank_offset=index + 1,
                world_size=rank0.world,
                group_name=GROUP_NAME,
                backend=backend,
                timeout_s=self.timeout_s,
            )

        joining = asyncio.create_task(calls.post("/init_weights_update_group", join, fail_fast=True))
        forming = rank0.form(backend)
        try:
            await asyncio.wait((forming, joining), return_when=asyncio.FIRST_EXCEPTION)
            refused = joining.exception() if joining.done() else None
            if refused is not None and not forming.done():
                # An engine refused to join or did not answer: the group cannot form, so say so now
                # rather than when its timeout runs out, and end the thread forming it.
                forming.add_done_callback(lambda f: f.cancelled() or f.exception())
                rank0.close()
                # Its thread ends at once now; a process that exits before it has ended aborts
                # in c10d ("terminate called without an active exception").
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.gather(forming, return_exceptions=True), timeout=_THREAD_END_S)
                raise refused
            group = await forming
        except (RuntimeError, dist.DistError):
            missing = [calls.window.servers[rank - 1].server_id for rank in rank0.missing()]
            await asyncio.gather(joining, return_exceptions=True)
            raise PublishError(
                f"the weight-update group did not form within {self.timeout_s:g}s: "
                f"{', '.join(missing) or 'no engine'} never joined"
            ) from None
        await joining
        return group


@dataclass(frozen=True)
class _Broadcasts:
    """One push's buckets, each packed into a host buffer in turn and broadcast from it."""

    calls: EngineCalls
    tables: list[BucketTable]
    buffers: list[torch.Tensor]
    group: Any  # ProcessGroupGloo or ProcessGroupNCCL
    # Where the engines receive (NCCL): the trainer's GPU; None with gloo, from host memory.
    device: torch.device | None
    timeout_s: float

    def into(self, index: int) -> torch.Tensor:
        return self.buffers[index % len(self.buffers)]

    async def send(self, index: int, packed: BucketTable, *, checksum: str | None) -> Awaitable[None]:
        request = UpdateWeightsFromDistributedRequest(
            names=[e.name for e in packed.entries],
            dtypes=[e.dtype for e in packed.entries],
            shapes=[list(e.shape) for e in packed.entries],
            digests=[e.tensor_digest().digest for e in packed.entries],
            group_name=GROUP_NAME,
            load_format=FLAT_LOAD_FORMAT,
            weight_version=self.calls.version if checksum is not None else None,
            expected_checksum=checksum,
            activate=not self.calls.window.staged,
            timeout_s=self.timeout_s,
        )
        receiving = asyncio.create_task(self.calls.post("/update_weights_from_distributed", lambda _: request))
        try:
            sent = self.into(index)[: packed.total_bytes]
            broadcasting = time.perf_counter()
            flat = sent if self.device is None else sent.to(self.device)
            await asyncio.to_thread(groups.broadcast, self.group, [flat], timeout_s=self.timeout_s)
            self.calls.stats.spent("broadcast", broadcasting)
        except BaseException:
            # The engines' answers say why, when the broadcast failed.
            await asyncio.wait([receiving])
            refused = None if receiving.cancelled() else receiving.exception()
            if refused is not None:
                raise refused from None
            raise
        # Broadcast: the buffer is free. The engines copy the bucket out while the next one comes.
        return receiving

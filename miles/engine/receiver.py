"""Weights pushed from a trainer, received: buckets handed over in memory (a shared-memory segment,
a CUDA IPC handle) or broadcast to the torch.distributed groups this engine joined, each as one
``Received`` bucket for ``WeightChanges.apply_pushed``; nothing here touches the live weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from miles.errors import ConflictError, InvalidRequestError, NotFoundError
from miles.protocol.auth import FenceState
from miles.protocol.sglang_weights import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)
from miles.weights.buckets import BucketTable, Received, unpack
from miles.weights.transport import groups
from miles.weights.transport.cuda_ipc import open_shared
from miles.weights.transport.documents import CUDA_IPC_LOAD_FORMAT, SHM_LOAD_FORMAT, CudaIpcDocument, decode
from miles.weights.transport.segments import SegmentMaps

logger = logging.getLogger("miles.engine")


def tensor_bucket(
    request: UpdateWeightsFromTensorRequest,
    check: Callable[[BucketTable], None],
    *,
    device: torch.device,
    segments: SegmentMaps,
) -> Received:
    """One bucket's tensors handed over in memory: views of a mapped shared-memory segment (sealed:
    no sender can cut it short under the engine) or of a CUDA IPC handle's memory. ``check``
    refuses the table before any byte is mapped."""
    document = decode(request.load_format, request.serialized_named_tensors)
    table = document.table
    if isinstance(document, CudaIpcDocument) and device.type != "cuda":
        raise InvalidRequestError(
            f"load_format {CUDA_IPC_LOAD_FORMAT!r} needs an engine on a GPU; this one runs on {device}: "
            f"push over shared memory ({SHM_LOAD_FORMAT!r}) from CPU tensors"
        )
    check(table)
    if isinstance(document, CudaIpcDocument):
        return unpack(table, open_shared(document.cuda_ipc, table.total_bytes))
    return unpack(table, segments.flat(document.shm, table.total_bytes))


@dataclass
class _Buffer:
    """One receive buffer of a group, kept from one bucket to the next (its pages faulted in once);
    held from a broadcast into it until its tensors are copied out."""

    device: torch.device  # where broadcasts land: the GPU with NCCL, the CPU with gloo
    memory: torch.Tensor | None = None
    in_use: asyncio.Lock = field(default_factory=asyncio.Lock)

    def flat(self, nbytes: int) -> torch.Tensor:
        if self.memory is None or self.memory.numel() < nbytes:
            self.memory = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.memory[:nbytes]


@dataclass
class _Group:
    joined: groups.Joined
    # The fencing token of the call that joined it (None: unfenced): the group lasts its window.
    owner: int | None
    # Taken in turn: the next bucket is received into one while the last one's tensors are copied
    # out of the other (a sender broadcasts it as soon as the last broadcast is done).
    buffers: tuple[_Buffer, _Buffer]
    # Held while a bucket is received: broadcasts land in the order their calls came.
    receiving: asyncio.Lock = field(default_factory=asyncio.Lock)
    turn: int = 0


# Joins that may still run at once (each on a thread of its own).
MAX_PENDING_JOINS = 4
JOIN_GRACE_S = groups.JOIN_GRACE_S


@dataclass
class _JoinState:
    """Where one join is (for the message when it is given up), whether it was, and its owner."""

    phase: str = "starting"
    abandoned: threading.Event = field(default_factory=threading.Event)
    owner: int | None = None

    def at(self, phase: str) -> None:
        self.phase = phase


class WeightGroups:
    """The torch.distributed groups this engine joined to receive weights, by name. A group joined
    by a fenced call belongs to that call's window and is left when the window closes, however it
    closes (``follow``, then ``leave``): a pusher that died mid-push never destroys its group."""

    def __init__(self, *, device: torch.device) -> None:
        self._device = device
        self._groups: dict[str, _Group] = {}
        # The fence as ``follow`` last saw it: a join whose window closed meanwhile keeps no group.
        self._fence = FenceState(fence=0, window_open=False)
        # Groups being joined, by name and rank 0's address: the same join twice is refused, while a
        # new group of a name whose last join is still waiting on a rank 0 that gave up may form.
        self._joining: set[tuple[str, str, int]] = set()
        self._lock = threading.Lock()
        # The receive buffers of the last group left, by device, for the next group that joins:
        # a pusher forms a group per update, and a fresh buffer faults every page in again.
        self._spare: dict[torch.device, list[torch.Tensor]] = {}
        self._pending = 0

    @property
    def pending_joins(self) -> int:
        """Joins whose thread still runs (given up on or not)."""
        with self._lock:
            return self._pending

    def follow(self, fence: FenceState) -> list[str]:
        """The engine's fence moved to ``fence``: the names of the groups whose window is over, for
        ``leave``. Never blocks (it runs on the event loop)."""
        with self._lock:
            # Fences only move forward, and a window that closed never opens again: a call that
            # reports an older fence changes nothing.
            seen = self._fence
            if (fence.fence, not fence.window_open) > (seen.fence, not seen.window_open):
                self._fence = fence
            return [name for name, g in self._groups.items() if self._is_over(g.owner)]

    def leave(self, names: list[str]) -> None:
        """Leave the groups ``names`` (blocking: a group's teardown joins its threads)."""
        left = []
        for name in names:
            with contextlib.suppress(NotFoundError):  # destroyed meanwhile by its pusher
                self.destroy(name)
                left.append(name)
        if left:
            logger.info("left weight-update groups %s: their window is over", ", ".join(left))

    def _is_over(self, owner: int | None) -> bool:
        """Whether the window of fencing token ``owner`` is over (call with ``_lock`` held)."""
        fence = self._fence
        return owner is not None and (owner < fence.fence or (owner == fence.fence and not fence.window_open))

    async def join_within(self, request: InitWeightsUpdateGroupRequest, *, owner: int | None = None) -> str:
        """``join`` on a thread of its own, answered within ``timeout_s`` (and a grace) whatever
        rank 0 does: torch's store handshake has no time limit, and a silent rank 0 would hold a
        thread of the shared pool. A join given up on keeps no group should it form later; past
        ``MAX_PENDING_JOINS`` still running, ConflictError. ``owner``: the fencing token."""
        state = _JoinState(owner=owner)
        with self._lock:
            if self._pending >= MAX_PENDING_JOINS:
                raise ConflictError(
                    f"{self._pending} joins of weight-update groups are still waiting on their rank 0; "
                    "try again once they end (each ends within its timeout_s, or when its rank 0 goes away)"
                )
            self._pending += 1

        def counted() -> str:
            try:
                return self.join(request, state=state)
            finally:
                with self._lock:
                    self._pending -= 1

        answer = groups.in_daemon_thread(counted, name=f"join-{request.group_name}")
        try:
            # Timing out (or being cancelled) cancels ``answer``: the join's outcome is dropped.
            return await asyncio.wait_for(answer, timeout=request.timeout_s + JOIN_GRACE_S)
        except TimeoutError:
            state.abandoned.set()
            raise groups.given_up(request, state.phase) from None
        except asyncio.CancelledError:
            state.abandoned.set()
            raise

    def join(self, request: InitWeightsUpdateGroupRequest, *, state: _JoinState | None = None) -> str:
        """Join the group (blocking); returns a message. Raises ConflictError naming the ranks that
        did not join within ``timeout_s``. ``state`` tracks the phase and whether its caller gave up."""
        state = state or _JoinState()
        groups.member_device(request, self._device)  # refused before anything else is looked at
        name = request.group_name
        joining = (name, request.master_address, request.master_port)
        with self._lock:
            if name in self._groups:
                raise ConflictError(
                    f"this engine is already in group {name!r}; destroy it first (/destroy_weights_update_group)"
                )
            if joining in self._joining:
                raise ConflictError(
                    f"this engine is already joining group {name!r} at {request.master_address}:{request.master_port}"
                )
            self._joining.add(joining)
        try:
            joined = groups.join(request, device=self._device, phase=state.at)
            with self._lock:
                if state.abandoned.is_set():  # its caller was answered already: the group goes with it
                    raise ConflictError(f"group {name!r} formed after its join was given up")
                if self._is_over(state.owner):
                    raise ConflictError(
                        f"group {name!r} formed after its training window closed; ask the controller for a new window"
                    )
                if name in self._groups:  # another join of the name formed first
                    raise ConflictError(
                        f"group {name!r} was joined meanwhile (at another rank 0); destroy it and join again"
                    )
                spare = [*self._spare.pop(joined.device, []), None, None]
                buffers = (_Buffer(joined.device, spare[0]), _Buffer(joined.device, spare[1]))
                self._groups[name] = _Group(joined, state.owner, buffers)
        finally:
            with self._lock:
                self._joining.discard(joining)
        logger.info("joined weight-update group %s as rank %d of %d", name, request.rank_offset, request.world_size)
        return f"joined group {name!r} as rank {request.rank_offset} of {request.world_size}"

    @contextlib.asynccontextmanager
    async def bucket(
        self, request: UpdateWeightsFromDistributedRequest, check: Callable[[BucketTable], None]
    ) -> AsyncIterator[Received]:
        """One bucket by broadcast from rank 0 (as SGLang: one broadcast of a flattened bucket, else
        one per tensor), its buffer held until the block ends (the next bucket is received into
        the group's other buffer meanwhile). Raises NotFoundError for an unknown group,
        InvalidRequestError for a table the model refuses (``check``, before a byte is allocated)
        or that names a tensor twice or an unknown dtype, ConflictError when the broadcast does not
        finish within ``timeout_s``."""
        with self._lock:
            member = self._groups.get(request.group_name)
        if member is None:
            raise NotFoundError(
                f"this engine is in no group {request.group_name!r}; join it first (/init_weights_update_group)"
            )
        table = groups.broadcast_table(request)
        check(table)

        def receive(buffer: _Buffer) -> Received:
            return member.joined.receive(request, table, buffer.flat(table.total_bytes))

        async with member.receiving:
            buffer = member.buffers[member.turn]
            member.turn ^= 1
            await buffer.in_use.acquire()
            try:
                received = await asyncio.to_thread(receive, buffer)
            except BaseException:
                buffer.in_use.release()
                raise
        try:
            yield received
        finally:
            buffer.in_use.release()

    def destroy(self, name: str) -> str:
        with self._lock:
            member = self._groups.pop(name, None)
            if member is not None:
                # A buffer still being received into or copied out of goes with its group.
                self._spare[member.buffers[0].device] = [
                    b.memory for b in member.buffers if b.memory is not None and not b.in_use.locked()
                ]
        if member is None:
            raise NotFoundError(f"this engine is in no group {name!r}")
        return f"left group {name!r}"

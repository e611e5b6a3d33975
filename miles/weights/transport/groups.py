"""The torch.distributed group of a push across nodes: formed by the trainer, joined by engines.

The trainer is rank 0 and serves the group's ``TCPStore`` (``Rank0``); each engine joins as rank N
(``join``), setting its key in the store, so a group that does not form names the ranks that never
came. Forming and joining block in torch, so both run on a daemon thread (``in_daemon_thread``,
``within``) that never holds up a loop's shutdown or the interpreter's exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from miles.errors import ConflictError, InvalidRequestError
from miles.protocol.sglang_weights import InitWeightsUpdateGroupRequest, UpdateWeightsFromDistributedRequest
from miles.weights.buckets import BucketEntry, BucketTable, Received, torch_dtype, unpack

T = TypeVar("T")

# How long past its ``timeout_s`` a member's join is waited for before its caller is answered.
JOIN_GRACE_S = 2.0


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now, for a group's store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def in_daemon_thread(fn: Callable[[], T], *, name: str) -> asyncio.Future[T]:
    """``fn()`` on a thread of its own, as a future of the running loop. A daemon thread, unlike
    ``asyncio.to_thread``'s executor, does not hold up the loop's shutdown (or the interpreter's
    exit) while it waits for a group that will not form. Cancelling the future gives up on it:
    whatever ``fn`` returns or raises later is dropped."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        outcome: tuple[Any, BaseException | None]
        try:
            outcome = (fn(), None)
        except BaseException as exc:  # noqa: BLE001  # handed to the awaiting task, whatever it is
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def within(fn: Callable[[], T], *, timeout_s: float, name: str) -> T:
    """``fn()`` on a daemon thread of its own, waited for at most ``timeout_s``, for a caller with no
    event loop. Raises what ``fn`` raised, or TimeoutError once ``timeout_s`` has passed."""
    answers: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()

    def run() -> None:
        try:
            answers.put((fn(), None))
        except BaseException as exc:  # noqa: BLE001  # handed to the waiting caller, whatever it is
            answers.put((None, exc))

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        result, error = answers.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"{name} did not end within {timeout_s:g}s") from None
    if error is not None:
        raise error
    return result


def _joined_key(rank: int) -> str:
    return f"joined/{rank}"


def _missing(store: dist.Store, ranks: Iterable[int]) -> list[int]:
    return [rank for rank in ranks if not store.check([_joined_key(rank)])]


def _process_group(backend: str, store: dist.Store, *, rank: int, world: int, timeout_s: float) -> Any:
    """This process as ``rank`` of a group of ``world`` formed through ``store`` (blocking until
    every rank is there, or ``timeout_s``)."""
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))


def broadcast(group: Any, tensors: Sequence[torch.Tensor], *, timeout_s: float) -> None:
    """Broadcast each of ``tensors`` from rank 0 (received in place by the others), all queued
    before the first wait. Raises RuntimeError or ``dist.DistError`` when one does not complete
    within ``timeout_s``."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = timedelta(seconds=timeout_s)
    for work in [group.broadcast([tensor], options) for tensor in tensors]:
        work.wait(timedelta(seconds=timeout_s))


# Where each tensor broadcast on its own is received in a bucket's buffer: a multiple of this, so
# every dtype views its place.
TENSOR_ALIGN = 64


def broadcast_table(request: UpdateWeightsFromDistributedRequest) -> BucketTable:
    """Where the tensors the broadcast of ``request`` will carry land in the receive buffer: back to
    back when flattened, else each at an aligned offset (one broadcast per tensor, as SGLang sends).
    Raises InvalidRequestError for a tensor named twice or a dtype torch does not know."""
    align = 1 if request.flattened() else TENSOR_ALIGN
    entries: list[BucketEntry] = []
    offset, seen = 0, set()
    digests: list[str | None] = [*request.digests] if request.digests else [None] * len(request.names)
    for name, raw_dtype, shape, digest in zip(request.names, request.dtypes, request.shapes, digests, strict=True):
        if name in seen:
            raise InvalidRequestError(f"tensor {name!r} appears twice in one bucket; name each tensor once")
        seen.add(name)
        dtype = raw_dtype.removeprefix("torch.")
        nbytes = math.prod(shape) * torch_dtype(name, raw_dtype).itemsize
        offset = -(-offset // align) * align
        entries.append(
            BucketEntry(name=name, dtype=dtype, shape=tuple(shape), offset=offset, nbytes=nbytes, digest=digest)
        )
        offset += nbytes
    return BucketTable(entries=tuple(entries))


class Rank0:
    """This process as rank 0 of a new group of ``world`` members named ``group_name``, serving the
    group's store at ``address``:``port`` until ``close``."""

    def __init__(self, *, address: str, world: int, group_name: str, timeout_s: float) -> None:
        self.address, self.world, self.timeout_s = address, world, timeout_s
        self.port = free_port(address)
        timeout = timedelta(seconds=timeout_s)
        self._server: dist.TCPStore | None = dist.TCPStore(
            address, self.port, world, True, timeout=timeout, wait_for_workers=False
        )
        # The group forms through a client of its own: dropping the server (``close``) ends at once
        # the wait of a group that cannot form (which would otherwise run out its timeout on a
        # thread, and a process exiting meanwhile aborts in c10d).
        self._store = dist.PrefixStore(group_name, dist.TCPStore(address, self.port, world, False, timeout=timeout))
        self._store.set(_joined_key(0), "1")

    def form(self, backend: str) -> asyncio.Future[Any]:
        """The group, formed on a daemon thread (``miles-push-group``) once every other rank joined;
        it fails when they have not within ``timeout_s``, or soon after ``close``."""
        return in_daemon_thread(
            lambda: _process_group(backend, self._store, rank=0, world=self.world, timeout_s=self.timeout_s),
            name="miles-push-group",
        )

    def missing(self) -> list[int]:
        return _missing(self._store, range(1, self.world))

    def close(self) -> None:
        """Stop serving the store: a group still forming through it fails at once."""
        self._server = None


def member_device(request: InitWeightsUpdateGroupRequest, device: torch.device) -> tuple[str, torch.device]:
    """The backend a member running on ``device`` joins the group of ``request`` with (by its
    lower-case name), and where it receives the group's broadcasts: its GPU with NCCL, the CPU with
    gloo. Raises InvalidRequestError for another backend, NCCL off a GPU, or a rank outside the group."""
    backend, rank, world = request.backend, request.rank_offset, request.world_size
    name = backend.lower()
    if name == "nccl" and device.type != "cuda":
        raise InvalidRequestError(
            f"backend 'nccl' needs CUDA; this engine runs on {device}: push from CPU tensors over backend 'gloo'"
        )
    if name not in ("gloo", "nccl"):
        raise InvalidRequestError(f"backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (GPU)")
    if rank >= world:
        raise InvalidRequestError(f"rank_offset {rank} is outside a group of world_size {world}")
    return name, device if name == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class Joined:
    """A member's side of a formed group; the store it formed through lives as long as the group."""

    name: str
    store: dist.Store
    group: Any  # ProcessGroupGloo or ProcessGroupNCCL
    device: torch.device  # where its broadcasts land (``member_device``)

    def receive(self, request: UpdateWeightsFromDistributedRequest, table: BucketTable, flat: torch.Tensor) -> Received:
        """The bucket of ``table`` (``broadcast_table(request)``) broadcast by rank 0 into ``flat``,
        unchecked. Raises ConflictError when the broadcast does not complete within the request's
        ``timeout_s``: the group is then of no more use."""
        tensors = [flat]
        if not request.flattened():
            tensors = [flat[e.offset : e.offset + e.nbytes].view(e.torch_dtype()).view(e.shape) for e in table.entries]
        try:
            broadcast(self.group, tensors, timeout_s=request.timeout_s)
        except (RuntimeError, dist.DistError) as exc:
            raise ConflictError(
                f"the broadcast of group {self.name!r} did not complete within {request.timeout_s:g}s "
                f"(the sender stopped or never sent): {exc}; destroy the group and push again"
            ) from None
        return unpack(table, flat.cpu())


def join(
    request: InitWeightsUpdateGroupRequest, *, device: torch.device, phase: Callable[[str], None] = lambda _: None
) -> Joined:
    """Join the group of ``request`` as its rank ``rank_offset``, from a member running on
    ``device`` (blocking; ``phase`` is told where the join is). Raises InvalidRequestError as
    ``member_device`` does, ConflictError when rank 0 cannot be reached, or the group does not form
    within ``timeout_s`` (naming who never joined)."""
    name, rank, world, timeout_s = request.group_name, request.rank_offset, request.world_size, request.timeout_s
    address, port = request.master_address, request.master_port
    backend, receives_on = member_device(request, device)
    timeout = timedelta(seconds=timeout_s)
    phase("connecting to the store of rank 0")
    try:
        store = dist.TCPStore(address, port, world, False, timeout=timeout)
    except (RuntimeError, dist.DistError) as exc:
        raise ConflictError(
            f"group {name!r} did not form: its rank 0 at {address}:{port} could not be reached "
            f"within {timeout_s:g}s ({exc})"
        ) from None
    prefixed = dist.PrefixStore(name, store)
    phase("announcing this rank in the store of rank 0")
    prefixed.set(_joined_key(rank), "1")
    phase("waiting for the other ranks to join")
    try:
        group = _process_group(backend, prefixed, rank=rank, world=world, timeout_s=timeout_s)
    except (RuntimeError, dist.DistError) as exc:
        missing = _missing(prefixed, range(world))
        raise ConflictError(
            f"group {name!r} did not form within {timeout_s:g}s: "
            + (f"ranks {missing} never joined" if missing else f"every rank joined but the group failed: {exc}")
        ) from None
    return Joined(name=name, store=store, group=group, device=receives_on)


def given_up(request: InitWeightsUpdateGroupRequest, phase: str) -> ConflictError:
    """The answer to a join given up on past its ``timeout_s`` (and ``JOIN_GRACE_S``), still in ``phase``."""
    return ConflictError(
        f"group {request.group_name!r} did not form within {request.timeout_s:g}s: still {phase} "
        f"(rank 0 at {request.master_address}:{request.master_port}); check that the sender is running "
        "and that every rank joins"
    )

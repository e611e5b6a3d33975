"""Publishing the weights of a sharded trainer: ``ShardedPublisher``, called by every rank.

No rank holds the whole model; how the ranks fill each bucket is in docs/ARCHITECTURE.md, "Pushing
weights from memory", Sharded trainers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from miles.config import TransferPath
from miles.errors import PublishError
from miles.train.engine_calls import PushStats
from miles.train.publisher import PublishResult
from miles.train.push import Transports, check_push_settings, choose_path, push_result, send_buckets
from miles.train.windows import push_in_window, window_client
from miles.weights.buckets import DEFAULT_BUCKET_BYTES, BucketTable
from miles.weights.checksum import saved_state_dict
from miles.weights.digest import CHUNK_BYTES, TensorHasher, chunk_digest, digest_buffer
from miles.weights.safetensors_io import dtype_name
from miles.weights.transport import segments
from miles.weights.transport.segments import SegmentRef

logger = logging.getLogger("miles.train")


@dataclass(frozen=True)
class _Part:
    """What one rank holds of one tensor of the model (by the name its checkpoints use)."""

    name: str
    dtype: str
    shape: tuple[int, ...]  # the whole tensor's
    # ``rows``: rows ``[start, stop)`` of a tensor split by rows, contiguous in its bytes; ``dim``:
    # ``[start, stop)`` along dimension ``dim`` >= 1 (not contiguous: rank 0 hashes it);
    # ``whole``: the whole tensor, held alike by every rank (rank 0's is sent).
    kind: str
    dim: int = 0
    start: int = 0
    stop: int = 0

    @property
    def nbytes(self) -> int:
        """The bytes of the whole tensor."""
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


def _parts(model: torch.nn.Module, world: int) -> tuple[list[_Part], dict[str, torch.Tensor]]:
    """This rank's part of every tensor a checkpoint of ``model`` holds, and its local tensors.
    Raises PublishError naming a tensor the publisher cannot split."""
    parts, local = [], {}
    for name, tensor in saved_state_dict(model).items():
        shape, dtype = tuple(tensor.shape), dtype_name(tensor.dtype)
        if not isinstance(tensor, DTensor):
            parts.append(_Part(name, dtype, shape, "whole"))
            local[name] = tensor.detach()
            continue
        mesh, placements = tensor.device_mesh, tensor.placements
        if mesh.ndim != 1 or mesh.size() != world:
            raise PublishError(
                f"tensor {name!r} is laid out on a {mesh.ndim}-dimensional mesh of {mesh.size()} ranks; the "
                f"publisher splits tensors over one dimension of all {world} ranks (FSDP2's fully_shard)"
            )
        placement = placements[0]
        local[name] = tensor.to_local().detach()
        if isinstance(placement, Replicate):
            parts.append(_Part(name, dtype, shape, "whole"))
        elif isinstance(placement, Shard) and type(placement) is Shard:
            size, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
            dim = placement.dim
            parts.append(
                _Part(name, dtype, shape, "rows" if dim == 0 else "dim", dim, offset[dim], offset[dim] + size[dim])
            )
        else:
            raise PublishError(
                f"tensor {name!r} is placed {type(placement).__name__} ({placement}), which the publisher cannot "
                "send; shard it with fully_shard (Shard(0)), shard it on another dimension, or replicate it"
            )
    return parts, local


# Every rank's parts by name, in the model's order: what each rank sends, and where (rank 0's
# part of a tensor describes the whole of it).
_Layout = list[dict[str, _Part]]


@dataclass
class _Plan:
    """What rank 0 tells every rank before the buckets (a reason instead when it gives up)."""

    direct: bool
    segment: SegmentRef | None
    tables: list[BucketTable]


class ShardedPublisher:
    """Publishes a sharded trainer's weights (module docstring). Make one on every rank, at the same
    point, after ``torch.distributed`` is initialised; ``controller`` is used by rank 0."""

    def __init__(
        self,
        controller: object,
        *,
        model_name: str | None = None,
        path: TransferPath = TransferPath.AUTO,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        master_address: str = "127.0.0.1",
        ttl_s: float = 10.0,
        timeout_s: float = 60.0,
        staged: bool = True,
    ) -> None:
        check_push_settings(path=path, ttl_s=ttl_s, timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        if not dist.is_initialized():
            raise PublishError("ShardedPublisher needs torch.distributed initialised (torchrun, init_process_group)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.model_name, self.path = model_name, TransferPath(path)
        self.ttl_s, self.timeout_s, self.staged = ttl_s, timeout_s, staged
        # Collectives of its own, bounded: a rank that dies or never comes fails the others in
        # ``timeout_s`` instead of the default group's half an hour.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.windows = window_client(controller) if self.rank == 0 else None
        self._transports = Transports(master_address=master_address, timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        self._mapped: tuple[SegmentRef, torch.Tensor] | None = None  # rank 0's segment, on other ranks
        self.last: PushStats | None = None

    async def close(self) -> None:
        await self._transports.close()
        self._mapped = None

    async def publish(self, model: torch.nn.Module, tokenizer: object = None, *, step: int) -> PublishResult:
        """Return, on every rank, once the servers serve ``model``'s weights as version ``step``,
        verified. Raises PublishError on every rank when any rank, the push or the commit failed."""
        started = time.perf_counter()
        try:
            parts, local = _parts(model, self.world)
            refused = None
        except PublishError as exc:
            parts, local, refused = [], {}, exc.message
        layout = await self._agree(parts, step=step, refused=refused)
        if self.rank == 0:
            return await self._lead(layout, local, step=step, started=started)
        return await self._follow(layout, local, step=step)

    # --- every rank ------------------------------------------------------------------------

    async def _collective(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)``, a collective of the publisher's group, off the loop;
        PublishError when a rank never came."""
        try:
            return await asyncio.to_thread(call, *args, **kwargs)
        except (RuntimeError, dist.DistError) as exc:
            raise PublishError(
                f"rank {self.rank}: the trainer's ranks did not all take part in {what} within {self.timeout_s:g}s "
                f"(a rank died, or never called publish): {exc}"
            ) from None

    async def _agree(self, parts: list[_Part], *, step: int, refused: str | None) -> _Layout:
        """Every rank's parts, once all called publish for the same step and layout; raises
        PublishError naming the ranks missing or disagreeing."""

        def barrier() -> None:
            dist.monitored_barrier(group=self._group, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)

        await self._collective("publish (every rank must call it)", barrier)
        mine = (step, refused, parts, socket.gethostname(), os.getpid())
        gathered: list[Any] = [None] * self.world
        await self._collective("agreeing on the layout", dist.all_gather_object, gathered, mine, group=self._group)
        problems = [f"rank {r}: {g[1]}" for r, g in enumerate(gathered) if g[1] is not None]
        steps = {g[0] for g in gathered}
        if len(steps) > 1:
            problems.append(
                "the ranks publish different steps: " + ", ".join(f"rank {r} {g[0]}" for r, g in enumerate(gathered))
            )
        keys = [[(p.name, p.dtype, p.shape, p.kind if p.kind == "whole" else p.dim) for p in g[2]] for g in gathered]
        disagreeing = [r for r, k in enumerate(keys) if k != keys[0]]
        if not problems and disagreeing:
            problems.append(
                f"ranks {disagreeing} hold a model laid out otherwise than rank 0's (other names, dtypes, "
                "shapes or placements); every rank must publish the same model"
            )
        if problems:
            raise PublishError("the sharded publish was refused before its window opened: " + "; ".join(problems))
        self._peers = [(g[3], g[4]) for g in gathered]
        return [{p.name: p for p in g[2]} for g in gathered]

    async def _bcast(self, what: str, obj: Any) -> Any:
        box = [obj]
        await self._collective(what, dist.broadcast_object_list, box, src=0, group=self._group)
        return box[0]

    async def _gather(self, what: str, obj: Any) -> list[Any] | None:
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        await self._collective(what, dist.gather_object, obj, gathered, dst=0, group=self._group)
        return gathered

    def _contribute(
        self, layout: _Layout, local: dict[str, torch.Tensor], table: BucketTable, into: torch.Tensor | None
    ) -> dict[str, Any]:
        """Write this rank's part of bucket ``table`` into ``into`` (direct) and hash the chunks inside
        its rows; returns the chunk digests by tensor and (gathered, ``into`` None) this rank's bytes."""
        digests: dict[str, tuple[int, bytes]] = {}
        payload: dict[str, torch.Tensor] = {}
        for entry in table.entries:
            part = layout[self.rank][entry.name]
            mine = local[entry.name]
            if part.kind == "whole" and self.rank != 0:
                continue  # rank 0's copy is sent
            if into is None:
                payload[entry.name] = mine.contiguous().cpu()  # a GPU shard travels through the host
            else:
                _place(into, entry.offset, part, mine)
            if part.kind == "rows":
                digests[entry.name] = _chunk_digests(part, mine)
        return {"digests": digests, "payload": payload}

    # --- rank 0 ----------------------------------------------------------------------------

    async def _lead(
        self, layout: _Layout, local: dict[str, torch.Tensor], *, step: int, started: float
    ) -> PublishResult:
        """Rank 0: open the window, lead every bucket, commit; whatever fails, the other ranks are
        told at the collective they wait in (``_Steps``), and the window is aborted."""
        assert self.windows is not None
        steps = _Steps(self)
        stats = PushStats(path="sharded")

        async def push() -> str:
            async def fill(index: int, table: BucketTable) -> BucketTable:
                # Bucket ``index`` goes into the region of bucket ``index - 2``, free since that
                # bucket's send ended (awaited before bucket ``index - 1`` was sent): the ranks
                # fill it while the engines still take bucket ``index - 1``. Waiting for that
                # send first would leave the ranks idle during every send, and the engines
                # during every fill.
                into = sender.into(index)
                assert into is not None
                await steps.start_bucket()
                mine = await asyncio.to_thread(self._contribute, layout, local, table, into if plan.direct else None)
                gathered = await steps.gather(mine)
                failed = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g.get("error")]
                if failed:
                    raise PublishError("a rank could not contribute its shards: " + "; ".join(failed))
                packed = await asyncio.to_thread(_finish, layout, table, into, gathered, direct=plan.direct)
                stats.tensors += len(packed.entries)
                return packed

            # Looks at /proc and resolves this machine's addresses: off the loop.
            path = await asyncio.to_thread(choose_path, self.path, window)
            shm = path is TransferPath.SHM
            direct = shm and all(host == self._peers[0][0] for host, _ in self._peers)
            stats.path = f"{'shm' if shm else 'distributed'}, {'direct shards' if direct else 'gathered per bucket'}"
            # Tensors of the wholes' dtypes and shapes and no bytes: what buckets are planned from.
            meta = {n: torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta") for n, p in layout[0].items()}
            calls = self._transports.calls(window, step=step, stats=stats)
            async with self._transports.sender(meta, calls, path=path, shared=None) as sender:
                segment = getattr(sender, "segment", None) if direct else None
                plan = _Plan(
                    direct=direct, segment=segment.ref if segment is not None else None, tables=list(sender.tables)
                )
                await steps.plan(plan)
                return await send_buckets(sender, fill, stats=stats)

        try:
            window = await self.windows.open(model_name=self.model_name, ttl_s=self.ttl_s, staged=self.staged)
            checksum = await push_in_window(self.windows, window, push, step=step, stats=stats)
        except BaseException as exc:
            # The window is aborted, or was not committed (which rolled the servers back itself):
            # only the other ranks are left to tell.
            with contextlib.suppress(PublishError):
                await steps.give_up(str(exc) or type(exc).__name__)
            if isinstance(exc, PublishError | asyncio.CancelledError):
                raise
            raise PublishError(f"publishing step {step} failed: {exc}") from exc
        result = push_result(step, checksum=checksum, path=stats.path, started=started)
        await steps.outcome(result)
        self.last = stats
        return result

    # --- other ranks -----------------------------------------------------------------------

    async def _follow(self, layout: _Layout, local: dict[str, torch.Tensor], *, step: int) -> PublishResult:
        """Every rank but 0: fill each bucket as rank 0 says, until it says how the publish ended."""

        async def told(what: str) -> Any:
            """What rank 0 broadcast; PublishError when it was the reason it gave up."""
            said = await self._bcast(what, None)
            if isinstance(said, str):
                raise PublishError(f"rank 0 could not publish step {step}: {said}")
            return said

        plan = await told("the plan")
        into = await asyncio.to_thread(self._map, plan.segment) if plan.direct and plan.segment else None
        for table in plan.tables:
            await told("a bucket's start")
            try:
                mine = await asyncio.to_thread(self._contribute, layout, local, table, into)
            except Exception as exc:  # noqa: BLE001  # told to rank 0, which aborts the publish for every rank
                mine = {"error": f"{type(exc).__name__}: {exc}"}
            await self._gather("a bucket's digests", mine)
        return await told("the outcome")

    def _map(self, ref: SegmentRef) -> torch.Tensor:
        """Rank 0's bucket segment, mapped here for this rank's rows (kept while rank 0 keeps it)."""
        if self._mapped is None or self._mapped[0] != ref:
            self._mapped = (ref, segments.writable(ref))
        return self._mapped[1]


class _Steps:
    """Rank 0's side of the collectives of a publish (the plan; per bucket, its start and the gather
    of digests; the outcome). Whatever fails on rank 0, ``give_up`` completes the collective the
    other ranks wait in with the reason, so they raise it instead of waiting out their timeout."""

    def __init__(self, publisher: ShardedPublisher) -> None:
        self._publisher = publisher
        self._next = "plan"  # the collective the other ranks wait in now

    async def plan(self, plan: _Plan) -> None:
        await self._publisher._bcast("the plan", plan)
        self._next = "start"

    async def start_bucket(self) -> None:
        await self._publisher._bcast("a bucket's start", None)
        self._next = "gather"

    async def gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        gathered = await self._publisher._gather("a bucket's digests", mine)
        self._next = "start"
        assert gathered is not None
        return gathered

    async def outcome(self, result: PublishResult) -> None:
        await self._publisher._bcast("the outcome", result)
        self._next = "done"

    async def give_up(self, reason: str) -> None:
        if self._next == "gather":
            await self._publisher._gather("a bucket's digests", {"error": None})
        if self._next in ("plan", "start", "gather"):
            # The others wait for the plan or the next bucket's start, or, past the last bucket,
            # for the outcome: each is a broadcast from rank 0, which the reason answers.
            await self._publisher._bcast("the plan" if self._next == "plan" else "a bucket's start", reason)
        self._next = "done"


def _place(into: torch.Tensor, offset: int, part: _Part, mine: torch.Tensor) -> None:
    """Write this rank's part of one tensor where the whole tensor lies in a bucket at ``offset``."""
    dtype = getattr(torch, part.dtype)
    whole = into[offset : offset + part.nbytes].view(dtype).view(part.shape)
    with torch.no_grad():
        if part.kind == "whole":
            whole.copy_(mine)
        else:
            whole.narrow(part.dim, part.start, part.stop - part.start).copy_(mine)


def _chunk_digests(part: _Part, mine: torch.Tensor) -> tuple[int, bytes]:
    """The digests of the 256 KiB chunks of the whole tensor that lie inside this rank's rows:
    the index of the first, and the digests back to back."""
    row = math.prod(part.shape[1:]) * getattr(torch, part.dtype).itemsize
    begin, end = part.start * row, part.stop * row
    raw = memoryview(mine.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())  # type: ignore[arg-type]
    total = part.nbytes
    # The first chunk starting in the rows, up to the last one ending in them (the tensor's last
    # chunk, shorter, when the rows run to its end).
    first, last = -(-begin // CHUNK_BYTES), (-(-end // CHUNK_BYTES) if end == total else end // CHUNK_BYTES)
    chunks = (raw[k * CHUNK_BYTES - begin : min((k + 1) * CHUNK_BYTES, total) - begin] for k in range(first, last))
    return first, b"".join(chunk_digest(chunk) for chunk in chunks)


def _finish(
    layout: _Layout, table: BucketTable, into: torch.Tensor, gathered: list[dict[str, Any]], *, direct: bool
) -> BucketTable:
    """Rank 0: the bucket with every rank's bytes in place and each tensor's digest, from its owners'
    chunk digests and the chunks no rank hashed (straddling two ranks' rows, or not split by rows)."""
    if not direct:
        for rank, contribution in enumerate(gathered):
            for name, mine in contribution["payload"].items():
                entry = next(e for e in table.entries if e.name == name)
                _place(into, entry.offset, layout[rank][name], mine)
    raw = into.numpy()
    entries = []
    for entry in table.entries:
        part = layout[0][entry.name]
        chunks = max(-(-part.nbytes // CHUNK_BYTES), 0)
        known: dict[int, bytes] = {}
        for contribution in gathered:
            first, blob = contribution["digests"].get(entry.name, (0, b""))
            for i in range(len(blob) // 16):
                known[first + i] = blob[16 * i : 16 * i + 16]
        if part.kind == "rows" and chunks:
            hasher = TensorHasher()
            for k in range(chunks):
                lo = entry.offset + k * CHUNK_BYTES
                hasher.update_chunks(
                    known.get(k) or chunk_digest(raw[lo : lo + min(CHUNK_BYTES, part.nbytes - k * CHUNK_BYTES)])
                )
            digest = hasher.hexdigest()
        else:
            digest = digest_buffer(raw[entry.offset : entry.offset + entry.nbytes])
        entries.append(entry.model_copy(update={"digest": digest}))
    return BucketTable(entries=tuple(entries))

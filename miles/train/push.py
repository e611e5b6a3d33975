"""Pushing weights from the trainer's memory, no disk: ``PushPublisher``, a ``Publisher``.

One bucket loop (``send_buckets``) whatever the path (docs/ARCHITECTURE.md, "Pushing weights from
memory"); the path's ``BucketSender`` says where each bucket is packed and how it reaches the engines.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ipaddress
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import httpx
import torch

from miles.config import LEASE_TTL_MAX_S, LEASE_TTL_MIN_S, TransferPath, check_seconds
from miles.controller.results import UpdateWindow
from miles.errors import InvalidRequestError, PublishError, Refusal
from miles.protocol.sglang_weights import PUSH_TIMEOUT_MAX_S
from miles.train.distributed_push import DistributedPush
from miles.train.engine_calls import EngineCalls, PushStats
from miles.train.publisher import PublishResult
from miles.train.tensor_push import TensorPush
from miles.train.windows import abort_quietly, push_in_window, window_client
from miles.weights.buckets import DEFAULT_BUCKET_BYTES, BucketTable, pack
from miles.weights.checksum import (
    TensorDigest,
    checksum_from_digests,
    checksum_state_dict,
    digest_tensor,
    saved_state_dict,
)
from miles.weights.safetensors_io import dtype_name
from miles.weights.transport import segments
from miles.weights.transport.segments import Segment

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger("miles.train")

# Buckets smaller than this are packed on the event loop: a thread hop costs more.
_INLINE_PACK_BYTES = 4 * 1024 * 1024
# Where shared storages start: a cache line, which every dtype's alignment divides.
_SHARED_ALIGN = 64


class BucketSender(Protocol):
    """One push's transport, the trainer's end: its buckets' ``tables`` (in the order they are
    sent, digests not yet known), where each is packed, and how it reaches the engines."""

    @property
    def tables(self) -> Sequence[BucketTable]: ...

    def into(self, index: int) -> torch.Tensor | None:
        """The flat buffer bucket ``index`` is packed into, at its table's offsets; None when the
        engines read its tensors where they lie (they are only hashed)."""

    async def send(self, index: int, packed: BucketTable, *, checksum: str | None) -> Awaitable[None]:
        """Hand bucket ``index`` to every engine (``checksum`` with the last one); returns once its
        buffer may be packed again, with the engines' answers (PublishError for a refusal) to await."""


def check_push_settings(*, path: TransferPath, ttl_s: float, timeout_s: float, bucket_bytes: int) -> None:
    """Raise ValueError, when the publisher is made, for a setting no push could honour."""
    if TransferPath(path) is TransferPath.DISK:
        raise ValueError("a push goes from memory; publish through disk with DiskPublisher")
    try:
        check_seconds(ttl_s, name="ttl_s", low=LEASE_TTL_MIN_S, high=LEASE_TTL_MAX_S)
        check_seconds(timeout_s, name="timeout_s", low=0.1, high=PUSH_TIMEOUT_MAX_S)
    except InvalidRequestError as exc:
        raise ValueError(exc.message) from None
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive number of bytes, not {bucket_bytes!r}")


def push_result(step: int, *, checksum: str, path: str, started: float) -> PublishResult:
    """What a push of ``step`` that began at ``started`` (``time.perf_counter()``) published."""
    total = time.perf_counter() - started
    return PublishResult(
        step=step, weight_version=str(step), checksum=checksum, path=path, apply_s=total, latency_s=total
    )


def on_this_machine(url: str) -> bool:
    """Whether the engine at ``url`` runs on this machine (its shared memory is ours)."""
    host = urlsplit(url).hostname or ""
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return True
        ours = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except (ValueError, OSError):  # a name other than localhost, or this machine's unknown
        return False
    return host in ours


class Transports:
    """A publisher's two transports, each keeping its buffers from one push to the next, and one
    connection pool for every push (a new client costs more than a small push)."""

    def __init__(self, *, master_address: str, timeout_s: float, bucket_bytes: int) -> None:
        self.timeout_s = timeout_s
        self.tensors = TensorPush(bucket_bytes=bucket_bytes)
        self.broadcasts = DistributedPush(master_address=master_address, timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        self._http: httpx.AsyncClient | None = None

    def calls(self, window: UpdateWindow, *, step: int, stats: PushStats) -> EngineCalls:
        if self._http is None:
            self._http = httpx.AsyncClient(trust_env=False, timeout=self.timeout_s * 2 + 30)
        return EngineCalls(http=self._http, window=window, version=str(step), stats=stats)

    def sender(
        self, named: Mapping[str, torch.Tensor], calls: EngineCalls, *, path: TransferPath, shared: Segment | None
    ) -> AbstractAsyncContextManager[BucketSender]:
        if path is TransferPath.SHM:
            return self.tensors.push(named, calls, shared=shared)
        return self.broadcasts.push(named, calls)

    async def close(self) -> None:
        await self.tensors.close()
        self.broadcasts.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def choose_path(path: TransferPath, window: UpdateWindow) -> TransferPath:
    """``path``, or for ``auto``: shm when this machine makes segments and every engine of
    ``window`` runs on it, else distributed (looks at /proc, resolves this machine's addresses)."""
    if path is not TransferPath.AUTO:
        return path
    local = segments.available() and all(on_this_machine(s.url) for s in window.servers)
    return TransferPath.SHM if local else TransferPath.DISTRIBUTED


class PushPublisher:
    """Publishes the trainer's weights by pushing them into the servers' memory (module docstring)."""

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
        delta: bool = True,
        staged: bool = True,
        share_weights: bool = True,
    ) -> None:
        check_push_settings(path=path, ttl_s=ttl_s, timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        self.windows = window_client(controller)
        self.model_name = model_name
        self.path = TransferPath(path)
        self.ttl_s = ttl_s
        self.delta = delta
        # Push into the engines' staging buffers while they serve (a staged window).
        self.staged = staged
        # Move a published model's weights into shared memory (``share_memory``) on its first
        # publish that may go over shared memory.
        self.share_weights = share_weights
        # The segment ``share_memory`` moved a model's weights into, while it is there.
        self.shared_segment: Segment | None = None
        # The digest of every tensor the servers were last committed on (delta pushes).
        self._held: dict[str, str] | None = None
        self.last: PushStats | None = None
        self._transports = Transports(master_address=master_address, timeout_s=timeout_s, bucket_bytes=bucket_bytes)

    def share_memory(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move ``module``'s CPU parameters and buffers (same objects, same values) into a new
        shared-memory segment of this publisher's, so a push copies nothing on this side. Returns
        ``module``; raises PublishError when the memory for them cannot be had."""
        segment = _share(module)
        if segment is not None:
            previous, self.shared_segment = self.shared_segment, segment
            if previous is not None:
                previous.close()  # its file; the memory goes with the last tensor viewing it
        return module

    async def close(self) -> None:
        """Free the segments, buffers and connections; the publisher can be used again."""
        await self._transports.close()
        if self.shared_segment is not None:
            shared, self.shared_segment = self.shared_segment, None
            await asyncio.to_thread(shared.close)  # its file; the model keeps its memory

    async def publish(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, step: int) -> PublishResult:
        """Return once the servers serve ``model``'s weights as version ``step``, verified; raises
        PublishError when the push or the commit failed (the servers keep their verified weights)."""
        shared = self.shared_segment
        held = shared is not None and all(shared.holds(t) for t in _shareable(model))
        if self.share_weights and self.path is not TransferPath.DISTRIBUTED and not held:
            try:
                await asyncio.to_thread(self.share_memory, model)
            except PublishError as exc:
                logger.warning("pushing copies of the weights: %s", exc)
                self.share_weights = False
        return await self.push(saved_state_dict(model), step=step)

    async def push(self, named: Mapping[str, torch.Tensor], *, step: int) -> PublishResult:
        """``publish`` for named tensors (the model's, by the names its checkpoints use). With
        ``delta``, after a committed push only the tensors whose digest changed are sent; a server
        that does not hold what the last push left fails the commit, and the push is redone in full."""
        held = self._held
        try:
            return await self._push(named, step=step, held=held, staged=self.staged)
        except PublishError as exc:
            self._held = None
            if self.staged and exc.refusal is Refusal.CANNOT_STAGE:
                # Some engine cannot hold a second copy now: its servers leave routing instead.
                logger.warning("an engine cannot stage step %d; pushing with the servers out of routing", step)
                return await self._push(named, step=step, held=None, staged=False)
            if held is None:
                raise
            logger.warning("a delta push of step %d was not committed; pushing every tensor", step)
            return await self._push(named, step=step, held=None, staged=self.staged)

    async def _push(
        self, named: Mapping[str, torch.Tensor], *, step: int, held: dict[str, str] | None, staged: bool
    ) -> PublishResult:
        started = time.perf_counter()
        # The window opens while a delta push hashes every tensor to find what changed.
        opening = asyncio.ensure_future(self.windows.open(model_name=self.model_name, ttl_s=self.ttl_s, staged=staged))
        try:
            sending, unchanged, digests = await self._delta(named, held)
        except BaseException as exc:
            await asyncio.wait([opening])
            if not opening.cancelled() and opening.exception() is None:
                await abort_quietly(self.windows, opening.result(), reason=f"finding what changed failed: {exc}")
            raise
        window = await opening
        opened = time.perf_counter()
        stats = PushStats(path=self.path.value, tensors=len(sending), skipped=len(unchanged))

        async def stream() -> str:
            # Looks at /proc and resolves this machine's addresses: off the loop.
            path = await asyncio.to_thread(self._choose, window)
            stats.path = path.value
            calls = self._transports.calls(window, step=step, stats=stats)
            async with self._transports.sender(sending, calls, path=path, shared=self.shared_segment) as sender:
                return await _stream(sender, sending, stats=stats, unchanged=unchanged, known=digests or {})

        checksum = await push_in_window(self.windows, window, stream, step=step, stats=stats)
        stats.timings["open"] = opened - started
        self.last = stats
        if self.delta:
            self._held = {**(digests or {}), **stats.digests}
        return push_result(step, checksum=checksum, path=stats.path, started=started)

    async def _delta(
        self, named: Mapping[str, torch.Tensor], held: dict[str, str] | None
    ) -> tuple[Mapping[str, torch.Tensor], list[TensorDigest], dict[str, str] | None]:
        """What to send: every tensor, or (after a committed push) those whose digest changed, with
        the digests of the rest (the model checksum needs them all)."""
        if not self.delta or held is None or set(held) != set(named):
            return named, [], None
        # Every tensor hashed (on torch's threads) to find those that changed: nothing short of
        # their bytes says which did (a counter of in-place writes misses writes through .data).
        hashed = await asyncio.to_thread(checksum_state_dict, named, threads=torch.get_num_threads())
        now = {n: d.digest for n, d in hashed.tensors.items()}
        changed = {n: t for n, t in named.items() if held[n] != now[n]}
        if not changed:
            # The last push carries the checksum the engines confirm: send the smallest tensor.
            smallest = min(named, key=lambda n: named[n].numel())
            changed = {smallest: named[smallest]}
        unchanged = [
            TensorDigest(name=n, dtype=dtype_name(t.dtype), shape=tuple(t.shape), digest=now[n])
            for n, t in named.items()
            if n not in changed
        ]
        return changed, unchanged, now

    def _choose(self, window: UpdateWindow) -> TransferPath:
        return choose_path(self.path, window)


async def send_buckets(
    sender: BucketSender,
    fill: Callable[[int, BucketTable], Awaitable[BucketTable]],
    *,
    stats: PushStats,
    digests: Sequence[TensorDigest] = (),
) -> str:
    """Fill each bucket of ``sender`` (``fill`` returns its table with the digests) and send it, the
    last with the model checksum over ``digests`` and every bucket's; returns the checksum. The next
    bucket is filled while the engines take the one before, which is sent only once the buffer of
    the one before it is free again (read, or broadcast), so a filler writing into two buffers in
    turn never writes into one still in use."""
    tables = sender.tables
    digests = list(digests)
    sending: asyncio.Task[Awaitable[None]] | None = None
    # Answers still to come, oldest first: at most the last two buckets', since an engine has two
    # buffers to receive into (a refusal surfaces within two buckets).
    answers: collections.deque[Awaitable[None]] = collections.deque()
    checksum: str | None = None
    try:
        for index, table in enumerate(tables):
            packed = await fill(index, table)
            digests += [e.tensor_digest() for e in packed.entries]
            if index == len(tables) - 1:
                checksum = checksum_from_digests(digests, num_bytes=0).checksum
            if sending is not None:
                answers.append(await sending)
            while len(answers) > 1:
                await _answered(answers.popleft(), stats)
            sending = asyncio.create_task(sender.send(index, packed, checksum=checksum))
            stats.buckets += 1
            stats.bytes += packed.nbytes
        if sending is not None:
            answers.append(await sending)
        while answers:
            await _answered(answers.popleft(), stats)
    finally:
        left = [a for a in (sending, *answers) if isinstance(a, asyncio.Future) and not a.done()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
    assert checksum is not None
    return checksum


async def _stream(
    sender: BucketSender,
    named: Mapping[str, torch.Tensor],
    *,
    stats: PushStats,
    unchanged: list[TensorDigest],
    known: Mapping[str, str],
) -> str:
    """``send_buckets`` of ``named``: each bucket packed into its buffer, or digested where it lies."""

    async def fill(index: int, table: BucketTable) -> BucketTable:
        packing = time.perf_counter()
        into = sender.into(index)
        if into is None:
            stats.in_place += table.nbytes
            work = functools.partial(_digested, named, table, known=known)
        else:
            work = functools.partial(pack, named, table, into)
        packed = work() if table.nbytes <= _INLINE_PACK_BYTES else await asyncio.to_thread(work)
        stats.spent("pack", packing)
        stats.digests |= {e.name: e.tensor_digest().digest for e in packed.entries}
        return packed

    return await send_buckets(sender, fill, stats=stats, digests=unchanged)


async def _answered(answer: Awaitable[None], stats: PushStats) -> None:
    waiting = time.perf_counter()
    await answer
    stats.spent("engines", waiting)


def _digested(named: Mapping[str, torch.Tensor], table: BucketTable, *, known: Mapping[str, str]) -> BucketTable:
    return BucketTable(
        entries=tuple(
            e.model_copy(update={"digest": known.get(e.name) or digest_tensor(named[e.name])}) for e in table.entries
        )
    )


def _shareable(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """What ``_share`` moves: the dense CPU parameters and buffers of ``module`` holding bytes."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
            continue
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes and not nbytes % tensor.element_size():
            yield tensor


def _share(module: torch.nn.Module) -> Segment | None:
    """Move every CPU parameter and buffer of ``module`` into a new segment (each storage copied
    once, every tensor viewing it re-pointed); None when there is none. Raises as ``share_memory``."""
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for tensor in _shareable(module):
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    if not storages:
        return None
    aligned = [-(-storage.nbytes() // _SHARED_ALIGN) * _SHARED_ALIGN for storage, _ in storages.values()]
    *offsets, size = [0, *itertools.accumulate(aligned)]
    segment = Segment(size)
    with torch.no_grad():
        for (storage, tensors), at in zip(storages.values(), offsets, strict=True):
            place = segment.flat[at : at + storage.nbytes()]
            place.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for tensor in tensors:
                start = at // tensor.element_size() + tensor.storage_offset()
                tensor.data = place.view(tensor.dtype).as_strided(tensor.size(), tensor.stride(), start)
    return segment

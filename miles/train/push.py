"""Pushing weights from the trainer's memory, no disk: ``PushPublisher``, a ``Publisher``.

``publish`` runs the training side of a window (DESIGN.md, "training-driven updates"): open the
update window on the controller, stream the model's tensors to every engine of the window in
buckets (a constant number of calls per update, whatever the number of tensors), computing each
tensor's digest while it is packed and the model checksum from those digests, publish that
checksum (``InferenceEngineWeightChecksumEvent``), and end the window, so the controller confirms
every engine's checksum against the published one and admits, quarantines or rolls back exactly
as for a checkpoint on disk. Anything that fails aborts the window: the servers go back to their
verified weights.

Paths (``TransferPath``):
- ``shm``: every engine on this node: each bucket is written once into a shared-memory segment
  that every engine reads (``/update_weights_from_tensor``); weights on a GPU are packed in GPU
  memory and handed over as CUDA IPC handles instead (``load_format="miles_cuda_ipc"``);
- ``distributed``: engines anywhere: a torch.distributed group with this process as rank 0 (gloo
  on CPU), one flat broadcast per bucket (``/update_weights_from_distributed`` with SGLang's
  ``load_format="flattened_bucket"``);
- ``auto``: ``shm`` when every engine's address is this machine's, else ``distributed``.

The controller is given as an ``AsyncInferenceController`` (or anything with its window methods
as coroutines), the blocking ``InferenceController``, a Ray actor handle of the named controller,
or the URL of its HTTP API (with ``MILES_ADMIN_TOKEN`` from the environment when set).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import ipaddress
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
import torch
import torch.distributed as dist

from miles.config import LEASE_TTL_MAX_S, LEASE_TTL_MIN_S, TransferPath, check_seconds
from miles.errors import InvalidRequestError, PublishError
from miles.protocol.sglang import CUDA_IPC_LOAD_FORMAT, PUSH_TIMEOUT_MAX_S, SHM_LOAD_FORMAT, CudaIpcHandle
from miles.train.publisher import PublishResult
from miles.utils.audit_utils.event_logger import InferenceEngineWeightChecksumEvent
from miles.weights.buckets import DEFAULT_BUCKET_BYTES, BucketTable, layout, pack, plan
from miles.weights.checksum import TensorDigest, checksum_from_digests, digest_tensor, saved_state_dict
from miles.weights.safetensors_io import dtype_name
from miles.weights.segments import SHM_DIR, Segment

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger("miles.train")

GROUP_NAME = "miles_weight_push"
# How an engine that cannot stage refuses a staged push (miles.engine.live_weights).
_CANNOT_STAGE = "cannot stage pushed weights"


@dataclass(frozen=True)
class Window:
    """An open update window, whatever the controller was reached through."""

    token: int
    model_name: str
    credential: str | None
    servers: tuple[tuple[str, str], ...]  # (server id, engine URL)
    # The lease, renewed while the push runs (``WindowClient.renew``).
    ttl_s: float
    # The servers serve while the push stages; the commit swaps the weights in.
    staged: bool = False


@dataclass(frozen=True)
class Ended:
    status: str
    message: str


class WindowClient:
    """The controller's window API, reached in-process, through a Ray handle or over HTTP."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        bound = getattr(self._controller, method)
        remote = getattr(bound, "remote", None)
        if remote is not None:  # a Ray actor handle: its ObjectRef is awaitable
            return await remote(*args, **kwargs)
        if inspect.iscoroutinefunction(bound):
            return await bound(*args, **kwargs)
        return await asyncio.to_thread(bound, *args, **kwargs)

    async def _http(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        token = os.environ.get("MILES_ADMIN_TOKEN", "").strip()
        headers = {"authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(trust_env=False, timeout=None, headers=headers) as http:
            answer = await http.post(f"{str(self._controller).rstrip('/')}{path}", json=body)
        payload: dict[str, Any] = answer.json()
        if answer.status_code >= 400 and "status" not in payload:
            raise PublishError(f"the controller refused {path}: {payload.get('detail', payload)}")
        return payload

    async def open(self, *, model_name: str | None, ttl_s: float, staged: bool) -> Window:
        if isinstance(self._controller, str):
            body = {"model_name": model_name, "ttl_s": ttl_s, "staged": staged}
            raw = await self._http("/update_weights/start", body)
        else:
            window = await self._call("start_update_weights", model_name, ttl_s=ttl_s, staged=staged)
            raw = window.model_dump(mode="json")
        return Window(
            token=int(raw["token"]),
            model_name=raw["model_name"],
            credential=raw.get("credential"),
            servers=tuple((s["server_id"], s["url"]) for s in raw["servers"]),
            ttl_s=float(raw["ttl_s"]),
            staged=bool(raw.get("staged", False)),
        )

    async def renew(self, window: Window) -> None:
        """Extend the window's lease by its ``ttl_s`` from now."""
        if isinstance(self._controller, str):
            await self._http("/update_weights/renew", {"token": window.token})
        else:
            await self._call("renew_update_weights", window.token)

    async def keep_alive(self, window: Window) -> None:
        """Renew the window's lease every third of it until cancelled: the lease stays short (a
        trainer that dies holds the fleet for one lease) however long the push takes. A renewal
        that fails is logged and retried; the push itself fails if the window is gone."""
        while True:
            await asyncio.sleep(window.ttl_s / 3)
            try:
                await self.renew(window)
            except Exception as exc:  # noqa: BLE001  # a heartbeat must not die of one failed beat
                logger.warning("could not renew window %d: %s", window.token, exc)

    async def publish(self, event: InferenceEngineWeightChecksumEvent) -> None:
        if isinstance(self._controller, str):
            await self._http("/events", event.model_dump(mode="json"))
        elif hasattr(getattr(self._controller, "log_event", None), "remote"):
            await self._call("log_event", event)
        else:
            logger_ = getattr(self._controller, "event_logger", None)
            if logger_ is None:
                raise PublishError("the controller given has no event log to publish the checksum to")
            logger_.log(InferenceEngineWeightChecksumEvent, event, print_log=False)

    async def end(self, window: Window, *, checksum: str, step: int, weight_version: str) -> Ended:
        if isinstance(self._controller, str):
            body = {"token": window.token, "checksum": checksum, "step": step, "weight_version": weight_version}
            raw = await self._http("/update_weights/end", body)
            return Ended(status=raw["status"], message=raw.get("message", ""))
        result = await self._call(
            "end_update_weights", window.token, checksum=checksum, step=step, weight_version=weight_version
        )
        return Ended(status=str(result.status), message=result.message)

    async def abort(self, window: Window, *, reason: str) -> None:
        try:
            if isinstance(self._controller, str):
                await self._http("/update_weights/abort", {"token": window.token, "reason": reason})
            else:
                await self._call("abort_update_weights", window.token, reason=reason)
        except Exception as exc:  # noqa: BLE001  # best effort: the window also ends when its lease runs out
            logger.warning("could not abort window %d: %s", window.token, exc)


def on_this_machine(url: str) -> bool:
    """Whether the engine at ``url`` runs on this machine (its shared memory is ours)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        return False
    try:
        ours = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return host in ours


@dataclass
class PushStats:
    path: str
    tensors: int = 0  # sent
    skipped: int = 0  # unchanged since the last committed push (delta)
    buckets: int = 0
    calls: int = 0
    # Each sent tensor's digest, computed while it was packed.
    digests: dict[str, str] = field(default_factory=dict)
    # What each engine reported each update call cost it (seconds per phase), in call order.
    engine_timings: list[dict[str, float]] = field(default_factory=list)
    bytes: int = 0
    # Of ``bytes``, those the engines read where they lie in the trainer's shared memory (no copy
    # on this side: ``PushPublisher.share_memory``).
    in_place: int = 0
    # Seconds: "open", "push" and "commit" of the window; within the push, the sender's own
    # phases, summed over buckets: "pack" (copy and digest), "join" (forming the group),
    # "broadcast", and "engines" (waiting for the engines' answers once their bytes are sent).
    timings: dict[str, float] = field(default_factory=dict)

    def spent(self, phase: str, since: float) -> None:
        """Add the time from ``since`` (a ``time.perf_counter()``) to now to ``phase``."""
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - since


def _check_seconds(name: str, value: float, low: float, high: float) -> None:
    """The controller's check of a number of seconds, as a ValueError (a bad argument here)."""
    try:
        check_seconds(value, name=name, low=low, high=high)
    except InvalidRequestError as exc:
        raise ValueError(exc.message) from None


class PushPublisher:
    """Publishes the trainer's weights by pushing them into the servers' memory (module docstring)."""

    def __init__(
        self,
        controller: Any,
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
        if TransferPath(path) is TransferPath.DISK:
            raise ValueError("PushPublisher pushes from memory; publish through disk with DiskPublisher")
        # Refused here rather than by the controller or every engine in the middle of a push.
        _check_seconds("ttl_s", ttl_s, LEASE_TTL_MIN_S, LEASE_TTL_MAX_S)
        _check_seconds("timeout_s", timeout_s, 0.1, PUSH_TIMEOUT_MAX_S)
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive number of bytes, not {bucket_bytes!r}")
        self.client = WindowClient(controller)
        self.model_name = model_name
        self.path = TransferPath(path)
        self.bucket_bytes = bucket_bytes
        self.master_address = master_address
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.delta = delta
        # Push into the engines' staging buffers while they serve (a staged window).
        self.staged = staged
        # Move a published model's weights into shared memory (``share_memory``) on its first
        # publish that may go over shared memory.
        self.share_weights = share_weights
        self._shared: Segment | None = None
        # The digest of every tensor the servers were last committed on (delta pushes).
        self._held: dict[str, str] | None = None
        self.last: PushStats | None = None
        self._http: httpx.AsyncClient | None = None
        self._segment: Segment | None = None
        # The broadcast buffers, kept from one push to the next like the segment.
        self._broadcast_buffers: list[torch.Tensor] = []

    @property
    def http(self) -> httpx.AsyncClient:
        """One connection pool for every push (a new client costs more than a small push)."""
        if self._http is None:
            self._http = httpx.AsyncClient(trust_env=False, timeout=self.timeout_s * 2 + 30)
        return self._http

    async def segment(self, size: int) -> Segment:
        """The shared-memory segment buckets are written into, kept from one push to the next
        (its pages are faulted in once, not per push); a bigger one replaces it when needed."""
        if self._segment is not None and self._segment.size < size:
            await self.drop_segment()
        if self._segment is None:
            self._segment = await asyncio.to_thread(Segment, size)
        return self._segment

    def broadcast_buffers(self, count: int, size: int) -> list[torch.Tensor]:
        """``count`` host buffers of at least ``size`` bytes to pack broadcast buckets into, kept
        from one push to the next (their pages are faulted in once)."""
        if len(self._broadcast_buffers) < count or any(b.numel() < size for b in self._broadcast_buffers[:count]):
            self._broadcast_buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(count)]
        return self._broadcast_buffers[:count]

    @property
    def shared_segment(self) -> Segment | None:
        """The segment ``share_memory`` moved a model's weights into, while it is there."""
        return self._shared

    def share_memory(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move ``module``'s weights (its CPU parameters and buffers) into a shared-memory segment
        of this publisher's, as ``torch.nn.Module.share_memory`` does into its own: the tensors stay
        the same objects with the same values, their memory moves. Engines on this machine then read
        each tensor where it lies, so a push over shared memory copies nothing on this side (it only
        hashes). The module trains on as before; pushing while it changes fails the push (a digest
        no longer matches), as it would with any copy. Returns ``module``.

        Called again (the module's tensors were replaced since), it moves them into a new segment.
        Raises PublishError when /dev/shm cannot hold them.
        """
        segment = _share(module)
        if segment is not None:
            previous, self._shared = self._shared, segment
            if previous is not None:
                previous.close()  # its file; the memory goes with the last tensor viewing it
        return module

    def _shares(self, module: torch.nn.Module) -> bool:
        """Whether every tensor of ``module`` that ``share_memory`` moves lives in the shared segment."""
        shared = self._shared
        return shared is not None and all(shared.holds(t) for t in _shareable(module))

    async def drop_segment(self) -> None:
        if self._segment is not None:
            segment, self._segment = self._segment, None
            await asyncio.to_thread(segment.close)

    async def close(self) -> None:
        """Remove the shared-memory segment, free the broadcast buffers and close the connections;
        the publisher can be used again."""
        await self.drop_segment()
        if self._shared is not None:
            shared, self._shared = self._shared, None
            await asyncio.to_thread(shared.close)  # its file; the model keeps its memory
        self._broadcast_buffers = []
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def publish(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, step: int) -> PublishResult:
        """Return once the servers serve ``model``'s weights as version ``step``, verified.

        Raises PublishError when the push or the commit failed; the servers then serve their
        previous verified weights.

        With ``share_weights`` (the default) and a path that may be shared memory, the model's
        weights are first moved into shared memory (``share_memory``; once, unless its tensors are
        replaced), so pushes read them where they lie. When /dev/shm cannot hold them, they stay
        where they are and every push copies them.
        """
        if self.share_weights and self.path is not TransferPath.DISTRIBUTED and not self._shares(model):
            try:
                await asyncio.to_thread(self.share_memory, model)
            except PublishError as exc:
                logger.warning("pushing copies of the weights: %s", exc)
                self.share_weights = False
        return await self.push(saved_state_dict(model), step=step)

    async def push(self, named: Mapping[str, torch.Tensor], *, step: int) -> PublishResult:
        """``publish`` for named tensors (the model's, by the names its checkpoints use).

        With ``delta``, after a committed push only the tensors whose digest changed since are
        sent; the engines confirm the whole model's checksum as always, so a server that does not
        hold what the last push left fails the commit, and the push is redone in full.
        """
        held = self._held
        try:
            return await self._push(named, step=step, held=held, staged=self.staged)
        except PublishError as exc:
            self._held = None
            if self.staged and _CANNOT_STAGE in str(exc):
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
        version = str(step)
        sending, unchanged, digests = await self._delta(named, held)
        window = await self.client.open(model_name=self.model_name, ttl_s=self.ttl_s, staged=staged)
        opened = time.perf_counter()
        renewing = asyncio.create_task(self.client.keep_alive(window), name=f"renew-window-{window.token}")
        try:
            # Looks at /dev/shm and resolves this machine's addresses: off the loop.
            path = await asyncio.to_thread(self._choose, window)
            stats = PushStats(path=path.value, tensors=len(sending), skipped=len(unchanged))
            pushing: _TensorPush | _DistributedPush
            if path is TransferPath.SHM:
                # On this machine: GPU tensors by CUDA IPC handle, host tensors through /dev/shm.
                gpu = next((t.device for t in sending.values() if t.device.type == "cuda"), None)
                pushing = _TensorPush(self, window, device=gpu)
            else:
                pushing = _DistributedPush(self, window)
            checksum = await pushing.run(sending, version=version, stats=stats, unchanged=unchanged, known=digests)
            pushed = time.perf_counter()
            await self.client.publish(
                InferenceEngineWeightChecksumEvent(
                    model_name=window.model_name, checksum=checksum, step=step, weight_version=version
                )
            )
            ended = await self.client.end(window, checksum=checksum, step=step, weight_version=version)
        except BaseException as exc:
            await self.client.abort(window, reason=f"the push failed: {exc}")
            if isinstance(exc, PublishError | asyncio.CancelledError):
                raise
            raise PublishError(f"pushing step {step} failed: {exc}") from exc
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        if ended.status != "committed":
            raise PublishError(f"the controller did not commit step {step}: {ended.status}: {ended.message}")
        stats.timings |= {"open": opened - started, "push": pushed - opened, "commit": time.perf_counter() - pushed}
        self.last = stats
        if self.delta:
            self._held = {**(digests or {}), **stats.digests}
        total = time.perf_counter() - started
        return PublishResult(
            step=step,
            weight_version=version,
            checksum=checksum,
            checkpoint_dir=None,
            save_s=0.0,
            ready_wait_s=0.0,
            apply_s=total,
            latency_s=total,
            path=path.value,
        )

    async def _delta(
        self, named: Mapping[str, torch.Tensor], held: dict[str, str] | None
    ) -> tuple[Mapping[str, torch.Tensor], list[TensorDigest], dict[str, str] | None]:
        """What to send: every tensor, or (after a committed push) those whose digest changed, with
        the digests of the rest (the model checksum needs them all)."""
        if not self.delta or held is None or set(held) != set(named):
            return named, [], None
        now = await asyncio.to_thread(_digests, named)
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

    def _choose(self, window: Window) -> TransferPath:
        if self.path is not TransferPath.AUTO:
            return self.path
        local = SHM_DIR.is_dir() and all(on_this_machine(url) for _, url in window.servers)
        return TransferPath.SHM if local else TransferPath.DISTRIBUTED

    def headers(self, window: Window) -> dict[str, str]:
        return {"authorization": f"Bearer {window.credential}"} if window.credential else {}


class _Authorized:
    """The publisher's client, with one window's credential on every call."""

    def __init__(self, http: httpx.AsyncClient, headers: dict[str, str]) -> None:
        self._http, self._headers = http, headers

    async def post(self, url: str, *, json: dict[str, Any]) -> httpx.Response:
        return await self._http.post(url, json=json, headers=self._headers)


# Buckets smaller than this are packed on the event loop: a thread hop costs more.
_INLINE_PACK_BYTES = 4 * 1024 * 1024
# How long a group-forming thread whose store was dropped is waited for (it ends at once).
_THREAD_END_S = 5.0


async def _pack(named: Mapping[str, torch.Tensor], table: BucketTable, flat: torch.Tensor) -> BucketTable:
    if table.total_bytes <= _INLINE_PACK_BYTES:
        return pack(named, table, flat)
    return await asyncio.to_thread(pack, named, table, flat)


async def _post_all(
    http: _Authorized,
    window: Window,
    path: str,
    body: Callable[[int], dict[str, Any]],
    stats: PushStats,
    *,
    fail_fast: bool = False,
) -> None:
    """POST to every engine of the window at once; PublishError naming each that refused or did
    not answer (with ``fail_fast``, the first one, as soon as it does: the calls still waiting
    are dropped)."""

    async def one(index: int, server_id: str, url: str) -> str | None:
        try:
            answer = await http.post(f"{url}{path}", json=body(index))
        except httpx.HTTPError as exc:
            return f"{server_id} at {url} did not answer ({type(exc).__name__}: {exc})"
        stats.calls += 1
        payload = answer.json() if answer.headers.get("content-type", "").startswith("application/json") else {}
        if answer.status_code >= 400 or not payload.get("success", True):
            return f"{server_id}: {answer.text[:500]}"
        if isinstance(payload.get("timings"), dict):
            stats.engine_timings.append(payload["timings"])
        return None

    calls = [asyncio.ensure_future(one(i, s, u)) for i, (s, u) in enumerate(window.servers)]
    failures: list[str] = []
    pending: set[asyncio.Future[str | None]] = set(calls)
    try:
        while pending and not (failures and fail_fast):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failures += [failure for call in calls if call in done and (failure := call.result())]
    finally:
        for call in pending:
            call.cancel()
    if failures:
        raise PublishError(f"{path} failed: " + "; ".join(failures))


def _shareable(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The parameters and buffers of ``module`` that ``share_memory`` moves: dense CPU tensors
    holding any bytes."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
            continue
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes and not nbytes % tensor.element_size():
            yield tensor


def _share(module: torch.nn.Module) -> Segment | None:
    """Move every CPU parameter and buffer of ``module`` into a new segment (each storage copied
    once, every tensor viewing it re-pointed, values unchanged); None when there is none."""
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for tensor in _shareable(module):
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    if not storages:
        return None
    offsets, size = [], 0
    for storage, _ in storages.values():
        offsets.append(size)
        size += -(-storage.nbytes() // _SHARED_ALIGN) * _SHARED_ALIGN
    segment = Segment(size)
    with torch.no_grad():
        for (storage, tensors), at in zip(storages.values(), offsets, strict=True):
            place = segment.flat[at : at + storage.nbytes()]
            place.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for tensor in tensors:
                start = at // tensor.element_size() + tensor.storage_offset()
                tensor.data = place.view(tensor.dtype).as_strided(tensor.size(), tensor.stride(), start)
    return segment


# Where shared storages start: a cache line, which every dtype's alignment divides.
_SHARED_ALIGN = 64


async def _stream(
    tables: Sequence[BucketTable],
    pack_one: Callable[[int, BucketTable], Awaitable[BucketTable]],
    send: Callable[[int, BucketTable, str | None], Coroutine[Any, Any, None]],
    *,
    stats: PushStats,
    unchanged: list[TensorDigest],
) -> str:
    """``pack_one`` each bucket (its index and table; it returns the table with the digests), then
    ``send`` it (its index, that table, and the model checksum with the last one); returns the
    checksum. The next bucket is packed while the engines take the one before; a bucket is sent
    only once the one before it is in, so a packer writing into two buffers in turn never writes
    into one the engines still read."""
    digests: list[TensorDigest] = list(unchanged)
    sending: asyncio.Task[None] | None = None
    checksum: str | None = None
    try:
        for index, table in enumerate(tables):
            packing = time.perf_counter()
            packed = await pack_one(index, table)
            stats.spent("pack", packing)
            digests += [e.tensor_digest() for e in packed.entries]
            stats.digests |= {e.name: e.tensor_digest().digest for e in packed.entries}
            if index == len(tables) - 1:
                checksum = checksum_from_digests(digests, num_bytes=0).checksum
            if sending is not None:
                await sending
            sending = asyncio.create_task(send(index, packed, checksum))
            stats.buckets += 1
            stats.bytes += packed.nbytes
        if sending is not None:
            await sending
    finally:
        if sending is not None and not sending.done():
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    assert checksum is not None
    return checksum


def _regions(tables: Sequence[BucketTable]) -> int:
    """Buffers to pack into: two when there is a next bucket to pack while one is taken."""
    return min(2, len(tables))


class _TensorPush:
    """Buckets handed to every engine on this machine through ``/update_weights_from_tensor``:
    host tensors written once into a shared-memory segment every engine maps, GPU tensors packed in
    the trainer's GPU memory and handed over as CUDA IPC handles (no copy through the host). Two
    regions either way: the next bucket is packed into one while the engines read the other."""

    def __init__(self, publisher: PushPublisher, window: Window, *, device: torch.device | None) -> None:
        self.publisher, self.window, self.device = publisher, window, device

    async def run(
        self,
        named: Mapping[str, torch.Tensor],
        *,
        version: str,
        stats: PushStats,
        unchanged: list[TensorDigest],
        known: Mapping[str, str] | None = None,
    ) -> str:
        """Push ``named``; ``known`` holds digests computed since the tensors last changed."""
        http = _Authorized(self.publisher.http, self.publisher.headers(self.window))
        in_place: list[BucketTable] = []
        if self.device is None and (shared := self.publisher.shared_segment) is not None:
            # Tensors that live in the publisher's shared segment are read where they are.
            offsets = {name: at for name, t in named.items() if (at := shared.offset_of(t)) is not None}
            for names in plan({n: named[n] for n in offsets}, bucket_bytes=self.publisher.bucket_bytes):
                entries = layout(named, names).entries
                in_place.append(
                    BucketTable(entries=tuple(e.model_copy(update={"offset": offsets[e.name]}) for e in entries))
                )
            named_rest = {n: t for n, t in named.items() if n not in offsets}
        else:
            named_rest = dict(named)
        buckets = plan(named_rest, bucket_bytes=self.publisher.bucket_bytes) if named_rest else []
        region = max((layout(named, names).total_bytes for names in buckets), default=0) or 1
        packed_tables = [layout(named, names, start=(i % 2) * region) for i, names in enumerate(buckets)]
        tables = in_place + packed_tables
        if self.device is None:
            # One segment, kept from push to push, with the two regions one after the other.
            segment = await self.publisher.segment(region * _regions(packed_tables)) if packed_tables else None

            def where(index: int) -> dict[str, Any]:
                if index < len(in_place):
                    assert self.publisher.shared_segment is not None
                    return {"shm": self.publisher.shared_segment.name}
                assert segment is not None
                return {"shm": segment.name}

            async def pack_one(index: int, table: BucketTable) -> BucketTable:
                if index < len(in_place):
                    stats.in_place += table.nbytes
                    return await _digest_in_place(named, table, known or {})
                assert segment is not None
                return await _pack(named, table, segment.flat)

            load_format = SHM_LOAD_FORMAT
        else:
            buffers = [torch.empty(region, dtype=torch.uint8, device=self.device) for _ in range(_regions(tables))]

            def where(index: int) -> dict[str, Any]:
                # A handle of its own per engine: each engine's release counts against its own.
                return {"cuda_ipc": cuda_ipc_handle(buffers[index % len(buffers)]).model_dump()}

            async def pack_one(index: int, table: BucketTable) -> BucketTable:
                return await _pack(named, table, buffers[index % len(buffers)])

            load_format = CUDA_IPC_LOAD_FORMAT

        async def send(index: int, packed: BucketTable, checksum: str | None) -> None:
            def body(_: int) -> dict[str, Any]:
                document = {**where(index), "table": packed.model_dump(mode="json")}
                return {
                    "serialized_named_tensors": [base64.b64encode(json.dumps(document).encode()).decode()],
                    "load_format": load_format,
                    "weight_version": version if checksum is not None else None,
                    "expected_checksum": checksum,
                    "activate": not self.window.staged,
                }

            waiting = time.perf_counter()
            await _post_all(http, self.window, "/update_weights_from_tensor", body, stats)
            stats.spent("engines", waiting)

        try:
            return await _stream(tables, pack_one, send, stats=stats, unchanged=unchanged)
        except BaseException:
            if self.device is None:
                await self.publisher.drop_segment()
            raise


async def _digest_in_place(
    named: Mapping[str, torch.Tensor], table: BucketTable, known: Mapping[str, str]
) -> BucketTable:
    """``table`` with each tensor's digest, computed where the tensor lies (nothing is copied)."""

    def digested() -> BucketTable:
        return BucketTable(
            entries=tuple(
                e.model_copy(update={"digest": known.get(e.name) or digest_tensor(named[e.name])})
                for e in table.entries
            )
        )

    if table.nbytes <= _INLINE_PACK_BYTES:
        return digested()
    return await asyncio.to_thread(digested)


def cuda_ipc_handle(buffer: torch.Tensor) -> CudaIpcHandle:
    """How another process on this machine opens the flat uint8 CUDA tensor ``buffer``."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, shared = reduce_tensor(buffer)
    (_, _, _, offset, _, _, device, handle, size, storage_offset, _, ref_handle, ref_offset, event, sync) = shared
    return CudaIpcHandle(
        device=device,
        numel=buffer.numel(),
        storage_offset=offset,
        storage_handle=base64.b64encode(handle).decode(),
        storage_size_bytes=size,
        storage_offset_bytes=storage_offset,
        ref_counter_handle=base64.b64encode(ref_handle).decode(),
        ref_counter_offset=ref_offset,
        event_handle=base64.b64encode(event).decode() if event else None,
        event_sync_required=bool(sync),
    )


class _DistributedPush:
    """A torch.distributed group with this process as rank 0; one broadcast per bucket, the next
    bucket packed into a second buffer while one is broadcast."""

    def __init__(self, publisher: PushPublisher, window: Window) -> None:
        self.publisher, self.window = publisher, window

    async def run(
        self,
        named: Mapping[str, torch.Tensor],
        *,
        version: str,
        stats: PushStats,
        unchanged: list[TensorDigest],
        known: Mapping[str, str] | None = None,
    ) -> str:
        """Push ``named`` (``known``: unused here, every byte is hashed as it is packed)."""
        publisher, window = self.publisher, self.window
        world = len(window.servers) + 1
        port = _free_port(publisher.master_address)
        timeout = timedelta(seconds=publisher.timeout_s)
        server = dist.TCPStore(publisher.master_address, port, world, True, timeout=timeout, wait_for_workers=False)
        # The group forms through a client of its own: dropping the server ends at once the wait of
        # a group that cannot form (which would otherwise run out its timeout on a thread, and a
        # process exiting meanwhile aborts in c10d).
        prefixed = dist.PrefixStore(
            GROUP_NAME, dist.TCPStore(publisher.master_address, port, world, False, timeout=timeout)
        )
        prefixed.set("joined/0", "1")
        http = _Authorized(publisher.http, publisher.headers(window))
        # NCCL between GPUs when the trainer's weights are on one (the engines receive on theirs),
        # gloo between CPUs otherwise.
        device = next((t.device for t in named.values() if t.device.type == "cuda"), None)
        backend = "nccl" if device is not None else "gloo"
        join_body = {
            "master_address": publisher.master_address,
            "master_port": port,
            "world_size": world,
            "group_name": GROUP_NAME,
            "backend": backend,
            "timeout_s": publisher.timeout_s,
        }
        joined = time.perf_counter()
        joining = asyncio.create_task(
            _post_all(
                http,
                window,
                "/init_weights_update_group",
                lambda i: {**join_body, "rank_offset": i + 1},
                stats,
                fail_fast=True,
            )
        )
        forming = _in_daemon_thread(_process_group, backend, prefixed, world, timeout)
        try:
            await asyncio.wait((forming, joining), return_when=asyncio.FIRST_EXCEPTION)
            refused = joining.exception() if joining.done() else None
            if refused is not None and not forming.done():
                # An engine refused to join or did not answer: the group cannot form, so say so now
                # rather than when its timeout runs out, and end the thread forming it.
                forming.add_done_callback(lambda f: f.cancelled() or f.exception())
                del server
                # Its thread ends at once now; a process that exits before it has ended aborts
                # in c10d ("terminate called without an active exception").
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.gather(forming, return_exceptions=True), timeout=_THREAD_END_S)
                raise refused
            group = await forming
        except (RuntimeError, dist.DistError):
            missing = [window.servers[r - 1][0] for r in range(1, world) if not prefixed.check([f"joined/{r}"])]
            await asyncio.gather(joining, return_exceptions=True)
            raise PublishError(
                f"the weight-update group did not form within {publisher.timeout_s:g}s: "
                f"{', '.join(missing) or 'no engine'} never joined"
            ) from None
        await joining
        stats.spent("join", joined)
        tables = [layout(named, names) for names in plan(named, bucket_bytes=publisher.bucket_bytes)]
        size = max(max(t.total_bytes for t in tables), 1)
        buffers = publisher.broadcast_buffers(_regions(tables), size)

        async def send(index: int, packed: BucketTable, checksum: str | None) -> None:
            body = {
                "names": [e.name for e in packed.entries],
                "dtypes": [e.dtype for e in packed.entries],
                "shapes": [list(e.shape) for e in packed.entries],
                "digests": [e.digest for e in packed.entries],
                "group_name": GROUP_NAME,
                "load_format": "flattened_bucket",
                "weight_version": version if checksum is not None else None,
                "expected_checksum": checksum,
                "activate": not window.staged,
                "timeout_s": publisher.timeout_s,
            }
            receiving = asyncio.create_task(
                _post_all(http, window, "/update_weights_from_distributed", _same(body), stats)
            )
            try:
                sent = buffers[index % len(buffers)][: packed.total_bytes]
                broadcasting = time.perf_counter()
                await asyncio.to_thread(_broadcast, group, sent if device is None else sent.to(device), timeout)
                stats.spent("broadcast", broadcasting)
            finally:
                # The engines' answers say why, when the broadcast failed.
                waiting = time.perf_counter()
                await receiving
                stats.spent("engines", waiting)

        try:
            return await _stream(
                tables,
                lambda index, table: _pack(named, table, buffers[index % len(buffers)]),
                send,
                stats=stats,
                unchanged=unchanged,
            )
        finally:
            await asyncio.gather(
                _post_all(http, window, "/destroy_weights_update_group", lambda _: {"group_name": GROUP_NAME}, stats),
                return_exceptions=True,
            )


def _digests(named: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {name: digest_tensor(tensor) for name, tensor in named.items()}


def _same(body: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    """The same body for every engine."""
    return lambda _: body


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` on a thread of its own, as a future of this loop. A daemon thread, unlike
    ``asyncio.to_thread``'s executor, does not hold up the loop's shutdown (or the interpreter's
    exit) while it waits for a group that will not form."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            outcome, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001  # handed to the awaiting task
            outcome, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, outcome, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    threading.Thread(target=run, name="miles-push-group", daemon=True).start()
    return future


def _process_group(backend: str, store: dist.Store, world: int, timeout: timedelta) -> Any:
    """This process as rank 0 of a group of ``world`` (the engines join as the other ranks)."""
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, 0, world, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, 0, world, timeout)


def _broadcast(group: Any, flat: torch.Tensor, timeout: timedelta) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = timeout
    group.broadcast([flat], options).wait(timeout)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])

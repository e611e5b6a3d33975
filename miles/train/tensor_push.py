"""The trainer's end of ``/update_weights_from_tensor``: buckets handed in memory to every engine
on this machine, host tensors in a shared-memory segment, GPU tensors as CUDA IPC handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass

import torch

from miles.protocol.sglang_weights import UpdateWeightsFromTensorRequest
from miles.train.engine_calls import EngineCalls, answered
from miles.weights.buckets import BucketTable, layout, plan, regions
from miles.weights.transport.cuda_ipc import share
from miles.weights.transport.documents import BucketDocument, CudaIpcDocument, ShmDocument
from miles.weights.transport.segments import Segment


class TensorPush:
    """Pushes through ``/update_weights_from_tensor``, keeping the segment buckets are written
    into from one push to the next (its pages are faulted in once, not per push)."""

    def __init__(self, *, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._segment: Segment | None = None

    async def _bucket_segment(self, size: int) -> Segment:
        if self._segment is not None and self._segment.size < size:
            await self.close()
        if self._segment is None:
            self._segment = await asyncio.to_thread(Segment, size)
        return self._segment

    async def close(self) -> None:
        """Remove the kept segment (the next push makes a new one)."""
        if self._segment is not None:
            segment, self._segment = self._segment, None
            await asyncio.to_thread(segment.close)

    @contextlib.asynccontextmanager
    async def push(
        self, named: Mapping[str, torch.Tensor], calls: EngineCalls, *, shared: Segment | None
    ) -> AsyncIterator[_Buckets]:
        """The buckets of one push of ``named``: tensors that lie in ``shared`` are read there, the
        others packed. A push that fails drops the kept segment: an engine may still read it."""
        device = next((t.device for t in named.values() if t.device.type == "cuda"), None)
        in_place: list[BucketTable] = []
        rest: Mapping[str, torch.Tensor] = named
        if device is None and shared is not None:
            offsets = {name: at for name, t in named.items() if (at := shared.offset_of(t)) is not None}
            for names in plan({n: named[n] for n in offsets}, bucket_bytes=self.bucket_bytes):
                entries = layout(named, names).entries
                in_place.append(
                    BucketTable(entries=tuple(e.model_copy(update={"offset": offsets[e.name]}) for e in entries))
                )
            rest = {n: t for n, t in named.items() if n not in offsets}
        names_of = plan(rest, bucket_bytes=self.bucket_bytes) if rest else []
        region = max((layout(named, names).total_bytes for names in names_of), default=0) or 1
        count = regions(len(names_of))
        segment = None
        if device is not None:
            # A buffer per region, each bucket's offsets from the start of its buffer.
            packed = [layout(named, names) for names in names_of]
            buffers = [torch.empty(region, dtype=torch.uint8, device=device) for _ in range(count)]
        else:
            # One segment, the two regions one after the other; each bucket's offsets are its
            # region's place in the segment.
            packed = [layout(named, names, start=(i % 2) * region) for i, names in enumerate(names_of)]
            segment = await self._bucket_segment(region * count) if packed else None
            buffers = [segment.flat] if segment is not None else []
        try:
            yield _Buckets(
                calls=calls,
                tables=in_place + packed,
                in_place=len(in_place),
                buffers=buffers,
                shared=shared,
                segment=segment,
            )
        except BaseException:
            if device is None:
                await self.close()
            raise


@dataclass(frozen=True)
class _Buckets:
    """One push's buckets: the first ``in_place`` read where they lie in ``shared``, the others
    packed in turn into ``buffers`` (``segment``, or a buffer of GPU memory per region)."""

    calls: EngineCalls
    tables: list[BucketTable]
    in_place: int
    buffers: list[torch.Tensor]
    shared: Segment | None
    segment: Segment | None

    def into(self, index: int) -> torch.Tensor | None:
        return None if index < self.in_place else self.buffers[(index - self.in_place) % len(self.buffers)]

    async def send(self, index: int, packed: BucketTable, *, checksum: str | None) -> Awaitable[None]:
        into = self.into(index)
        segment = self.shared if into is None else self.segment

        def request(_: int) -> UpdateWeightsFromTensorRequest:
            document: BucketDocument
            if segment is not None:
                document = ShmDocument(shm=segment.ref, table=packed)
            else:
                assert into is not None
                # A handle of its own per engine: each engine's release counts against its own.
                document = CudaIpcDocument(cuda_ipc=share(into), table=packed)
            return UpdateWeightsFromTensorRequest(
                serialized_named_tensors=[document.encode()],
                load_format=document.load_format,
                weight_version=self.calls.version if checksum is not None else None,
                expected_checksum=checksum,
                activate=not self.calls.window.staged,
            )

        waiting = time.perf_counter()
        # The engines read the bucket where it lies: its buffer is free once they answered.
        await self.calls.post("/update_weights_from_tensor", request)
        self.calls.stats.spent("engines", waiting)
        return answered()

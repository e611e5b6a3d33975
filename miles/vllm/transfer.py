"""miles' backend for vLLM's native weight transfer: pushed buckets read from shared memory.

vLLM's weight-transfer API (``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, with ``--weight-transfer-config {"backend": "miles"}``) hands each
``update_info`` to the backend registered under that name in the worker. This one takes the
document of a bucket ``PushPublisher`` wrote into a shared-memory segment on the server's node
(``{"document": ShmDocument.encode()}``, the same document an embedded engine reads), reads the
bucket's tensors from the segment, checks each against the digest it was sent with, and loads them
through the model's ``load_weights`` inside vLLM's layerwise reload (begun by
``start_weight_update``, completed by ``finish_weight_update``), the reload path that keeps vLLM's
fused and packed layers consistent. A tensor that arrives other than it was sent is refused before
its bucket is loaded; what the worker holds at the end is confirmed by the controller through
``miles_checksum``, as after every update.

A refused bucket ends vLLM's reload at once (``end_reload``): vLLM forgets the session on any
error but leaves the layers the reload had emptied on the meta device, holding nothing to serve
or hash. Ended, the layers already loaded keep what they got and the others take back the weights
they held, so the controller's checksum sees a model that exists, and its rollback reloads it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import ModelConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

from miles.weights.buckets import unpack
from miles.weights.transport.documents import SHM_LOAD_FORMAT, ShmDocument, decode
from miles.weights.transport.segments import SegmentMaps

BACKEND = "miles"


@dataclass
class MilesInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the buckets come through shared memory on the server's node."""


@dataclass
class MilesUpdateInfo(WeightTransferUpdateInfo):
    # ``ShmDocument.encode()`` of one bucket.
    document: str


class MilesTransferEngine(WeightTransferEngine[MilesInitInfo, MilesUpdateInfo]):
    """See the module docstring."""

    init_info_cls = MilesInitInfo
    update_info_cls = MilesUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The segments pushes name, mapped once and kept while their trainer holds them.
        self.segments = SegmentMaps(forget_every_s=1.0)

    def init_transfer_engine(self, init_info: MilesInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: MilesUpdateInfo) -> None:
        document = decode(SHM_LOAD_FORMAT, [update_info.document])
        assert isinstance(document, ShmDocument)  # decode checked the format
        try:
            received = unpack(document.table, self.segments.flat(document.shm, document.table.total_bytes))
            received.verify()
            # Copies of the mapped bytes: vLLM's layerwise reload keeps what it is given until the
            # layer is complete, and the segment is the trainer's to write the next bucket into.
            self.model.load_weights((name, tensor.clone()) for name, tensor in received.tensors.items())
            received.close()
        except BaseException:
            end_reload(self.model, self.model_config)
            raise

    def shutdown(self) -> None:
        self.segments.clear()


def end_reload(model: torch.nn.Module, model_config: ModelConfig) -> bool:
    """Finish a layerwise reload left open (see the module docstring); False when none was."""
    if not any(info.can_load() for layer in model.modules() if (info := LAYERWISE_INFO.get(layer)) is not None):
        return False
    finalize_layerwise_reload(model, model_config)
    return True


def register() -> None:
    """Make the backend known to vLLM's factory (once per process)."""
    with contextlib.suppress(ValueError):  # registered already
        WeightTransferEngineFactory.register_engine(BACKEND, MilesTransferEngine)

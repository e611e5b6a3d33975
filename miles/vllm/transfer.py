"""miles' backend for vLLM's native weight transfer: pushed buckets, read from shared memory on the
server's node or broadcast over a torch.distributed group formed with the trainer.

``init_info`` is an ``InitWeightsUpdateGroupRequest``; ``update_info`` is one bucket,
``{"document": ShmDocument.encode()}`` or ``{"distributed": UpdateWeightsFromDistributedRequest}``.
A refused bucket ends vLLM's layerwise reload at once (``end_reload``). docs/VLLM.md, "Pushes from
memory", has the calls and why.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError
from vllm.config import ModelConfig
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

from miles.errors import ConflictError
from miles.protocol.sglang_weights import InitWeightsUpdateGroupRequest, UpdateWeightsFromDistributedRequest
from miles.weights.buckets import Received, unpack
from miles.weights.transport import groups
from miles.weights.transport.documents import SHM_LOAD_FORMAT, ShmDocument, decode
from miles.weights.transport.segments import SegmentMaps

BACKEND = "miles"

logger = logging.getLogger("miles.vllm")


@dataclass
class MilesInitInfo(WeightTransferInitInfo):
    """The trainer's group to join, for a push by broadcast."""

    group: InitWeightsUpdateGroupRequest


@dataclass
class MilesUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: in a shared-memory segment on this node, or the group's next broadcast."""

    bucket: ShmDocument | UpdateWeightsFromDistributedRequest


class MilesTransferEngine(WeightTransferEngine[MilesInitInfo, MilesUpdateInfo]):
    init_info_cls = MilesInitInfo
    update_info_cls = MilesUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The segments pushes name, mapped once and kept while their trainer holds them.
        self.segments = SegmentMaps(forget_every_s=1.0)
        self._group: groups.Joined | None = None

    def parse_init_info(self, init_dict: dict[str, Any]) -> MilesInitInfo:
        try:
            return MilesInitInfo(group=InitWeightsUpdateGroupRequest.model_validate(init_dict))
        except ValidationError as exc:
            raise ValueError(f"init_info must be an InitWeightsUpdateGroupRequest (SGLang's fields): {exc}") from None

    def parse_update_info(self, update_dict: dict[str, Any]) -> MilesUpdateInfo:
        if set(update_dict) == {"document"}:
            document = decode(SHM_LOAD_FORMAT, [update_dict["document"]])
            assert isinstance(document, ShmDocument)  # decode checked the format
            return MilesUpdateInfo(bucket=document)
        if set(update_dict) == {"distributed"}:
            try:
                request = UpdateWeightsFromDistributedRequest.model_validate(update_dict["distributed"])
            except ValidationError as exc:
                raise ValueError(
                    f"update_info.distributed must be an UpdateWeightsFromDistributedRequest: {exc}"
                ) from None
            return MilesUpdateInfo(bucket=request)
        raise ValueError(
            f"update_info holds {sorted(update_dict)}; send {{'document': ShmDocument}} (a bucket in shared "
            "memory on this node) or {'distributed': UpdateWeightsFromDistributedRequest} (the group's next broadcast)"
        )

    def init_transfer_engine(self, init_info: MilesInitInfo) -> None:
        request = init_info.group
        groups.member_device(request, self.device)  # a request refused leaves the group held as it was
        # One group at a time: a group still held was joined for a window that is over (the
        # controller opens one at a time) and whose close did not reach this worker.
        self.leave()
        where = ["starting"]  # where the join is, for the message when it is given up

        def join() -> groups.Joined:
            return groups.join(request, device=self.device, phase=lambda now: where.append(now))

        # Bounded whatever rank 0 does: torch's store handshake has no time limit of its own, and
        # this is the worker's only thread (a join left running keeps no group).
        try:
            self._group = groups.within(join, timeout_s=request.timeout_s + groups.JOIN_GRACE_S, name="miles-join")
        except TimeoutError:
            raise groups.given_up(request, where[-1]) from None
        logger.info(
            "joined weight-update group %s as rank %d of %d",
            request.group_name,
            request.rank_offset,
            request.world_size,
        )

    def leave(self) -> str | None:
        """Leave the group this worker is in; its name, None when it was in none."""
        group, self._group = self._group, None
        if group is None:
            return None
        logger.info("left weight-update group %s", group.name)
        return group.name

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: MilesUpdateInfo) -> None:
        with contextlib.ExitStack() as stack:
            try:
                received = self._received(update_info.bucket, stack)
                received.verify()
                self.model.load_weights(iter(received.tensors.items()))
            except BaseException:
                end_reload(self.model, self.model_config)
                raise

    def _received(
        self, bucket: ShmDocument | UpdateWeightsFromDistributedRequest, stack: contextlib.ExitStack
    ) -> Received:
        """The bucket's tensors as they arrived (closed with ``stack``), nothing checked yet."""
        if isinstance(bucket, ShmDocument):
            # A copy of its own, as a broadcast has a buffer of its own (below): the segment is the
            # trainer's to write its next bucket into.
            mapped = self.segments.flat(bucket.shm, bucket.table.total_bytes)
            received = unpack(bucket.table, mapped[: bucket.table.total_bytes].clone())
        else:
            group = self._group
            if group is None or group.name != bucket.group_name:
                raise ConflictError(
                    f"this worker is in no group {bucket.group_name!r}: join it first (/init_weight_transfer_engine)"
                )
            table = groups.broadcast_table(bucket)
            try:
                # A buffer of its own per bucket: vLLM's layerwise reload keeps the tensors it is
                # given until the rest of their layer arrives, so a buffer kept for the next bucket
                # would be overwritten under them (the loaded weights then fail the checksum). The
                # shared-memory path reads into new tensors alike.
                flat = torch.empty(table.total_bytes, dtype=torch.uint8, device=group.device)
                received = group.receive(bucket, table, flat)
            except ConflictError:
                self.leave()  # a broadcast that failed leaves the group out of step: of no more use
                raise
        stack.callback(received.close)
        return received

    def shutdown(self) -> None:
        self.leave()
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

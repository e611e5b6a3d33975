"""SGLangRollout: servers that are real SGLang servers, launched by the controller or attached.

Launched (no ``urls``): ``python -m sglang.launch_server`` with the spec's ``SGLangServerArgs`` on
the host, port and GPUs its runtime gave it, wrapped by ``miles.rollout.with_parent``. Attached
(``urls``): servers someone else runs, never started or stopped here. Everything is the base
``Rollout`` but the confirmation: SGLang reports its own digest, which ``DigestBook`` maps onto
miles' canonical checksum (``sglang_digests``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from miles.config import RuntimeKind
from miles.errors import CheckpointError
from miles.protocol.sglang import PauseMode
from miles.rollout.engine_client import SGLANG_ENGINE_DIGEST, EngineCallError, WeightsChecksum
from miles.rollout.rollout import Rollout, RolloutError, refuse_miles_flags
from miles.rollout.runtime import EngineCommand, LaunchSlot
from miles.rollout.sglang_digests import DigestBook
from miles.rollout.spec import RolloutSpec, SGLangServerArgs
from miles.weights.checksum import ALGORITHM, model_checksum

logger = logging.getLogger("miles.rollout")

# How an SGLang server is started (after this interpreter), as SGLang's docs and Miles do.
DEFAULT_LAUNCHER = ("-m", "sglang.launch_server")


# The flags miles sets on every server (and SGLang's other spellings of them), by ServerArgs
# field: given again in ``engine_args`` they would win (argparse keeps the last), and a server
# would listen elsewhere than the controller looks, or use GPUs its runtime did not give it.
MILES_FLAGS: dict[str, tuple[str, ...]] = {
    "model_path": ("--model-path", "--model"),
    "host": ("--host",),
    "port": ("--port",),
    "served_model_name": ("--served-model-name",),
    "tp_size": ("--tp-size", "--tensor-parallel-size"),
    "dp_size": ("--dp-size", "--data-parallel-size"),
    "max_running_requests": ("--max-running-requests",),
    "base_gpu_id": ("--base-gpu-id",),
    "mem_fraction_static": ("--mem-fraction-static",),
    "context_length": ("--context-length",),
}
# Where the spec says each of them instead.
_SPEC_FIELD = {
    "model_path": "checkpoint",
    "host": "the runtime (it picks the address)",
    "port": "the runtime (it picks a free port)",
    "served_model_name": "model_name",
    "max_running_requests": "max_running_requests",
    "base_gpu_id": "devices (local) or the Ray bundle",
}


_WHERE = {flag: _SPEC_FIELD.get(field, f"sglang.{field}") for field, flags in MILES_FLAGS.items() for flag in flags}


def check_engine_args(engine_args: tuple[str, ...]) -> None:
    """Refuse extra SGLang flags that repeat one miles sets, naming where to set it instead."""
    refuse_miles_flags(engine_args, _WHERE, engine="SGLang")


@dataclass(frozen=True)
class SGLangLaunchCommand(EngineCommand):
    """``python -m sglang.launch_server`` for one server, given where the runtime placed it."""

    served_model_name: str
    max_running_requests: int
    args: SGLangServerArgs
    extra_args: tuple[str, ...] = ()

    def server_args(self, slot: LaunchSlot, checkpoint: Path) -> list[str]:
        """SGLang's arguments (``ServerArgs`` flags): what miles sets, then the user's extras."""
        placement = slot.placement
        args = ["--model-path", str(checkpoint), "--host", slot.host, "--port", str(slot.port)]
        args += ["--served-model-name", self.served_model_name]
        args += ["--tp-size", str(self.args.tp_size), "--dp-size", str(self.args.dp_size)]
        args += ["--max-running-requests", str(self.max_running_requests)]
        if placement.gpu_ids:
            # The runtime gave this server its GPUs; SGLang takes tp*dp consecutive ones from here.
            args += ["--base-gpu-id", str(placement.gpu_ids[0])]
        if self.args.mem_fraction_static is not None:
            args += ["--mem-fraction-static", str(self.args.mem_fraction_static)]
        if self.args.context_length is not None:
            args += ["--context-length", str(self.args.context_length)]
        return [*args, *self.extra_args]

    def argv(self, slot: LaunchSlot, checkpoint: Path) -> list[str]:
        launcher = list(self.args.launcher) if self.args.launcher else [sys.executable, *DEFAULT_LAUNCHER]
        # SGLang has no --exit-with-parent: the wrapper ends its whole process group for it.
        wrapper = [sys.executable, "-m", "miles.rollout.with_parent", "--"]
        return [*wrapper, *launcher, *self.server_args(slot, checkpoint)]

    def environment(self, slot: LaunchSlot) -> dict[str, str]:
        # SGLang reads none of miles' credentials; the server is protected by its network
        # (loopback, or the cluster's) and the controller's gate (docs/SGLANG.md).
        return {}


class SGLangRollout(Rollout):
    """SGLang servers, launched (``sglang.launch_server``) or attached (``urls``); see the module docstring."""

    can_attach = True
    takes_sglang_args = True

    def _prepare(self, spec: RolloutSpec) -> None:
        if not spec.urls:
            check_engine_args(spec.engine_args)
        if spec.runtime is RuntimeKind.RAY and not spec.urls:
            check_ray_gpus(spec)
        self._digests = DigestBook()
        # server id -> the checkpoint it was last given (launched on, or loaded): the weights its
        # next SGLang digest is tied to, once the files are hashed (only for SGLang digests).
        self._given: dict[str, Path | None] = {}
        # checkpoint -> (what its files looked like, their canonical checksum)
        self._hashed: dict[Path, tuple[tuple[tuple[str, int, int], ...], str]] = {}

    def engine_command(self) -> EngineCommand:
        return SGLangLaunchCommand(
            served_model_name=self.model_name,
            max_running_requests=self.spec.max_running_requests,
            args=self.spec.sglang,
            extra_args=self.spec.engine_args,
        )

    def _holds_files(self, server_id: str, checkpoint: Path | None) -> None:
        # SGLang loads without checking the files against the expected checksum: the digest it
        # reports next is tied to the files' own checksum.
        self._given[server_id] = checkpoint

    async def confirm(self, server_id: str, *, fence: int | None = None) -> WeightsChecksum:
        """The canonical checksum of what the server holds (an SGLang digest translated by the book)."""
        reported = await self.client(server_id).weights_checksum(timeout=self.spec.update_timeout_s, fence=fence)
        if reported.algorithm == SGLANG_ENGINE_DIGEST:
            given = self._given.get(server_id)
            loaded = await self._checksum_of(given) if given is not None else None
            canonical = self._digests.translate(reported.checksum, layout=reported.layout, loaded=loaded)
            reported = dataclasses.replace(reported, checksum=canonical, algorithm=ALGORITHM)
        return self.record_checksum(server_id, reported)

    async def pause(self, server_id: str, mode: PauseMode, *, fence: int | None = None) -> int:
        """As the base; ``drain`` on an SGLang server (which has no such mode) pauses nothing: it is
        out of routing, and its weight updates wait for running requests (``model_update_lock``)."""
        try:
            return await super().pause(server_id, mode, fence=fence)
        except EngineCallError as exc:
            if mode is not PauseMode.DRAIN or exc.status_code not in (400, 422):
                raise
            logger.debug("%s has no drain mode; its weight updates drain by themselves", server_id)
            return 0

    async def fence(self, server_id: str, token: int, *, window_open: bool, staged: bool = False) -> None:
        """As the base on servers that fence (the embedded engine); SGLang has no ``/fence``."""
        try:
            await super().fence(server_id, token, window_open=window_open, staged=staged)
        except EngineCallError as exc:
            if exc.status_code != 404:
                raise
            logger.debug("%s does not fence (no /fence endpoint)", server_id)

    async def _checksum_of(self, checkpoint: Path) -> str | None:
        """The canonical checksum of a checkpoint's files, hashed again only when they changed."""
        try:
            files = await asyncio.to_thread(_file_signature, checkpoint)
            known = self._hashed.get(checkpoint)
            if known is not None and known[0] == files:
                return known[1]
            checksum = await asyncio.to_thread(model_checksum, checkpoint)
        except (CheckpointError, OSError) as exc:
            logger.warning("cannot hash %s: %s", checkpoint, exc)
            return None
        self._hashed[checkpoint] = (files, checksum)
        return checksum


def check_ray_gpus(spec: RolloutSpec) -> None:
    """On Ray, each bundle must hold the tp_size * dp_size GPUs SGLang uses (or a share of one, for one GPU)."""
    wanted = spec.sglang.tp_size * spec.sglang.dp_size
    given = spec.num_gpus_per_engine
    if given == wanted or (wanted == 1 and 0 < given < 1):
        return
    raise RolloutError(
        f"an SGLang server with tp_size={spec.sglang.tp_size} and dp_size={spec.sglang.dp_size} uses {wanted} "
        f"GPU(s), but each engine asks Ray for {given}; set num_gpus_per_engine={wanted}",
        rollout=spec.name,
    )


def _file_signature(checkpoint: Path) -> tuple[tuple[str, int, int], ...]:
    entries = sorted(p for p in checkpoint.iterdir() if p.is_file())
    return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in entries)

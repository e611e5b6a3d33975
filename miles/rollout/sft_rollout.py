"""SFTRollout: the reference server type, each server an embedded engine (``python -m miles.engine``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from miles.rollout.engine_process import engine_command
from miles.rollout.rollout import Rollout
from miles.rollout.runtime import EngineCommand, LaunchSlot


@dataclass(frozen=True)
class EmbeddedEngineCommand(EngineCommand):
    """The embedded engine's command line and environment, given where the runtime placed it."""

    served_model_name: str
    max_running_requests: int
    num_threads: int
    engine_args: tuple[str, ...]
    # Secrets travel in the environment, never on the command line (which `ps` shows anyone).
    secret: str | None
    guard_inference: bool

    def argv(self, slot: LaunchSlot, checkpoint: Path) -> list[str]:
        placement = slot.placement
        args = ["--device", placement.device, "--node-id", placement.node_id]
        if placement.gpu_ids:
            args += ["--gpu-ids", ",".join(str(i) for i in placement.gpu_ids)]
        args += ["--served-model-name", self.served_model_name]
        args += ["--max-running-requests", str(self.max_running_requests)]
        args += ["--snapshot-dir", str(slot.work_dir), *self.engine_args]
        return engine_command(checkpoint, host=slot.host, port=slot.port, num_threads=self.num_threads, extra_args=args)

    def environment(self, slot: LaunchSlot) -> dict[str, str]:
        # Always set, so an engine never inherits other roots from its parent's environment.
        env = {"MILES_ALLOWED_CHECKPOINT_ROOTS": os.pathsep.join(str(r) for r in slot.checkpoint_roots)}
        if self.secret is not None:
            env["MILES_ENGINE_SECRET"] = self.secret
            if self.guard_inference:
                env["MILES_API_KEY"] = self.secret
        return env


class SFTRollout(Rollout):
    """Runs each server as an embedded engine, wherever the spec's runtime places it."""

    def engine_command(self) -> EngineCommand:
        spec = self.spec
        return EmbeddedEngineCommand(
            served_model_name=self.model_name,
            max_running_requests=spec.max_running_requests,
            num_threads=spec.threads_per_engine(),
            engine_args=spec.engine_args,
            secret=spec.engine_secret.get_secret_value() if spec.engine_secret else None,
            guard_inference=spec.guard_inference,
        )

"""SFTRollout: the reference server type, each server an embedded engine process on this machine."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from miles.rollout.engine_process import EngineProcess, EngineStartError, engine_command, free_port
from miles.rollout.rollout import Rollout
from miles.rollout.spec import RolloutSpec
from miles.rollout.state import ServerCell

_LAUNCH_ATTEMPTS = 3  # a freshly picked free port can be taken before the engine binds it


class SFTRollout(Rollout):
    """Runs each server as ``python -m miles.engine`` on a free loopback port and its own device."""

    def __init__(self, spec: RolloutSpec, **hooks: Any) -> None:
        super().__init__(spec, **hooks)
        self._processes: dict[str, EngineProcess] = {}
        # Without directories from the caller, logs and weight copies go to a temporary directory
        # of our own, removed by stop() so that nothing is left behind.
        self._own_dir: Path | None = None
        if spec.log_dir is not None and spec.snapshot_dir is not None:
            self._log_root, self._snapshot_dir = spec.log_dir, spec.snapshot_dir
        else:
            own = self._own_dir = Path(tempfile.mkdtemp(prefix=f"miles-{spec.name}-"))
            self._log_root = spec.log_dir or own / "logs"
            self._snapshot_dir = spec.snapshot_dir or own / "snapshots"

    async def stop(self) -> None:
        await super().stop()
        if self._own_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._own_dir, ignore_errors=True)

    async def _launch(self, cell: ServerCell, checkpoint: Path) -> str:
        last_error: EngineStartError | None = None
        for _ in range(_LAUNCH_ATTEMPTS):
            port = free_port()
            process = EngineProcess(
                command=self._command(cell, checkpoint, port),
                log_path=self._log_root / f"{cell.server_id}.log",
                env=self._environment(),
            )
            # mkdir, open and fork/exec: off the loop, which keeps serving the other servers.
            await asyncio.to_thread(process.start)
            self._processes[cell.server_id] = process
            cell.pid = process.pid
            url = f"http://127.0.0.1:{port}"
            try:
                await process.wait_healthy(url, timeout_s=self.spec.startup_timeout_s, http=self.http)
            except EngineStartError as exc:
                last_error = exc
                await process.stop(grace_s=2.0)
                if "address already in use" not in str(exc.context.get("tail", "")).lower():
                    break
            else:
                return url
        assert last_error is not None
        raise last_error

    def _command(self, cell: ServerCell, checkpoint: Path, port: int) -> list[str]:
        return engine_command(
            checkpoint,
            port=port,
            num_threads=self.spec.threads_per_engine(),
            extra_args=(
                "--device",
                cell.device,
                "--served-model-name",
                self.model_name,
                "--max-running-requests",
                str(self.spec.max_running_requests),
                "--snapshot-dir",
                str(self._snapshot_dir),
                *self.spec.engine_args,
            ),
        )

    def _environment(self) -> dict[str, str]:
        """What the engine reads at start-up besides its flags. Secrets travel in the environment,
        never on the command line, which any user of the machine can read with ``ps``."""
        spec = self.spec
        env = {}
        if spec.engine_secret is not None:
            secret = spec.engine_secret.get_secret_value()
            env["MILES_ENGINE_SECRET"] = secret
            if spec.guard_inference:
                env["MILES_API_KEY"] = secret
        # Always set, so an engine never inherits other roots from this process's environment.
        roots = [*spec.allowed_checkpoint_roots, self._snapshot_dir] if spec.allowed_checkpoint_roots else []
        env["MILES_ALLOWED_CHECKPOINT_ROOTS"] = os.pathsep.join(str(r) for r in roots)
        return env

    async def _terminate(self, cell: ServerCell) -> None:
        process = self._processes.pop(cell.server_id, None)
        if process is not None:
            await process.stop()
        cell.pid = None

    def _alive(self, cell: ServerCell) -> bool:
        process = self._processes.get(cell.server_id)
        return process is not None and process.alive()

"""VLLMRollout: servers that are real vLLM servers, launched by the controller or attached.

Each is vLLM's OpenAI API server, run by vLLM's own interpreter (``vllm_python``) and wrapped by
``miles.rollout.with_parent``, with miles' worker extension (``miles.vllm.extension``) verifying
and hashing the weights and every cache under its work directory. Pushes arrive through vLLM's
weight transfer (``miles.vllm.transfer``), always paused: vLLM cannot stage (docs/VLLM.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx

import miles
from miles.rollout.engine_client import EngineClient
from miles.rollout.rollout import Rollout, RolloutError, refuse_miles_flags
from miles.rollout.runtime import EngineCommand, EngineReport, LaunchSlot
from miles.rollout.spec import RolloutSpec, VLLMServerArgs
from miles.rollout.state import EngineApi, ServerCell
from miles.rollout.vllm_client import VLLMClient

VLLM_PYTHON_ENV = "MILES_VLLM_PYTHON"
EXTENSION_CLS = "miles.vllm.extension.MilesWorkerExtension"
# Where ``make vllm`` builds vLLM's environment, beside the project's own.
PROJECT_VLLM_PYTHON = Path(miles.__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"

# The flags miles sets (and vLLM's other spellings of them), with where the spec says each instead.
MILES_FLAGS: dict[str, str] = {
    "--model": "checkpoint",
    "--host": "the runtime (it picks the address)",
    "--port": "the runtime (it picks a free port)",
    "--served-model-name": "model_name",
    "--max-num-seqs": "max_running_requests",
    "--dtype": "vllm.dtype",
    "--max-model-len": "vllm.max_model_len",
    "--worker-extension-cls": "nothing: miles' extension is what verifies the weights",
    "--tensor-parallel-size": "nothing: a vLLM server under miles runs one worker",
    "-tp": "nothing: a vLLM server under miles runs one worker",
}


def vllm_python(args: VLLMServerArgs) -> Path:
    """The interpreter that runs vLLM: the spec's, else ``$MILES_VLLM_PYTHON``, else the project's."""
    given = args.python or os.environ.get(VLLM_PYTHON_ENV)
    python = Path(given) if given else PROJECT_VLLM_PYTHON
    if not python.is_file():
        raise RolloutError(
            f"no vLLM interpreter at {python}: run `make vllm` (it builds .venv-vllm), or give the python of "
            f"an environment with vLLM as vllm.python or {VLLM_PYTHON_ENV}"
        )
    return python


def checkpoint_dtype(checkpoint: Path) -> str:
    """The dtype the checkpoint's config declares (vLLM's ``--dtype``), "auto" when it declares none."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    dtype = (config.get("dtype") or config.get("torch_dtype")) if isinstance(config, dict) else None
    return dtype if dtype in ("float32", "float16", "bfloat16") else "auto"


@dataclass(frozen=True)
class VLLMLaunchCommand(EngineCommand):
    """vLLM's API server for one server, given where the runtime placed it."""

    python: Path
    served_model_name: str
    max_running_requests: int
    args: VLLMServerArgs
    extra_args: tuple[str, ...] = ()
    # The threads of a CPU server's worker (the rollout's share of this machine's cores).
    num_threads: int | None = None

    # vLLM has no /get_server_info: its dev mode's /server_info holds its config.
    info_route: ClassVar[str] = "/server_info?config_format=json"

    def reported(self, info: Mapping[str, Any], slot: LaunchSlot) -> EngineReport:
        """The device vLLM's config names; the GPUs those ``environment`` gave it (vLLM does not say)."""
        config = info.get("vllm_config")
        devices = config.get("device_config") if isinstance(config, dict) else None
        device = devices.get("device") if isinstance(devices, dict) else None
        gpus = slot.placement.gpu_ids
        if device == "cuda" and gpus:
            device = f"cuda:{gpus[0]}"
        # None: a platform that runs its inputs on the host.
        return EngineReport(device=str(device) if device else "cpu", gpu_ids=gpus)

    def argv(self, slot: LaunchSlot, checkpoint: Path) -> list[str]:
        args = ["--model", str(checkpoint), "--served-model-name", self.served_model_name]
        args += ["--host", slot.host, "--port", str(slot.port)]
        args += ["--dtype", self.args.dtype or checkpoint_dtype(checkpoint)]
        args += ["--max-num-seqs", str(self.max_running_requests), "--worker-extension-cls", EXTENSION_CLS]
        # Pushes from a training window arrive through vLLM's weight transfer, miles' backend.
        args += ["--weight-transfer-config", json.dumps({"backend": "miles"})]
        if self.args.max_model_len is not None:
            args += ["--max-model-len", str(self.args.max_model_len)]
        args += ["--enable-prefix-caching" if self.args.enable_prefix_caching else "--no-enable-prefix-caching"]
        server = [str(self.python), "-m", "vllm.entrypoints.openai.api_server"]
        # vLLM has no --exit-with-parent: the wrapper ends its process group (API server, engine
        # core, workers) for it, and removes its sockets' directory after.
        wrapper = [sys.executable, "-m", "miles.rollout.with_parent", "--remove", str(_socket_dir(slot)), "--"]
        return [*wrapper, *server, *args, *self.extra_args]

    def environment(self, slot: LaunchSlot) -> dict[str, str]:
        """Everything vLLM writes, under the server's own directory; miles' package importable."""
        root = slot.work_dir / "vllm"
        importable = root / "pythonpath"
        importable.mkdir(parents=True, exist_ok=True)
        link = importable / "miles"
        if not link.is_symlink():
            with contextlib.suppress(FileExistsError):  # a peer launching at once made it
                link.symlink_to(Path(miles.__file__).resolve().parent, target_is_directory=True)
        sockets = _socket_dir(slot)
        sockets.mkdir(mode=0o700, exist_ok=True)
        env = {
            "VLLM_RPC_BASE_PATH": str(sockets),
            # The address its processes give each other: the server's own (vLLM picks the
            # machine's routable one otherwise).
            "VLLM_HOST_IP": slot.host,
            # Where the worker writes out the weights it holds (pushed ones lie on no disk).
            "MILES_SNAPSHOT_DIR": str(slot.work_dir),
            "PYTHONPATH": str(importable),
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.args.cpu_kv_cache_gib),
            "VLLM_CACHE_ROOT": str(root / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "TRITON_CACHE_DIR": str(root / "triton"),
            "XDG_CACHE_HOME": str(root / "xdg"),
            "HF_HOME": str(root / "hf"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TMPDIR": str(root / "tmp"),
        }
        (root / "tmp").mkdir(exist_ok=True)
        if slot.placement.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in slot.placement.gpu_ids)
        elif self.num_threads is not None:
            # vLLM would pin every CPU server's worker to the same cores (its "auto" binding
            # takes the machine as its own: on two cores, core 0 for the worker, core 1 kept for
            # its engine core), so servers side by side would share one core. Each takes the
            # rollout's share of threads instead, unpinned, as embedded engines do.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = str(self.num_threads)
        return env


def _socket_dir(slot: LaunchSlot) -> Path:
    """The server's own short directory for its IPC sockets (a socket's path is at most 107 bytes)."""
    owner = hashlib.blake2b(str(slot.work_dir).encode(), digest_size=4).hexdigest()
    return Path(tempfile.gettempdir()) / f"miles-vllm-{owner}-{slot.port}"


class VLLMRollout(Rollout):
    """Servers that are vLLM servers; see the module docstring."""

    can_attach: ClassVar[bool] = True
    takes_vllm_args: ClassVar[bool] = True
    stages_pushes: ClassVar[bool] = False
    engine_api: ClassVar[EngineApi] = "vllm"

    def _prepare(self, spec: RolloutSpec) -> None:
        refuse_miles_flags(spec.engine_args, MILES_FLAGS, engine="vLLM")
        # Attached servers run on their owner's vLLM; launching needs one here.
        self._python = None if spec.urls else vllm_python(spec.vllm)

    def engine_command(self) -> EngineCommand:
        return VLLMLaunchCommand(
            # Attached servers are never launched (their runtime starts nothing): no vLLM here.
            python=self._python or PROJECT_VLLM_PYTHON,
            served_model_name=self.model_name,
            max_running_requests=self.spec.max_running_requests,
            args=self.spec.vllm,
            extra_args=self.spec.engine_args,
            num_threads=self.spec.threads_per_engine(),
        )

    async def _launch(self, cell: ServerCell, checkpoint: Path) -> str:
        url = await super()._launch(cell, checkpoint)
        # vLLM compiles its logprob kernels on the first request that asks for logprobs, and again
        # on the first batch of several (~14 s each on two cores, its worker blocked meanwhile:
        # long enough for three failed health checks and a restart). Such requests now, within
        # the start's time, compile them into the server's cache, which its restarts reuse.
        await VLLMClient(url, http=self.http, server_id=cell.server_id).warm_up(timeout=self.spec.startup_timeout_s)
        return url

    def new_client(self, url: str, *, server_id: str, http: httpx.AsyncClient, secret: str | None) -> EngineClient:
        # vLLM checks no miles secret: its server is protected by its network, like SGLang's.
        return VLLMClient(url, http=http, server_id=server_id)

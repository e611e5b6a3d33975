"""What a rollout is asked to run: its checkpoint, how many servers, devices, health and timeouts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, StrictFloat, StrictInt, model_validator

from miles.config import DEFAULT_CPUS_PER_ENGINE, CheckpointTransfer, PlacementStrategy, RuntimeKind


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class HealthSettings(_Frozen):
    """How often a rollout's supervisor probes its servers and when it gives up on one."""

    interval_s: Annotated[float, Field(gt=0)] = 2.0
    timeout_s: Annotated[float, Field(gt=0)] = 5.0
    failure_threshold: Annotated[int, Field(ge=1)] = 3


def _engine_url(value: str) -> str:
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL as exc:
        raise ValueError(f"{value!r} is not a server's base URL ({exc}); give one like http://10.0.0.5:30000") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"{value!r} is not a server's base URL; give one like http://10.0.0.5:30000")
    if url.path not in ("", "/") or url.query or url.fragment:
        raise ValueError(f"{value!r} has a path or query; give the server's base URL (http://HOST:PORT)")
    if url.userinfo:
        # It would be shown in /health and the logs; SGLang servers take no credentials from miles.
        raise ValueError(f"the server URL for {url.host} carries credentials; give http://HOST:PORT without them")
    if url.port is not None and not 1 <= url.port <= 65535:
        raise ValueError(f"{value!r} has port {url.port}; a port is 1..65535")
    return value.rstrip("/")


# A server's base URL (``http://HOST:PORT``), normalised without a trailing slash.
EngineUrl = Annotated[str, Field(min_length=1, max_length=2048), AfterValidator(_engine_url)]


def _unique_urls(urls: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(urls)) != len(urls):
        raise ValueError("urls lists a server twice; give each attached server once")
    return urls


# Attached servers' base URLs, one per server, each once.
EngineUrls = Annotated[tuple[EngineUrl, ...], AfterValidator(_unique_urls)]


class SGLangServerArgs(_Frozen):
    """What each launched SGLang server is given beside what miles sets (SGLang's ``ServerArgs``
    names; the spec's ``engine_args`` are passed through as they are, after these)."""

    tp_size: Annotated[StrictInt, Field(ge=1, le=64)] = 1
    dp_size: Annotated[StrictInt, Field(ge=1, le=64)] = 1
    mem_fraction_static: Annotated[StrictFloat, Field(gt=0, lt=1)] | None = None
    context_length: Annotated[StrictInt, Field(ge=1)] | None = None
    # The program that serves (before its arguments); default ``python -m sglang.launch_server``
    # with this interpreter. Another program taking SGLang's arguments may stand in for it.
    launcher: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], Field(min_length=1)] | None = None


class VLLMServerArgs(_Frozen):
    """What each launched vLLM server is given beside what miles sets (see
    ``miles.rollout.vllm_rollout``; the spec's ``engine_args`` are passed through after these)."""

    # The interpreter of an environment with vLLM; default $MILES_VLLM_PYTHON, else the
    # project's .venv-vllm (``make vllm``).
    python: Path | None = None
    max_model_len: Annotated[StrictInt, Field(ge=16)] | None = None
    # None: the checkpoint's own dtype (vLLM would otherwise run float32 weights in bfloat16).
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    # The KV cache of a CPU server, in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_gib: Annotated[StrictInt, Field(ge=1, le=1024)] = 1
    enable_prefix_caching: bool = True


class RolloutSpec(_Frozen):
    """One model served by ``num_servers`` engines of one server type."""

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] = "rollout"
    checkpoint: Path
    model_name: str | None = None
    num_servers: Annotated[int, Field(ge=1, le=64)] = 1
    # One device per server ("cpu", "cuda:0", ...); default: one GPU each when there are GPUs.
    devices: tuple[str, ...] | None = None
    health: HealthSettings = HealthSettings()
    startup_timeout_s: Annotated[float, Field(gt=0)] = 180.0
    update_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    max_running_requests: Annotated[int, Field(ge=1)] = 32
    # Torch threads per engine; default splits this machine's cores between the engines.
    num_threads: Annotated[int, Field(ge=1)] | None = None
    log_dir: Path | None = None
    # Where engines may write out the weights they hold, to restart a peer on them.
    snapshot_dir: Path | None = None
    # The secret engines require for every call that changes their weights or pauses them, so
    # that nothing but their controller (and the windows it opens) can (docs/SECURITY.md).
    engine_secret: SecretStr | None = None
    # Engines also require the secret for inference (the controller's API key is set, so
    # nothing may reach the model around it).
    guard_inference: bool = False
    # Directories engines may load checkpoints from (empty: anywhere); the snapshot directory is
    # added, since restarts load copies from there.
    allowed_checkpoint_roots: tuple[Path, ...] = ()
    engine_args: tuple[str, ...] = ()
    # Where the engines run (miles.rollout.runtime), and what each one asks of a Ray cluster:
    # fractions share a device (a trainer and an engine colocated on one GPU).
    runtime: RuntimeKind = RuntimeKind.LOCAL
    num_gpus_per_engine: Annotated[float, Field(ge=0, le=64)] = 0.0
    num_cpus_per_engine: Annotated[float, Field(gt=0, le=1024)] = DEFAULT_CPUS_PER_ENGINE
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    checkpoint_transfer: CheckpointTransfer = CheckpointTransfer.AUTO
    # The Ray cluster to join ("auto", or HOST:PORT); None: the one this process is connected
    # to, else a new local one.
    ray_address: str | None = None
    ray_namespace: Annotated[str, Field(min_length=1, max_length=128)] = "miles"
    # Attach mode: the base URLs of servers someone else runs, one per server (the controller
    # never starts or stops them; a restart waits for the server to answer and verifies it again).
    urls: EngineUrls = ()
    # What an SGLang server is launched with (SGLangRollout; see miles.rollout.sglang_rollout).
    sglang: SGLangServerArgs = SGLangServerArgs()
    # What a vLLM server is launched with (VLLMRollout; see miles.rollout.vllm_rollout).
    vllm: VLLMServerArgs = VLLMServerArgs()

    @model_validator(mode="after")
    def _check(self) -> RolloutSpec:
        if self.devices is not None and len(self.devices) != self.num_servers:
            raise ValueError(
                f"devices lists {len(self.devices)} entries for {self.num_servers} servers; give one per server"
            )
        if self.urls and len(self.urls) != self.num_servers:
            raise ValueError(
                f"urls lists {len(self.urls)} servers but num_servers is {self.num_servers}; give one URL per server"
            )
        if self.urls and self.runtime is not RuntimeKind.LOCAL:
            raise ValueError("attached servers (urls) run wherever their owner started them; leave runtime unset")
        return self

    def resolved_devices(self) -> list[str]:
        if self.devices is not None:
            return list(self.devices)
        import torch  # only here: a spec must be cheap to build and validate

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i % gpus}" if gpus else "cpu" for i in range(self.num_servers)]

    def threads_per_engine(self) -> int:
        return self.num_threads or max(1, (os.cpu_count() or 1) // self.num_servers)

"""The fleet: the servers of every served model, built from the specs the controller was given.

Specs that name one model become one ``MixedRollout`` (docs/ARCHITECTURE.md, "One model, several
server types").
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from miles.config import DEFAULT_CPUS_PER_ENGINE, ControllerSettings, PlacementStrategy, RuntimeKind
from miles.errors import CheckpointError, InvalidRequestError, NotFoundError
from miles.rollout.mixed import MixedRollout, ModelRollout
from miles.rollout.rollout import ExclusiveSection, Rollout, RolloutObserver
from miles.rollout.spec import EngineUrls, HealthSettings, RolloutSpec, SGLangServerArgs, VLLMServerArgs
from miles.rollout.state import ServerSnapshot
from miles.weights.checkpoint import read_manifest

logger = logging.getLogger("miles.controller")

DEFAULT_SERVER_CLS = "miles.rollout.sft_rollout.SFTRollout"
# The server types by their short names (``--server-cls VLLMRollout``).
SERVER_CLASSES = {
    "SFTRollout": DEFAULT_SERVER_CLS,
    "SGLangRollout": "miles.rollout.sglang_rollout.SGLangRollout",
    "VLLMRollout": "miles.rollout.vllm_rollout.VLLMRollout",
}

# What a rollout is given as it stands in its spec, and in the controller's settings.
_PASSED_FROM_SPEC = {"devices", "max_running_requests", "num_threads", "engine_args", "urls"}
_PASSED_FROM_SETTINGS = set(
    "startup_timeout_s update_timeout_s request_timeout_s allowed_checkpoint_roots checkpoint_transfer ray_address "
    "ray_namespace".split()
)


class ModelServerSpec(BaseModel):
    """Servers of one model: which server type runs them, on which checkpoint, how many.

    ``urls`` attaches servers someone else runs, one server per URL; ``sglang`` and ``vllm`` are
    what launched SGLang and vLLM servers are given (``engine_args``: further flags)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True, populate_by_name=True)

    server_cls: Annotated[str | type, Field(alias="cls")] = DEFAULT_SERVER_CLS
    checkpoint: Path
    model_name: str | None = None
    num_servers: Annotated[int, Field(ge=1, le=64)] | None = None
    urls: EngineUrls = ()
    sglang: SGLangServerArgs | None = None
    vllm: VLLMServerArgs | None = None
    devices: tuple[str, ...] | None = None
    max_running_requests: Annotated[int, Field(ge=1)] = 32
    num_threads: Annotated[int, Field(ge=1)] | None = None
    engine_args: tuple[str, ...] = ()
    # What each engine asks of a Ray cluster; None: the controller's setting.
    num_gpus_per_engine: Annotated[float, Field(ge=0, le=64)] | None = None
    num_cpus_per_engine: Annotated[float, Field(gt=0, le=1024)] | None = None
    placement_strategy: PlacementStrategy | None = None


def resolve_server_cls(server_cls: str | type) -> type[Rollout]:
    """Import ``server_cls`` when given as a dotted path and check it is a Rollout."""
    resolved = server_cls
    if isinstance(server_cls, str):
        module_name, _, attr = SERVER_CLASSES.get(server_cls, server_cls).rpartition(".")
        try:
            resolved = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise InvalidRequestError(f"cannot import rollout server class {server_cls!r}: {exc}") from exc
    if not (isinstance(resolved, type) and issubclass(resolved, Rollout)):
        raise InvalidRequestError(f"{server_cls!r} is not a Rollout subclass")
    return resolved


def normalize_specs(
    rollout_server_cls: str | type | Mapping[str, Any], model_checkpoint: str | Path | None, num_servers: int
) -> dict[str, ModelServerSpec]:
    """Turn the controller's constructor arguments into named specs (name -> spec)."""
    if isinstance(rollout_server_cls, Mapping):
        if model_checkpoint is not None:
            raise InvalidRequestError("give checkpoints inside the mapping of server specs, not as model_checkpoint")
        specs = {
            str(name): raw if isinstance(raw, ModelServerSpec) else ModelServerSpec.model_validate(raw)
            for name, raw in rollout_server_cls.items()
        }
        if not specs:
            raise InvalidRequestError("the mapping of server specs is empty")
        return specs
    if model_checkpoint is None:
        raise InvalidRequestError("model_checkpoint is required: the checkpoint directory the servers start on")
    return {
        "default": ModelServerSpec(
            server_cls=rollout_server_cls, checkpoint=Path(model_checkpoint), num_servers=num_servers
        )
    }


def models_of(specs: Mapping[str, ModelServerSpec]) -> dict[str, dict[str, ModelServerSpec]]:
    """The specs of each served model (model name -> spec name -> spec), in the order given.
    Several specs may serve one model only on one checkpoint; raises InvalidRequestError else."""
    models: dict[str, dict[str, ModelServerSpec]] = {}
    for name, spec in specs.items():
        model_name = spec.model_name or _model_name(spec.checkpoint, fallback=name)
        group = models.setdefault(model_name, {})
        for other_name, other in group.items():
            if other.checkpoint.resolve() != spec.checkpoint.resolve():
                raise InvalidRequestError(
                    f"server specs {other_name!r} and {name!r} both serve model {model_name!r} but start on "
                    f"different checkpoints ({other.checkpoint}, {spec.checkpoint}); the servers of one model "
                    "hold one set of weights: start every spec of the model on one checkpoint, or give each "
                    "spec its own model_name"
                )
        group[name] = spec
    return models


class Fleet:
    """Every model's servers: one Rollout per spec, one ModelRollout per model."""

    def __init__(
        self,
        specs: Mapping[str, ModelServerSpec],
        *,
        settings: ControllerSettings,
        exclusive: ExclusiveSection,
        observer: RolloutObserver,
        engine_secret: str | None = None,
    ) -> None:
        self._servers: dict[str, ModelRollout] = {}
        # Every spec's rollout, in the order given: what is started and stopped.
        self._rollouts: list[Rollout] = []
        self._attached_urls: set[str] = set()
        self._engine_secret = engine_secret
        self._settings = settings
        self._exclusive = exclusive
        self._observer = observer
        # The controller's working files (logs, weight copies) live here; a directory we made
        # ourselves is removed by stop(), so no controller leaves files behind.
        self.state_dir = settings.state_dir or Path(tempfile.mkdtemp(prefix="miles-controller-"))
        self._owned_state_dir = None if settings.state_dir else self.state_dir
        try:
            for model_name, named in models_of(specs).items():
                self._add_model(model_name, named)
        except BaseException:
            self._remove_state_dir()
            raise

    def _add_model(self, model_name: str, named: Mapping[str, ModelServerSpec]) -> None:
        # A model's servers are named after it; when several specs serve it, after each spec.
        mixed = len(named) > 1
        folder = _server_prefix(model_name)
        rollouts = []
        for name, spec in named.items():
            prefix = _server_prefix(name) if mixed else folder
            rollout = self._rollout(name, spec, model_name=model_name, prefix=prefix, folder=folder)
            rollouts.append(rollout)
            self._attached_urls |= set(spec.urls)
        self._check_ids(rollouts, named)
        self._servers[model_name] = MixedRollout(rollouts, observer=self._observer) if mixed else rollouts[0]
        self._rollouts += rollouts

    def _check_ids(self, rollouts: list[Rollout], named: Mapping[str, ModelServerSpec]) -> None:
        """Server ids are unique in the fleet: the router, events and /health name servers by them."""
        taken = {server_id for rollout in self._rollouts for server_id in rollout.server_ids}
        for rollout, name in zip(rollouts, named, strict=True):
            for server_id in rollout.server_ids:
                if server_id in taken:
                    raise InvalidRequestError(
                        f"server spec {name!r} would name a server {server_id!r}, as another spec does; "
                        "rename the spec (a model served by several specs names its servers after them) or the model"
                    )
                taken.add(server_id)

    def _rollout(self, name: str, spec: ModelServerSpec, *, model_name: str, prefix: str, folder: str) -> Rollout:
        """The Rollout of one spec; its weight copies go in the model's ``folder``, read by all."""
        settings = self._settings
        server_cls = resolve_server_cls(spec.server_cls)
        if spec.urls and not server_cls.can_attach:
            raise InvalidRequestError(
                f"server spec {name!r}: {server_cls.__name__} launches its own servers and cannot attach to urls; "
                "use miles.rollout.sglang_rollout.SGLangRollout for servers someone else runs"
            )
        if spec.sglang is not None and not server_cls.takes_sglang_args:
            raise InvalidRequestError(
                f"server spec {name!r}: 'sglang' launch arguments are for SGLangRollout, not {server_cls.__name__}"
            )
        if spec.vllm is not None and not server_cls.takes_vllm_args:
            raise InvalidRequestError(
                f"server spec {name!r}: 'vllm' launch arguments are for VLLMRollout, not {server_cls.__name__}"
            )
        if taken := sorted(set(spec.urls) & self._attached_urls):
            # Two rollouts driving one server would each load their own weights into it.
            raise InvalidRequestError(
                f"server spec {name!r} attaches {', '.join(taken)}, which another spec attaches too; "
                "give each server to one spec"
            )
        if spec.urls and spec.num_servers not in (None, len(spec.urls)):
            raise InvalidRequestError(
                f"server spec {name!r} lists {len(spec.urls)} urls but num_servers is {spec.num_servers}; "
                "attach mode has one server per URL (leave num_servers out)"
            )
        rollout_spec = RolloutSpec(
            **spec.model_dump(include=_PASSED_FROM_SPEC),
            **settings.model_dump(include=_PASSED_FROM_SETTINGS),
            name=prefix,
            checkpoint=spec.checkpoint.resolve(),
            model_name=model_name,
            num_servers=spec.num_servers or len(spec.urls) or 1,
            health=health_from(settings),
            log_dir=settings.log_dir or self.state_dir / "logs",
            snapshot_dir=self.state_dir / "snapshots" / folder,
            engine_secret=None if self._engine_secret is None else SecretStr(self._engine_secret),
            guard_inference=settings.api_key is not None,
            # Attached servers run wherever their owner started them.
            runtime=RuntimeKind.LOCAL if spec.urls else settings.runtime,
            num_gpus_per_engine=_given(spec.num_gpus_per_engine, settings.num_gpus_per_engine),
            num_cpus_per_engine=_given(
                spec.num_cpus_per_engine, _given(settings.num_cpus_per_engine, DEFAULT_CPUS_PER_ENGINE)
            ),
            placement_strategy=spec.placement_strategy or settings.placement_strategy,
            sglang=spec.sglang or SGLangServerArgs(),
            vllm=spec.vllm or VLLMServerArgs(),
        )
        return server_cls(rollout_spec, exclusive=self._exclusive, observer=self._observer)

    @property
    def model_names(self) -> list[str]:
        return list(self._servers)

    def rollout(self, model_name: str | None) -> ModelRollout:
        """The servers of ``model_name`` (optional when there is only one model)."""
        if model_name is None:
            if len(self._servers) == 1:
                return next(iter(self._servers.values()))
            raise InvalidRequestError(f"several models are served ({', '.join(self._servers)}); name one")
        if model_name not in self._servers:
            raise NotFoundError(f"no model {model_name!r} is served; served models: {', '.join(self._servers)}")
        return self._servers[model_name]

    def snapshots(self, model_name: str) -> list[ServerSnapshot]:
        server = self._servers.get(model_name)
        return server.snapshot() if server else []

    def all(self) -> list[ModelRollout]:
        return list(self._servers.values())

    async def start(self) -> None:
        """Start every spec's Rollout (one at a time with gated launch); stop all if one fails."""
        try:
            if self._settings.gated_launch:
                for rollout in self._rollouts:
                    await rollout.start()
            else:
                await asyncio.gather(*(rollout.start() for rollout in self._rollouts))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(rollout.stop() for rollout in self._rollouts), return_exceptions=True)
        # Logs and exported weights: possibly gigabytes to unlink, off the loop.
        await asyncio.to_thread(self._remove_state_dir)

    def _remove_state_dir(self) -> None:
        if self._owned_state_dir is None:
            return
        shutil.rmtree(self._owned_state_dir, ignore_errors=True)
        if self._owned_state_dir.exists():
            # Every engine is stopped by now: something else writes there (rmtree skips a
            # directory that fills up behind it). Said, rather than left silently.
            logger.warning("could not remove the controller's state directory %s", self._owned_state_dir)

    def set_health(self, health: HealthSettings) -> None:
        for rollout in self._rollouts:
            rollout.set_health(health)


def health_from(settings: ControllerSettings) -> HealthSettings:
    return HealthSettings(
        interval_s=settings.health_interval_s,
        timeout_s=settings.health_timeout_s,
        failure_threshold=settings.health_failure_threshold,
    )


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def _model_name(checkpoint: Path, *, fallback: str) -> str:
    try:
        return read_manifest(checkpoint).model_name
    except CheckpointError:
        return fallback if fallback != "default" else checkpoint.name


def _server_prefix(name: str) -> str:
    """``name`` (a model's, or a spec's) as the start of server ids."""
    prefix = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")
    if not prefix:
        raise InvalidRequestError(
            f"{name!r} has no character a server id can use (letters, digits, '_', '.', '-'); rename it"
        )
    return prefix

"""The controller as a named Ray actor: training anywhere in the cluster reaches it by name.

``serve_controller`` starts the actor (the same ``AsyncInferenceController``, engines on the Ray
runtime by default, the HTTP API on its node); a trainer calls the controller's methods on it::

    controller = get_controller()
    ray.get(controller.update_rollout_weights.remote("/ckpt/step-100"))
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayTaskError

from miles.config import ControllerSettings, RuntimeKind
from miles.controller.core import AsyncInferenceController
from miles.controller.fleet import ModelServerSpec, normalize_specs
from miles.controller.health import FleetHealth
from miles.controller.results import UpdateResult, UpdateWindow
from miles.errors import MilesError
from miles.http.runner import HttpServer
from miles.ray.cluster import NAMESPACE, connect
from miles.ray.placement import engine_cpu_share
from miles.utils.audit_utils.event_logger.models import EVENT_ADAPTER

CONTROLLER_NAME = "miles_inference_controller"
logger = logging.getLogger("miles.ray")


@ray.remote
class InferenceControllerActor:
    """One controller in an actor (async: every call runs on the actor's event loop)."""

    def __init__(self, build: Callable[[], AsyncInferenceController], *, serve_http: bool) -> None:
        # Built in start(), on the actor's loop: the lock and the router bind to the loop they run on.
        self._build = build
        self._serve_http = serve_http
        self._controller: AsyncInferenceController | None = None
        self._http: HttpServer | None = None

    async def start(self) -> str | None:
        """Launch the servers (and the HTTP API); returns the API's URL."""
        self._controller = self._build()
        try:
            await self._controller.start()
            if self._serve_http:
                self._http = HttpServer(self._controller)
                await self._http.start()
        except BaseException:
            await self.close()
            raise
        return self.url()

    def url(self) -> str | None:
        return self._http.url if self._http is not None else None

    @property
    def controller(self) -> AsyncInferenceController:
        assert self._controller is not None, "call start() first"
        return self._controller

    async def update_rollout_weights(self, new_checkpoint: str, **kwargs: Any) -> UpdateResult:
        return await self.controller.update_rollout_weights(new_checkpoint, **kwargs)

    async def start_update_weights(self, model_name: str | None = None, **kwargs: Any) -> UpdateWindow:
        return await self.controller.start_update_weights(model_name, **kwargs)

    async def end_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateResult:
        return await self.controller.end_update_weights(window, **kwargs)

    async def renew_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateWindow:
        return await self.controller.renew_update_weights(window, **kwargs)

    async def abort_update_weights(self, window: UpdateWindow | int, **kwargs: Any) -> UpdateResult:
        return await self.controller.abort_update_weights(window, **kwargs)

    async def health(self) -> FleetHealth:
        return self.controller.health()

    async def config(self) -> dict[str, Any]:
        return self.controller.settings.runtime_view()

    async def reconfigure(self, patch: dict[str, Any]) -> dict[str, Any]:
        return (await self.controller.reconfigure(patch)).model_dump(mode="json")

    async def log_event(self, event: Any) -> str:
        """Record an event (an ``InferenceEngineWeightChecksumEvent``, or its JSON form)."""
        parsed = EVENT_ADAPTER.validate_python(event if isinstance(event, dict) else event.model_dump())
        return self.controller.event_logger.log(type(parsed), parsed, print_log=False).event_id

    async def close(self) -> None:
        if self._http is not None:
            await self._http.stop()
            self._http = None
        if self._controller is not None:
            await self._controller.close()


def serve_controller(
    rollout_server_cls: str | Mapping[str, Any] = "miles.rollout.sft_rollout.SFTRollout",
    model_checkpoint: str | Path | None = None,
    *,
    num_servers: int = 1,
    name: str = CONTROLLER_NAME,
    namespace: str = NAMESPACE,
    serve_http: bool = True,
    detached: bool = False,
    num_cpus: float = 0.1,
    **settings: Any,
) -> Any:
    """Start the named controller actor and wait until it serves; returns its handle. Settings are validated
    here; ``detached``: it outlives this driver. A refusal is raised as its MilesError, unwrapped."""
    settings.setdefault("runtime", RuntimeKind.RAY)
    validated = ControllerSettings(**settings)  # raises ValidationError naming the bad setting
    started = connect(settings.get("ray_address"), namespace=namespace)
    if started and validated.runtime is RuntimeKind.RAY and validated.num_cpus_per_engine is None:
        specs = normalize_specs(rollout_server_cls, model_checkpoint, num_servers).values()
        settings["num_cpus_per_engine"] = _cpu_share(specs, reserved=num_cpus)
    build = functools.partial(
        AsyncInferenceController, rollout_server_cls, model_checkpoint, num_servers=num_servers, **settings
    )
    actor = InferenceControllerActor.options(  # type: ignore[attr-defined]
        name=name,
        namespace=namespace,
        num_cpus=num_cpus,
        lifetime="detached" if detached else None,
        # The controller must not be restarted by Ray behind training's back: a new one would
        # start on the first checkpoint and forget every verified update.
        max_restarts=0,
    ).remote(build, serve_http=serve_http)
    try:
        ray.get(actor.start.remote())
    except BaseException as exc:
        ray.kill(actor)
        if isinstance(exc, RayTaskError) and isinstance(exc.cause, MilesError):
            raise exc.cause from None  # its message says what to change; the remote traceback does not
        raise
    return actor


def _cpu_share(fleet: Iterable[ModelServerSpec], *, reserved: float) -> float:
    """CPUs per engine that let every engine of the fleet fit on the cluster just started."""
    # Attached servers run elsewhere and ask the cluster for nothing.
    specs = [s for s in fleet if not s.urls]
    engines = sum(spec.num_servers or 1 for spec in specs if spec.num_cpus_per_engine is None)
    reserved += sum((spec.num_servers or 1) * (spec.num_cpus_per_engine or 0.0) for spec in specs)
    cpus = float(ray.cluster_resources().get("CPU", 0.0))
    share = engine_cpu_share(cpus=cpus, engines=engines, reserved=reserved)
    logger.info("%d engine(s) share this cluster's %g CPUs: %g CPUs each", engines, cpus, share)
    return share


def get_controller(name: str = CONTROLLER_NAME, *, namespace: str = NAMESPACE, address: str | None = "auto") -> Any:
    """The named controller's handle, from any driver or actor in the cluster."""
    connect(address, namespace=namespace)
    return ray.get_actor(name, namespace=namespace)


def call(actor: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call one of the controller actor's methods and wait for its answer."""
    return ray.get(getattr(actor, method).remote(*args, **kwargs))


def stop_controller(actor: Any) -> None:
    """Stop the controller actor's HTTP API and engines, then the actor itself."""
    try:
        ray.get(actor.close.remote())
    finally:
        ray.kill(actor)

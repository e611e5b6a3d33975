"""``miles serve``, ``miles update``, ``miles health``: run a controller and talk to a running one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from pydantic import ValidationError
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from miles.config import ControllerSettings, PlacementStrategy, SettingsError, UpdatePauseMode, UpdateStrategy

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_SERVER_CLS = "miles.rollout.sft_rollout.SFTRollout"
UrlOption = Annotated[str, typer.Option(help="The controller's base URL.", envvar="MILES_URL")]


SGLANG_SERVER_CLS = "miles.rollout.sglang_rollout.SGLangRollout"
# The settings ``serve``'s flags set, by flag: a bad value is named as the user gave it.
SERVE_FLAGS = {
    "host": "--host",
    "port": "--port",
    "events_dir": "--events-dir",
    "allowed_checkpoint_roots": "--allowed-checkpoint-root",
    "ray_address": "--address",
    "num_gpus_per_engine": "--gpus-per-engine",
    "num_cpus_per_engine": "--cpus-per-engine",
    "placement_strategy": "--placement-strategy",
}


def serve(
    checkpoint: Annotated[
        Path | None, typer.Option(help="Checkpoint directory the servers start on (attached ones are made to hold it).")
    ] = None,
    servers: Annotated[int, typer.Option(help="Rollout servers (engine processes).")] = 1,
    port: Annotated[int | None, typer.Option(help="HTTP port (default MILES_PORT or 8000).")] = None,
    host: Annotated[str | None, typer.Option(help="HTTP host (default MILES_HOST or 127.0.0.1).")] = None,
    server_cls: Annotated[
        str | None,
        typer.Option(
            help="Rollout class: SFTRollout (default), SGLangRollout (default with --attach), VLLMRollout, "
            "or a dotted path."
        ),
    ] = None,
    attach: Annotated[
        list[str] | None,
        typer.Option(help="The URL of an SGLang server someone else runs, to serve CHECKPOINT (repeatable)."),
    ] = None,
    fleet: Annotated[
        Path | None,
        typer.Option(
            help='A JSON file mapping names to server specs ({"cls", "checkpoint", "num_servers", "urls", '
            '"sglang", ...}): several models and server types under one controller.'
        ),
    ] = None,
    events_dir: Annotated[Path | None, typer.Option(help="Write the event log here.")] = None,
    allowed_checkpoint_root: Annotated[
        list[Path] | None,
        typer.Option(help="Only load checkpoints under this directory (repeatable); binds the engines too."),
    ] = None,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Run on a Ray cluster: engines as actors on placement groups, the controller as the named "
            "actor miles_inference_controller (namespace miles).",
        ),
    ] = False,
    address: Annotated[
        str | None, typer.Option(help="With --ray: the cluster to join, auto or HOST:PORT (default: a new local one).")
    ] = None,
    gpus_per_engine: Annotated[
        float | None, typer.Option(help="With --ray: GPUs per engine (a fraction shares one).")
    ] = None,
    cpus_per_engine: Annotated[
        float | None,
        typer.Option(
            help="With --ray: CPUs per engine (fractions allowed; default 1, or an equal share of the CPUs of "
            "the cluster miles starts itself when there are fewer)."
        ),
    ] = None,
    placement_strategy: Annotated[
        PlacementStrategy | None, typer.Option(help="With --ray: PACK or SPREAD the engines over nodes.")
    ] = None,
) -> None:
    """Start a controller with SERVERS rollout servers on CHECKPOINT (or attached to the --attach
    URLs, or the --fleet of several models) and serve until interrupted."""
    console = Console(stderr=True)
    given: dict[str, Any] = {
        "host": host,
        "port": port,
        "events_dir": events_dir,
        "allowed_checkpoint_roots": tuple(allowed_checkpoint_root) if allowed_checkpoint_root else None,
    }
    ray_options: dict[str, Any] = {
        "ray_address": address,
        "num_gpus_per_engine": gpus_per_engine,
        "num_cpus_per_engine": cpus_per_engine,
        "placement_strategy": placement_strategy,
    }
    if not ray and any(v is not None for v in ray_options.values()):
        raise typer.BadParameter("--address and the placement options need --ray")
    overrides = {k: v for k, v in (given | ray_options).items() if v is not None}
    if ray:
        overrides["runtime"] = "ray"
    # Every setting checked before anything starts (flags and MILES_* variables alike), and a
    # bad one named as it was given.
    try:
        settings = ControllerSettings(**overrides)
    except ValidationError as exc:
        raise SettingsError.from_validation(
            exc, flags={k: SERVE_FLAGS[k] for k in overrides if k in SERVE_FLAGS}
        ) from None
    fleet_spec = _fleet_spec(checkpoint, servers=servers, server_cls=server_cls, attach=attach or [], fleet=fleet)
    console.print(f"starting {', '.join(fleet_spec)} ...")
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    if ray:
        _serve_on_ray(fleet_spec, overrides, console=console, stopped=stopped)
        return
    from miles.inference_controller import InferenceController

    with InferenceController(fleet_spec, settings=settings) as controller:
        report = controller.health()
        console.print(f"[green]serving[/] {', '.join(report.models)} at {controller.url} (Ctrl-C to stop)")
        stopped.wait()
        console.print("stopping ...")


def _fleet_spec(
    checkpoint: Path | None, *, servers: int, server_cls: str | None, attach: list[str], fleet: Path | None
) -> dict[str, Any]:
    """What the controller serves, from ``serve``'s options: name -> server spec."""
    if fleet is not None:
        if checkpoint is not None or attach or server_cls is not None:
            raise typer.BadParameter("--fleet describes every server; give no --checkpoint, --attach or --server-cls")
        try:
            mapping = json.loads(fleet.read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise typer.BadParameter(f"--fleet {fleet}: {exc}") from None
        if not isinstance(mapping, dict) or not mapping or not all(isinstance(v, dict) for v in mapping.values()):
            raise typer.BadParameter(f"--fleet {fleet} must hold a JSON object of names to server specs")
        return mapping
    if checkpoint is None:
        raise typer.BadParameter("give --checkpoint (or --fleet)")
    spec: dict[str, Any] = {"cls": server_cls or (SGLANG_SERVER_CLS if attach else DEFAULT_SERVER_CLS)}
    spec |= {"checkpoint": str(checkpoint.resolve())}
    spec |= {"urls": attach} if attach else {"num_servers": servers}
    return {"default": spec}


def _serve_on_ray(
    fleet_spec: dict[str, Any], overrides: dict[str, Any], *, console: Console, stopped: threading.Event
) -> None:
    """The controller as the cluster's named actor, until interrupted; then stopped with its engines."""
    from miles.ray.controller import CONTROLLER_NAME, call, serve_controller, stop_controller

    controller = serve_controller(fleet_spec, **overrides)
    try:
        report = call(controller, "health")
        url = call(controller, "url")
        nodes = sorted({s.node_address for s in report.servers if s.node_address})
        console.print(
            f"[green]serving[/] {', '.join(report.models)} at {url} on nodes {', '.join(nodes)}; "
            f"training reaches the controller as ray.get_actor({CONTROLLER_NAME!r}, namespace='miles') "
            "(Ctrl-C to stop)"
        )
        stopped.wait()
        console.print("stopping ...")
    finally:
        stop_controller(controller)


def update(
    checkpoint: Annotated[Path, typer.Option(help="Checkpoint directory to load.")],
    strategy: Annotated[UpdateStrategy | None, typer.Option(help="barrier or rolling.")] = None,
    pause_mode: Annotated[UpdatePauseMode | None, typer.Option(help="drain, abort or retract.")] = None,
    model: Annotated[str | None, typer.Option(help="Model to update (when several are served).")] = None,
    weight_version: Annotated[str | None, typer.Option(help="Version to serve it as.")] = None,
    url: UrlOption = DEFAULT_URL,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Ask a running controller to load CHECKPOINT into every server; exit 1 unless committed."""
    payload = {
        "checkpoint": str(checkpoint.resolve()),
        "strategy": strategy.value if strategy else None,
        "pause_mode": pause_mode.value if pause_mode else None,
        "model_name": model,
        "weight_version": weight_version,
    }
    body = _call(
        "POST", f"{url}/update_weights", json={k: v for k, v in payload.items() if v is not None}, timeout=None
    )
    if as_json:
        typer.echo(json.dumps(body, indent=2))
    else:
        console = Console()
        colour = "green" if body["status"] == "committed" else "red"
        console.print(
            f"[{colour}]{body['status']}[/] {body['model_name']} -> {body['weight_version']}: {body['message']}"
        )
        table = Table("server", "state", "version", "checksum", "matched", "error")
        for server in body["servers"]:
            table.add_row(
                server["server_id"],
                server["state"],
                str(server["weight_version"]),
                str(server["checksum"])[:12],
                str(server["matched"]),
                server["error"] or "",
            )
        console.print(table)
        console.print(
            f"took {body['duration_s']:.3f}s " + " ".join(f"{k}={v:.3f}s" for k, v in body["timings"].items())
        )
    raise typer.Exit(0 if body["status"] == "committed" else 1)


def health(
    url: UrlOption = DEFAULT_URL,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Redraw in place until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(min=0.1, max=3600, help="Seconds between redraws (--watch).")] = 2.0,
    count: Annotated[
        int | None, typer.Option(min=1, help="With --watch: stop after this many redraws.", show_default=False)
    ] = None,
) -> None:
    """Show a running controller's health; exit 1 when the fleet cannot serve."""
    if watch:
        if as_json:
            raise typer.BadParameter("--watch draws a table; leave out --json", param_hint="--watch")
        _watch_health(url, interval=interval, count=count)
        return
    body = _call("GET", f"{url}/health", timeout=10)
    if as_json:
        typer.echo(json.dumps(body, indent=2))
    else:
        Console().print(health_view(body))
    raise typer.Exit(0 if body["ok"] else 1)


def _watch_health(url: str, *, interval: float, count: int | None) -> None:
    """Redraw the health view every ``interval`` seconds; an unreachable controller is shown, not fatal."""
    console = Console()
    drawn = 0
    with Live(console=console, auto_refresh=False, transient=False) as live, contextlib.suppress(KeyboardInterrupt):
        while count is None or drawn < count:
            try:
                body = _get(f"{url}/health", timeout=min(10.0, max(interval, 1.0)))
                view: RenderableType = health_view(body, url=url)
            except _Unreachable as exc:
                view = Text(f"cannot reach the controller at {url}: {exc}; retrying every {interval:g}s")
            live.update(view, refresh=True)
            drawn += 1
            if count is None or drawn < count:
                time.sleep(interval)


class _Unreachable(Exception):
    pass


def _get(url: str, *, timeout: float) -> dict[str, Any]:
    try:
        response = httpx.get(url, headers=_headers(), timeout=timeout, trust_env=False)
        body = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise _Unreachable(str(exc) or type(exc).__name__) from exc
    if not isinstance(body, dict) or "servers" not in body:
        raise _Unreachable(f"answered {response.status_code}: {response.text[:200]}")
    return body


def _headers() -> dict[str, str] | None:
    """The token the CLI presents: the admin token, else the API key (read from the environment)."""
    for name in ("MILES_ADMIN_TOKEN", "MILES_API_KEY"):
        value = os.environ.get(name, "").strip()
        if value:
            return {"authorization": f"Bearer {value}"}
    return None


def _call(method: str, url: str, *, json: dict[str, Any] | None = None, timeout: float | None) -> dict[str, Any]:
    try:
        response = httpx.request(method, url, json=json, headers=_headers(), timeout=timeout, trust_env=False)
    except httpx.HTTPError as exc:
        typer.echo(f"cannot reach the controller at {url}: {exc}; is `miles serve` running?", err=True)
        raise typer.Exit(2) from exc
    try:
        body = response.json()
    except ValueError:
        typer.echo(f"{url} answered {response.status_code}: {response.text[:300]}", err=True)
        raise typer.Exit(2) from None
    if "error" in body and isinstance(body["error"], dict):
        typer.echo(f"refused ({response.status_code}): {body['error']['message']}", err=True)
        raise typer.Exit(2)
    return body


# --- what ``miles health`` draws ----------------------------------------------------------------
# A pure function of the /health JSON, so --watch redraws it in place and tests draw it without a
# controller; it fits 80 columns. Server ids are never cut: the checksum and the version give way.

# Every other state (starting, pending_weights, updating, restarting) is on its way: yellow.
_STATE_STYLE = {"serving": "green", "quarantined": "red", "stopped": "red"}
_FLEET_STYLE = {"ok": "green", "updating": "yellow", "degraded": "yellow"}


def health_view(body: dict[str, Any], *, url: str | None = None) -> RenderableType:
    """The report ``GET /health`` answered, as a header, a table per model and the lock."""
    status = body["status"]
    header = Text.assemble(("fleet: ", ""), (status, _FLEET_STYLE.get(status, "red")), f"  up {body['uptime_s']:.0f}s")
    if url:
        header.append(f"  {url}")
    parts: list[RenderableType] = [header]
    for name, model in body["models"].items():
        parts.append(_model_table(name, model, [s for s in body["servers"] if s["model_name"] == name]))
    lock = body["lock"]
    if lock["held"]:
        held = f" for {lock['held_for_s']:.1f}s" if lock.get("held_for_s") is not None else ""
        parts.append(Text(f"lock: held by {lock['holder']} (token {lock['token']}){held}, {lock['waiters']} waiting"))
    else:
        parts.append(Text(f"lock: free, {lock['waiters']} waiting"))
    last = body.get("last_update")
    if last:
        blocked = last.get("serving_blocked_s")
        extra = f", serving blocked {blocked:.3f}s" if blocked else ""
        parts.append(
            Text(f"last update: {last['status']} {last['weight_version']} in {last['duration_s']:.3f}s{extra}")
        )
    return Group(*parts)


def _model_table(name: str, model: dict[str, Any], servers: list[dict[str, Any]]) -> Table:
    version = model["weight_version"] or ", ".join(f"{v} x{n}" for v, n in model["versions"].items()) or "-"
    title = f"{name}: version {version}, {model['serving']}/{model['total']} serving"
    if not model["accepting_requests"]:
        title += ", requests held"
    # One space between columns and none at the edges: a fleet of long ids still fits 80 columns.
    table = Table(title=title, title_justify="left", box=None, padding=(0, 1, 0, 0), header_style="bold")
    # Ids and states are what a person looks for: they keep their whole width, the others give way.
    # Attached: someone else runs it; a restart waits for it and verifies it again.
    ids = [s["server_id"] + (" (attached)" if s.get("attached") else "") for s in servers]
    table.add_column("server", no_wrap=True, min_width=max((len(i) for i in ids), default=6))
    table.add_column("state", no_wrap=True, min_width=max((len(s["state"]) for s in servers), default=5))
    table.add_column("version", overflow="ellipsis", no_wrap=True, min_width=7, max_width=14)
    table.add_column("checksum", no_wrap=True, overflow="ellipsis", max_width=8)
    table.add_column("reqs", justify="right", no_wrap=True)  # routed requests in flight
    table.add_column("probe", no_wrap=True)
    table.add_column("rst", justify="right", no_wrap=True)  # restarts
    for s, shown_id in zip(servers, ids, strict=True):
        probe = "-" if s["last_probe_ok"] is None else ("ok" if s["last_probe_ok"] else "failing")
        table.add_row(
            shown_id,
            Text(s["state"], style=_STATE_STYLE.get(s["state"], "yellow")),
            str(s["weight_version"] or "-"),
            (s["checksum"] or "-")[:8],
            str(s["in_flight"]),
            probe,
            str(s["restarts"]),
        )
    return table

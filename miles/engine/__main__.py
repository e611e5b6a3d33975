"""``python -m miles.engine``: start one engine server process."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
import uvicorn

from miles.engine.settings import (
    API_KEY_ENV,
    DEFAULT_HTTP_HEAD_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_QUEUED_REQUESTS,
    LAUNCHER_PID_ENV,
    SECRET_ENV,
    EngineSettings,
    Forward,
    StagingMode,
)
from miles.utils.connections import ConnectionLimits, guarded_http
from miles.utils.http import DEFAULT_MAX_REQUEST_MIB
from miles.utils.lifetime import exit_when_gone
from miles.utils.progress_bars import disable_library_progress_bars

GIL_SWITCH_INTERVAL_S = 0.0005

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _exit_with_parent() -> None:
    """End this process when its launcher dies: its parent, or for an engine the forkserver forked,
    the process named in ``MILES_ENGINE_LAUNCHER_PID`` (so it outlives a forkserver that dies)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    try:
        watched = int(launcher) if launcher else os.getppid()
    except ValueError:
        os._exit(0)  # the launcher is named wrongly: nothing to answer to
    exit_when_gone(watched)


def _gpu_ids(raw: str) -> tuple[int, ...]:
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        raise typer.BadParameter(f"--gpu-ids takes comma-separated non-negative integers, got {raw!r}")
    return tuple(int(p) for p in parts)


@cli.command()
def main(
    model_path: Annotated[Path, typer.Option(help="Hugging Face checkpoint directory to serve.")],
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 30000,
    device: Annotated[
        str, typer.Option(help="cpu, cuda:N, or auto (the first of --gpu-ids when CUDA is available, else cpu)")
    ] = "cpu",
    gpu_ids: Annotated[
        str, typer.Option(help="comma-separated GPU ids this engine was given (its runtime's), reported in server info")
    ] = "",
    node_id: Annotated[str | None, typer.Option(help="the id of the node it runs on, reported in server info")] = None,
    served_model_name: Annotated[str | None, typer.Option()] = None,
    max_running_requests: Annotated[int, typer.Option()] = 32,
    max_queued_requests: Annotated[
        int, typer.Option(help="sequences (prompts x n) that may wait for a row; more get 429, as in SGLang")
    ] = DEFAULT_MAX_QUEUED_REQUESTS,
    num_threads: Annotated[int | None, typer.Option(help="torch intra-op threads")] = None,
    context_length: Annotated[int | None, typer.Option()] = None,
    forward: Annotated[
        Forward, typer.Option(help="auto: the fused Llama-family forward where it applies, else transformers")
    ] = Forward.AUTO,
    weight_staging: Annotated[
        StagingMode,
        typer.Option(
            help="stage updates beside the live weights and swap them in (on), copy in place (off), "
            "or stage when the second copy fits in --weight-staging-budget (auto)"
        ),
    ] = StagingMode.AUTO,
    weight_staging_budget: Annotated[
        float, typer.Option(help="the fraction of available memory the staging copy may take under auto")
    ] = 0.5,
    max_request_mib: Annotated[
        int, typer.Option(help="the largest request body the engine reads, in MiB (413 above it)")
    ] = DEFAULT_MAX_REQUEST_MIB,
    http_head_timeout_s: Annotated[
        float, typer.Option(help="seconds a request's head may take to arrive (408 and closed after)")
    ] = DEFAULT_HTTP_HEAD_TIMEOUT_S,
    max_connections: Annotated[
        int,
        typer.Option(
            help="connections held at once: one more closes the oldest stalled head, or gets 503 when every "
            "one runs a request"
        ),
    ] = DEFAULT_MAX_CONNECTIONS,
    snapshot_dir: Annotated[
        Path | None, typer.Option(help="enable POST /export_weights, writing checkpoints under this directory")
    ] = None,
    log_level: Annotated[str, typer.Option()] = "warning",
    exit_with_parent: Annotated[bool, typer.Option(help="exit when the launching process dies")] = False,
) -> None:
    """Serve MODEL_PATH over SGLang's native HTTP API (subset) and OpenAI-compatible endpoints."""
    # First, before any other name is bound: every flag but --exit-with-parent is the
    # EngineSettings field of its name (which forbids any other).
    flags = dict(locals())
    del flags["exit_with_parent"]
    if exit_with_parent:
        _exit_with_parent()
    # The log holds what the engine says, not a bar redrawn for every model it loads.
    disable_library_progress_bars()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        secret = EngineSettings.credential_from_env(SECRET_ENV)
        api_key = EngineSettings.credential_from_env(API_KEY_ENV)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    settings = EngineSettings.model_validate(
        {
            **flags,
            "gpu_ids": _gpu_ids(gpu_ids),
            "allowed_checkpoint_roots": EngineSettings.roots_from_env(),
            "snapshot_dir": snapshot_dir.expanduser().resolve() if snapshot_dir is not None else None,
            "secret": secret,
            "api_key": api_key,
        }
    )
    # Imported here so `--help` answers without loading torch and transformers.
    from miles.engine.engine import Engine
    from miles.engine.http_server import create_app

    # The scheduler thread runs Python between torch's kernels for as long as requests run. The
    # event loop (HTTP, weight pushes, the controller's calls) and the worker threads it hands
    # work to must get the interpreter back within half a millisecond, not Python's default 5 ms:
    # each call to an engine that is generating crosses threads several times.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    engine = Engine(settings)
    uvicorn.run(
        create_app(engine),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        # Clients (the controller among them) keep idle pooled connections for 30 s. A server
        # that closes them sooner (uvicorn's default is 5 s) races the client's next request on
        # that connection, which then fails with "server disconnected"; the server must outlast
        # the client's pool.
        timeout_keep_alive=75,
        # uvicorn bounds neither a head's time nor the connections (miles.utils.connections).
        http=guarded_http(
            ConnectionLimits(head_timeout_s=settings.http_head_timeout_s, max_connections=settings.max_connections),
            server="the engine (--max-connections)",
        ),
    )


if __name__ == "__main__":
    cli()

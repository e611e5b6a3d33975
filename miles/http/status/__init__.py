"""The controller's status page: the fleet, the lock, the last updates, requests and events.

``GET /`` serves the page's files (shipped in this package, no build step); its script polls
``GET /status``, assembled from what never waits on the lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict
from importlib.resources import files
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from miles.controller.core import AsyncInferenceController
from miles.http.metrics import ControllerMetrics
from miles.utils.audit_utils.event_analyzer.timeline import update_timelines

# Enough events for the last updates' timelines: an update logs a few events per server.
_EVENTS_READ = 2000
_UPDATES_SHOWN = 8
_EVENTS_SHOWN = 25

_ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/status.js": ("status.js", "text/javascript; charset=utf-8"),
    "/status.css": ("status.css", "text/css; charset=utf-8"),
}


def add_status_page(
    app: FastAPI,
    controller: AsyncInferenceController,
    *,
    metrics: ControllerMetrics | None,
    reader: Callable[[Request], None],
) -> None:
    """Mount the page (open: it holds no data) and ``GET /status`` (a reader's credential)."""
    # Read at the first request, off the event loop, then kept: the files ship in the package and
    # never change while it runs.
    loaded: dict[str, bytes] = {}

    async def asset(request: Request) -> Response:
        name, kind = _ASSETS[request.url.path]
        body = loaded.get(name)
        if body is None:
            body = loaded[name] = await asyncio.to_thread(files(__name__).joinpath(name).read_bytes)
        return Response(body, media_type=kind, headers={"cache-control": "no-cache"})

    for path in _ASSETS:
        app.get(path, include_in_schema=False)(asset)

    @app.get("/status", dependencies=[Depends(reader)])
    async def status() -> dict[str, Any]:
        # What the page shows: health, updates, requests (None with metrics off), events.
        events = controller.event_logger.events[-_EVENTS_READ:]
        updates = update_timelines(events)[-_UPDATES_SHOWN:]
        return {
            "health": controller.health().model_dump(mode="json"),
            "updates": [u.model_dump(mode="json") for u in reversed(updates)],
            "requests": asdict(metrics.history.window()) if metrics is not None else None,
            "events": [
                {
                    "timestamp": e.timestamp.isoformat(),
                    "type": e.type,
                    "servers": list(e.involved_servers()),
                    "summary": e.summary(),
                }
                for e in reversed(events[-_EVENTS_SHOWN:])
            ],
        }

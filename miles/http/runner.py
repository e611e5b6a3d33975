"""Runs the controller's FastAPI app with uvicorn on the controller's own event loop."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import uvicorn

from miles.controller.core import AsyncInferenceController
from miles.errors import MilesError
from miles.http.controller_app import create_app
from miles.utils.connections import ConnectionLimits, guarded_http

_GRACE_S = 10  # seconds (uvicorn takes whole seconds)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname other than localhost may resolve anywhere


class HttpServer:
    """The controller's HTTP API on ``settings.host:settings.port`` (port 0 picks a free one)."""

    def __init__(self, controller: AsyncInferenceController) -> None:
        self._controller = controller
        settings = controller.settings
        if not is_loopback(settings.host) and settings.admin_token is None:
            raise MilesError(
                f"refusing to listen on {settings.host}: off loopback anyone who can reach the port could "
                "change the weights. Set MILES_ADMIN_TOKEN (and MILES_API_KEY to guard inference too), or "
                "bind 127.0.0.1",
                host=settings.host,
            )
        # proto must be IPPROTO_TCP, not 0: asyncio enables TCP_NODELAY on accepted connections
        # only for sockets that say so, and without it every response waits ~40 ms on Nagle.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((settings.host, settings.port))
        except OSError as exc:
            self._socket.close()
            raise MilesError(
                f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}; pick another port "
                "(MILES_PORT or port=...)",
                host=settings.host,
                port=settings.port,
            ) from exc
        self.host, self.port = self._socket.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        # A bounded drain: requests still generating after this are cut at shutdown (waiting ones
        # were already ended by stop_routing), so stopping never hangs on a long generation.
        # Heads get http_head_timeout_s and connections are capped at max_connections
        # (miles.utils.connections: uvicorn bounds neither).
        limits = ConnectionLimits(head_timeout_s=settings.http_head_timeout_s, max_connections=settings.max_connections)
        config = uvicorn.Config(
            create_app(controller),
            http=guarded_http(limits, server="the controller (MILES_MAX_CONNECTIONS)"),
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=_GRACE_S,
        )
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # The socket is bound up front so the port is known (and a clash reported) before serving.
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="controller-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the startup error
                raise MilesError("the controller's HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._controller.stop_routing()
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        self._socket.close()

"""An edge fake: a vLLM server, as far as ``VLLMClient`` speaks to it, whose worker can be made busy
or lost on cue. Everything it is tested with (the client, the rollout, the supervisor, the
controller) is real, over real HTTP on loopback.

``FakeVLLM(holds=CHECKSUM)`` answers vLLM's routes (``/health``, ``/weight_info``,
``/update_weight_version``, ``/reset_prefix_cache``, ``/pause``, ``/resume``, ``/abort_requests``,
``/v1/models``, ``/v1/completions``) and, on ``/collective_rpc``, the methods of miles' worker
extension as the extension answers them (``miles_identity``, ``miles_checksum``, ``miles_load``
of a sealed checkpoint, ``miles_end_push``). Its worker is scripted:

- ``busy()`` / ``free()``: the worker answers no call until freed (a long step), while ``/health``
  answers 200, as vLLM's API server does;
- ``lose_engine()``: ``/health`` answers 500 from then on and the worker never answers (vLLM's API
  server hanging in its shutdown after its worker died).

``calls`` counts what it was asked: each ``/collective_rpc`` method by name, and ``health``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from miles.testing import app_on_loopback
from miles.weights.checkpoint import read_manifest


class FakeVLLM:
    """See the module docstring."""

    def __init__(self, *, holds: str, model: str = "tiny") -> None:
        self.holds, self.model = holds, model
        self.version = "default"
        self.calls: Counter[str] = Counter()
        self.engine_lost = False
        self._worker_free = threading.Event()
        self._worker_free.set()
        # The worker process, as the extension names it (a restarted worker names another).
        self.instance_id = f"vllm-worker:fake:{time.monotonic_ns()}"
        self.app = self._build()

    def busy(self) -> None:
        self._worker_free.clear()

    def free(self) -> None:
        self._worker_free.set()

    def lose_engine(self) -> None:
        self.engine_lost = True
        self.busy()

    async def _worker(self) -> None:
        """Wait, as a call into vLLM's worker does, until the worker is free."""
        # Freed from the test's thread, which has no event of this loop to set: polled.
        while not self._worker_free.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            self.calls["health"] += 1
            return JSONResponse({}, status_code=500 if self.engine_lost else 200)

        @app.get("/weight_info")
        async def weight_info() -> dict[str, str]:
            return {"weight_version": self.version}

        @app.post("/update_weight_version")
        async def update_weight_version(body: dict[str, Any]) -> dict[str, Any]:
            self.version = str(body["new_version"])
            return {"success": True, "new_version": self.version}

        @app.post("/reset_prefix_cache")
        @app.post("/resume")
        @app.post("/abort_requests")
        async def control() -> dict[str, str]:
            return {"status": "ok"}

        @app.post("/pause")
        async def pause() -> dict[str, str]:
            return {"status": "paused"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"data": [{"id": self.model}]}

        @app.post("/v1/completions")
        async def completions() -> dict[str, Any]:
            await self._worker()
            return {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> dict[str, Any]:
            body = await request.json()
            method, kwargs = body["method"], body.get("kwargs") or {}
            self.calls[method] += 1
            await self._worker()
            return {"results": [await self._extension(method, kwargs)]}

        return app

    async def _extension(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """What miles' worker extension answers ``method``."""
        if method == "miles_identity":
            return {"checksum": self.holds, "instance_id": self.instance_id}
        if method == "miles_checksum":
            return {"checksum": self.holds, "algorithm": "xxh3-128", "tensors": 1, "num_bytes": 1}
        if method == "miles_end_push":
            return {"ended": False, "left": None}
        if method == "miles_load":
            manifest = await asyncio.to_thread(read_manifest, Path(kwargs["path"]))
            if manifest.checksum != kwargs["expected_checksum"]:
                return {"success": False, "changed": False, "message": "not the checkpoint expected"}
            self.holds = manifest.checksum
            return {"success": True, "changed": True, "message": "loaded", "checksum": self.holds}
        raise ValueError(f"the fake has no {method}")

    @contextmanager
    def running(self) -> Iterator[str]:
        """Serve on a free loopback port, on a thread of its own, until the block ends; its URL."""
        with app_on_loopback(self.app) as port:
            try:
                yield f"http://127.0.0.1:{port}"
            finally:
                self.free()  # a call left waiting on the worker ends, so the server can stop

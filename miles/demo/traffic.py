"""Simulated user traffic: closed-loop clients sending requests through the controller.

Every request is recorded (when, how long, how it ended), so the demo can show that serving never
failed while the weights changed underneath it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

import httpx

USER_PROMPTS = (
    "Hello! ",
    "Write a short poem: ",
    "Translate to French: good morning",
    "Q: what is 2+2?\nA:",
    "Once upon a time",
    "List three colours:",
)


@dataclass(frozen=True)
class RequestRecord:
    started: float  # seconds since the run started
    latency_s: float
    status: int  # HTTP status, 0 when no answer came at all
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class TrafficStats:
    records: list[RequestRecord] = field(default_factory=list)

    @property
    def served(self) -> int:
        return sum(1 for r in self.records if r.ok)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.records if not r.ok)


class UserTraffic:
    """``clients`` closed-loop users, each pausing ``think_s`` (jittered) between requests."""

    def __init__(
        self, url: str, *, clients: int, think_s: float, t0: float, seed: int, headers: dict[str, str] | None = None
    ) -> None:
        self._clients = clients
        self._think_s = think_s
        self._t0 = t0
        self._rng = random.Random(seed)
        self.stats = TrafficStats()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._http = httpx.AsyncClient(base_url=url, timeout=300, trust_env=False, headers=headers)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._user(i), name=f"user-{i}") for i in range(self._clients)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.aclose()

    async def _user(self, index: int) -> None:
        turn = 0
        while not self._stop.is_set():
            prompt = USER_PROMPTS[(index + turn) % len(USER_PROMPTS)]
            # Alternate the native and the OpenAI-compatible endpoint, like a mixed user base.
            if turn % 2 == 0:
                await self._call(
                    "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0.7}}
                )
            else:
                await self._call("/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0.7})
            turn += 1
            delay = self._think_s * (0.5 + self._rng.random())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=delay)

    async def _call(self, endpoint: str, body: dict[str, object]) -> None:
        started = time.monotonic()
        status, error = 0, None
        try:
            response = await self._http.post(endpoint, json=body)
            status = response.status_code
            payload = response.json()
            if status != 200:
                error = str(payload)[:200]
            elif endpoint == "/generate" and payload["meta_info"]["finish_reason"]["type"] == "abort":
                error = "aborted"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        self.stats.records.append(
            RequestRecord(started=started - self._t0, latency_s=time.monotonic() - started, status=status, error=error)
        )

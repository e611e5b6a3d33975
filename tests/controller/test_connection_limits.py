"""Stalled request heads cannot hold a server's connections. One suite, run against a real
`miles serve` controller and a real engine process: a head not complete in the head timeout is
answered 408 and closed, however slowly it trickles; at the connection cap a fresh client gets in
by closing the oldest stalled head, and gets 503 at once when every connection runs a request;
pooled keep-alive connections (httpx, the controller's own to its engine) outlive the head
timeout. Loopback only; every socket and process is closed even when a test fails."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from miles.rollout.engine_process import free_port
from miles.testing import running_engine, wait_serving

HEAD_TIMEOUT_S = 3.0
CAP = 32
# How late past its deadline a connection may close on a loaded two-core machine.
SLACK_S = 3.0
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow"


@dataclass
class Target:
    """A running server under test, and a request that keeps it busy until its body arrives."""

    url: str
    busy_path: str
    port: int = field(init=False)

    def __post_init__(self) -> None:
        self.port = int(self.url.rsplit(":", 1)[1])


def _controller(checkpoint: Path, log_dir: Path) -> Iterator[Target]:
    port = free_port()
    fleet = log_dir / "fleet.json"
    # The controller's own engine gets a head timeout shorter than the controller's probe interval,
    # so its pooled connections idle past it between calls.
    spec = {"cls": "miles.rollout.sft_rollout.SFTRollout", "checkpoint": str(checkpoint), "num_servers": 1}
    spec["engine_args"] = ["--http-head-timeout-s", "0.5"]
    fleet.write_text(json.dumps({"tiny": spec}))
    env = {
        **os.environ,
        "MILES_HTTP_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
        "MILES_MAX_CONNECTIONS": str(CAP),
        "MILES_HEALTH_INTERVAL_S": "1.0",
        "MILES_LOG_DIR": str(log_dir),
    }
    with open(log_dir / "serve.log", "w") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "miles.cli", "serve", "--fleet", str(fleet), "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url, serve, timeout=180, output=(log_dir / "serve.log").read_text)
        yield Target(url, busy_path="/generate")
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


def _engine(checkpoint: Path, log_dir: Path) -> Iterator[Target]:
    flags = ("--http-head-timeout-s", str(HEAD_TIMEOUT_S), "--max-connections", str(CAP))
    with running_engine(checkpoint, log_dir=log_dir, extra_args=flags) as url:
        yield Target(url, busy_path="/generate")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module", params=["controller", "engine"])
def target(
    request: pytest.FixtureRequest, checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    start = _controller if request.param == "controller" else _engine
    yield from start(checkpoints["v1"], tmp_path_factory.mktemp(f"{request.param}-logs"))


class Clients:
    """Raw client sockets to one server, watched for what the server answers and when it closes
    them. Always used as a context manager: every socket is closed on the way out."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sockets: list[socket.socket] = []
        self.opened_at: dict[socket.socket, float] = {}
        self.closed_at: dict[socket.socket, float] = {}
        self.answers: dict[socket.socket, bytes] = {}
        self._selector = selectors.DefaultSelector()

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *_: object) -> None:
        for sock in self.sockets:
            if sock not in self.closed_at:
                self._selector.unregister(sock)
            sock.close()
        self._selector.close()

    def open(self, first_bytes: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        sock.sendall(first_bytes)
        sock.setblocking(False)
        self.sockets.append(sock)
        self.opened_at[sock] = time.monotonic()
        self.answers[sock] = b""
        self._selector.register(sock, selectors.EVENT_READ, data=sock)
        return sock

    @property
    def still_open(self) -> list[socket.socket]:
        return [sock for sock in self.sockets if sock not in self.closed_at]

    def watch(self, seconds: float, *, trickle: bool = False) -> None:
        """Read what arrives for ``seconds``; with ``trickle``, send every open socket one more
        byte of its head each second (uvicorn alone would then never close it)."""
        end = time.monotonic() + seconds
        next_byte = time.monotonic() + 1.0
        while (now := time.monotonic()) < end:
            if trickle and now >= next_byte:
                next_byte = now + 1.0
                for stalled in self.still_open:
                    try:
                        stalled.send(b"x")
                    except OSError:
                        self._closed(stalled)
            for key, _ in self._selector.select(timeout=min(end, next_byte) - now):
                sock = key.data
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    self.answers[sock] += data
                else:
                    self._closed(sock)

    def _closed(self, sock: socket.socket) -> None:
        if sock not in self.closed_at:
            self.closed_at[sock] = time.monotonic()
            self._selector.unregister(sock)

    def status(self, sock: socket.socket) -> int | None:
        head = self.answers[sock].split(b"\r\n", 1)[0]
        parts = head.split()
        return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") else None


def test_trickling_heads_are_closed_in_time_while_health_answers(target: Target) -> None:
    """300 clients each send part of a head and then a byte a second: every one is closed within
    the head timeout (the oldest at once when the cap is full, the rest with a 408), and fresh
    clients' /health is answered all along."""
    with Clients(target.port) as stallers:
        for _ in range(300):
            stallers.open(PARTIAL_HEAD)
        flood_started = time.monotonic()
        health = []
        while time.monotonic() < flood_started + HEAD_TIMEOUT_S + SLACK_S and stallers.still_open:
            health.append(httpx.get(f"{target.url}/health", timeout=5, trust_env=False).status_code)
            stallers.watch(0.5, trickle=True)
        assert not stallers.still_open, f"{len(stallers.still_open)} of 300 trickling heads still open"
        late = [s for s in stallers.sockets if stallers.closed_at[s] - stallers.opened_at[s] > HEAD_TIMEOUT_S + SLACK_S]
        assert not late, f"{len(late)} closed later than the head timeout"
        timed_out = [s for s in stallers.sockets if stallers.closed_at[s] - stallers.opened_at[s] >= HEAD_TIMEOUT_S]
        assert timed_out, "the youngest ones (within the cap) are closed by the head timeout"
        assert {stallers.status(s) for s in timed_out} == {408}
        assert b"request head was not complete" in stallers.answers[timed_out[-1]]
        assert health and set(health) == {200}, health
    assert _healthy(target.url)


def test_at_the_cap_a_fresh_client_gets_in_by_closing_the_oldest_stalled_head(target: Target) -> None:
    with Clients(target.port) as stallers:
        first = stallers.open(PARTIAL_HEAD)
        for _ in range(CAP - 1):
            last = stallers.open(PARTIAL_HEAD)
        asked = time.monotonic()
        answer = httpx.get(f"{target.url}/health", timeout=HEAD_TIMEOUT_S, trust_env=False)
        assert answer.status_code == 200
        assert time.monotonic() - asked < HEAD_TIMEOUT_S / 2, "answered before any head timed out"
        stallers.watch(0.2)
        assert first in stallers.closed_at, "the oldest stalled head made room"
        assert stallers.status(first) == 408 and b"make room" in stallers.answers[first]
        assert last not in stallers.closed_at, "the youngest stalled head is still waiting"


def test_beyond_the_cap_a_new_connection_gets_503_at_once_when_every_slot_runs_a_request(target: Target) -> None:
    # Each head is complete; its body never comes, so its request runs (reading it) until the
    # client leaves. The server's "100 Continue" says that the request is running.
    busy = (
        f"POST {target.busy_path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        "content-length: 100\r\nexpect: 100-continue\r\n\r\n"
    ).encode()
    with Clients(target.port) as requests:
        for _ in range(CAP):
            requests.open(busy)
        deadline = time.monotonic() + 30
        while not all(requests.answers[s].startswith(b"HTTP/1.1 100") for s in requests.sockets):
            assert time.monotonic() < deadline, "every request runs"
            requests.watch(0.05)
        asked = time.monotonic()
        refused = httpx.get(f"{target.url}/health", timeout=HEAD_TIMEOUT_S, trust_env=False)
        assert time.monotonic() - asked < 1.0, "refused at once, not after a timeout"
        assert refused.status_code == 503
        assert refused.headers["connection"] == "close" and refused.headers["retry-after"] == "1"
        assert "limit of 32 connections" in refused.json()["error"]["message"]
        assert not requests.closed_at, "a running request is never closed to make room"
    deadline = time.monotonic() + 10
    while not _healthy(target.url):
        assert time.monotonic() < deadline, "slots come back when the requests end"
        time.sleep(0.1)


def test_pooled_connections_outlive_the_head_timeout_that_closes_a_stalled_one(target: Target) -> None:
    """An httpx pool's connection idles longer than the head timeout between two requests and is
    reused (idle connections stay under the keep-alive timeout); a head stalled for as long is
    closed. Through the controller, the second request also crosses its pooled connection to the
    engine, idle past the engine's own (0.5 s) head timeout."""
    generate = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    with httpx.Client(base_url=target.url, timeout=60, trust_env=False) as pool, Clients(target.port) as stalled:
        first = pool.post("/generate", json=generate)
        assert first.status_code == 200, first.text
        stalled.open(PARTIAL_HEAD)
        stalled.watch(HEAD_TIMEOUT_S + 0.5)
        assert not stalled.still_open
        second = pool.post("/generate", json=generate)
        assert second.status_code == 200, second.text
        assert second.json()["output_ids"] == first.json()["output_ids"]
        used = [r.extensions["network_stream"].get_extra_info("client_addr") for r in (first, second)]
        assert used[0] == used[1], "the pooled connection was kept"
    assert _healthy(target.url)

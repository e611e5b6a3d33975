"""SGLang's real router (sglang-router, pinned in pyproject.toml) in front of two miles engines.

The router registers each worker the way it registers an SGLang server (``/health``,
``/server_info``, ``/model_info``) and forwards ``/generate`` with fields of its own added, so this
is the check that the engine speaks SGLang's API as SGLang's own tools use it. Everything listens
on 127.0.0.1 only, the router's metrics server included.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from miles.rollout.engine_process import free_port
from miles.testing import running_engine

GREEDY = {"text": "12+34=", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
# OpenAI clients name the model; the router requires it (the engine serves "tiny" under any name).
COMPLETION = {"model": "tiny", "prompt": "the cat", "max_tokens": 5, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@contextmanager
def running_router(
    worker_urls: list[str], *, log_path: Path, startup_timeout_s: float = 30.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``python -m sglang_router.launch_router`` on loopback; yield its URL and process;
    always kill it."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.fail("sglang-router is not installed: run `make test` (it installs the dev dependencies)")
    port, metrics_port = free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # The metrics server binds 0.0.0.0:29000 unless told otherwise.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--policy",
        "round_robin",
        "--log-level",
        "warn",
    ]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            assert process.poll() is None, (
                f"the router exited with {process.returncode}: {log_path.read_text()[-3000:]}"
            )
            try:
                # Ready once it has registered a healthy worker.
                if httpx.get(f"{url}/readiness", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the router never became ready: {log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        yield url, process
    finally:
        process.kill()
        process.wait(timeout=30)


def listening_addresses(pid: int) -> set[str]:
    """The local addresses of the TCP sockets process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    addresses = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                addresses.add(_address(local))
    return addresses


def _address(hex_address: str) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return f"{'.'.join(str(b) for b in reversed(raw))}:{int(port, 16)}"
    words = [raw[i : i + 4][::-1].hex() for i in range(0, 16, 4)]
    return f"[{''.join(words)}]:{int(port, 16)}"


def tokens_generated(url: str) -> int:
    info = httpx.get(f"{url}/server_info", trust_env=False).json()
    return int(info["internal_states"][0]["tokens_generated"])


def test_sglang_router_serves_generate_and_openai_routes_from_two_engines(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    with ExitStack() as stack:
        engines = [stack.enter_context(running_engine(checkpoints["v1"], log_dir=tmp_path)) for _ in range(2)]
        direct = httpx.post(f"{engines[0]}/generate", json=GREEDY, timeout=60, trust_env=False).json()
        direct_completion = httpx.post(
            f"{engines[0]}/v1/completions", json=COMPLETION, timeout=60, trust_env=False
        ).json()
        direct_chat = httpx.post(f"{engines[0]}/v1/chat/completions", json=CHAT, timeout=60, trust_env=False).json()
        before = [tokens_generated(url) for url in engines]
        router, process = stack.enter_context(running_router(engines, log_path=tmp_path / "router.log"))

        listening = listening_addresses(process.pid)
        assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening

        with httpx.Client(base_url=router, timeout=60, trust_env=False) as http:
            for _ in range(4):  # round robin: both engines answer
                routed = http.post("/generate", json=GREEDY)
                assert routed.status_code == 200, routed.text
                body = routed.json()
                assert body["output_ids"] == direct["output_ids"] and body["text"] == direct["text"]
                assert body["meta_info"]["weight_version"] == "1"
                completion = http.post("/v1/completions", json=COMPLETION)
                assert completion.status_code == 200, completion.text
                choice = completion.json()["choices"][0]
                assert choice["text"] == direct_completion["choices"][0]["text"]
                assert choice["weight_version"] == "1"
            # The router re-sends chat requests with SGLang's defaults filled in (continue_final_message,
            # separate_reasoning, return_hidden_states ...): all accepted.
            chat = http.post("/v1/chat/completions", json=CHAT)
            assert chat.status_code == 200, chat.text
            assert chat.json()["choices"][0]["message"] == direct_chat["choices"][0]["message"]
        after = [tokens_generated(url) for url in engines]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)

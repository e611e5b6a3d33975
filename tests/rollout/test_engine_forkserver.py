"""Engines forked from the warm forkserver (miles.engine.forkserver): they serve like any engine,
get the environment and working directory of their launch, report how they ended, and never
outlive the forkserver or whoever started it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.rollout.engine_process import FORKSERVER_ENV, EngineProcess, EngineStartError, engine_command, free_port
from miles.testing import process_alive

GREEDY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])


async def healthy(process: EngineProcess, url: str, timeout_s: float = 120.0) -> None:
    async with httpx.AsyncClient(trust_env=False) as http:
        await process.wait_healthy(url, timeout_s=timeout_s, http=http)


def ended(process: EngineProcess, timeout_s: float = 30.0) -> bool:
    async def wait() -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while process.alive():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)  # the exit is reported by another process; nothing to await
        return True

    return asyncio.run(wait())


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[EngineProcess]]:
    processes: list[EngineProcess] = []
    yield processes
    for process in processes:
        process.kill()


def launch(
    started: list[EngineProcess], checkpoint: Path, log: Path, env: dict[str, str] | None = None
) -> tuple[EngineProcess, str]:
    port = free_port()
    process = EngineProcess(command=engine_command(checkpoint, port=port, num_threads=1), log_path=log, env=env)
    process.start()
    started.append(process)
    return process, f"http://127.0.0.1:{port}"


def test_a_forked_engine_serves_with_its_own_environment_and_reports_a_kill(
    checkpoints: dict[str, Path], tmp_path: Path, started: list[EngineProcess]
) -> None:
    key = "forked-engine-api-key"
    process, url = launch(started, checkpoints["v1"], tmp_path / "a.log", env={"MILES_API_KEY": key})
    asyncio.run(healthy(process, url))
    pid = process.pid
    assert pid is not None
    assert parent_of(pid) != os.getpid()  # forked by the forkserver, not this process
    # ps shows the engine's command line, not the forkserver's.
    title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    assert b"-m miles.engine --model-path" in title and b"forkserver" not in title, title
    # The launch's environment reached the engine: it asks for the API key it was given.
    assert httpx.post(f"{url}/generate", json=GREEDY, trust_env=False, timeout=60).status_code == 401
    answer = httpx.post(
        f"{url}/generate", json=GREEDY, headers={"authorization": f"Bearer {key}"}, trust_env=False, timeout=60
    )
    assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 4

    os.kill(pid, signal.SIGKILL)
    assert ended(process), "a killed engine was still reported alive"
    assert process.returncode == -signal.SIGKILL
    assert not process_alive(pid)


def test_an_engine_that_cannot_start_says_why_in_its_log(tmp_path: Path, started: list[EngineProcess]) -> None:
    process, url = launch(started, tmp_path / "no-such-checkpoint", tmp_path / "b.log")
    with pytest.raises(EngineStartError, match="exited with code") as failure:
        asyncio.run(healthy(process, url, timeout_s=60))
    assert "no-such-checkpoint" in str(failure.value.context.get("tail"))
    assert process.returncode not in (None, 0)


def test_a_relative_checkpoint_is_found_from_the_launchers_directory(
    checkpoints: dict[str, Path], tmp_path: Path, started: list[EngineProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(checkpoints["v1"].parent)
    process, url = launch(started, Path(checkpoints["v1"].name), tmp_path / "c.log")
    asyncio.run(healthy(process, url))
    assert httpx.post(f"{url}/generate", json=GREEDY, trust_env=False, timeout=60).status_code == 200


def test_engines_outlive_a_killed_forkserver_and_the_next_launch_starts_another(
    checkpoints: dict[str, Path], tmp_path: Path, started: list[EngineProcess]
) -> None:
    process, url = launch(started, checkpoints["v1"], tmp_path / "d.log")
    asyncio.run(healthy(process, url))
    pid = process.pid
    assert pid is not None
    forkserver = parent_of(pid)
    os.kill(forkserver, signal.SIGKILL)
    while process_alive(forkserver):
        time.sleep(0.05)  # another process's exit: nothing to await but /proc
    # The engine does not depend on the forkserver once forked: it serves on.
    time.sleep(1.5)  # longer than an engine takes to notice that its parent is gone
    assert process.alive() and process_alive(pid)
    assert httpx.post(f"{url}/generate", json=GREEDY, trust_env=False, timeout=60).status_code == 200
    # Its end is still seen, though the forkserver cannot report it any more.
    os.kill(pid, signal.SIGKILL)
    assert ended(process), "a killed engine was still reported alive"
    assert process.returncode is not None

    again, url = launch(started, checkpoints["v1"], tmp_path / "e.log")
    asyncio.run(healthy(again, url))
    assert again.pid is not None and parent_of(again.pid) not in (forkserver, os.getpid())


def test_without_the_forkserver_an_engine_is_a_child_of_its_launcher(
    checkpoints: dict[str, Path], tmp_path: Path, started: list[EngineProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORKSERVER_ENV, "0")
    process, url = launch(started, checkpoints["v1"], tmp_path / "f.log")
    asyncio.run(healthy(process, url))
    assert process.pid is not None and parent_of(process.pid) == os.getpid()


# A launcher that starts an engine, then forks a child that outlives it (as a data-loader worker
# would), and prints both pids.
LAUNCHER = """
import os, sys, time
from pathlib import Path
from miles.rollout.engine_process import EngineProcess, engine_command, free_port
from miles.testing import wait_until
import asyncio, httpx

port = free_port()
process = EngineProcess(command=engine_command(Path(sys.argv[1]), port=port, num_threads=1), log_path=Path(sys.argv[2]))
process.start()

async def healthy():
    async with httpx.AsyncClient(trust_env=False) as http:
        await process.wait_healthy(f"http://127.0.0.1:{port}", timeout_s=120, http=http)

asyncio.run(healthy())
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
print(process.pid, child, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("forkserver_first", [False, True], ids=["launcher", "forkserver-then-launcher"])
def test_a_launcher_killed_outright_takes_its_engines_even_with_a_forked_child_alive(
    checkpoints: dict[str, Path], tmp_path: Path, forkserver_first: bool
) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(checkpoints["v1"]), str(tmp_path / "engine.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        assert launcher.stdout is not None
        engine, child = (int(pid) for pid in launcher.stdout.readline().split())
        if forkserver_first:
            os.kill(parent_of(engine), signal.SIGKILL)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while process_alive(engine):
            assert time.monotonic() < deadline, "the engine outlived its launcher"
            time.sleep(0.05)  # another process's exit: nothing to await but /proc
        assert process_alive(child)  # the forked child was left alone
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if child is not None and process_alive(child):
            os.kill(child, signal.SIGKILL)

"""SGLangRollout against servers that answer as SGLang 0.5.23 does where it differs from the
embedded engine (``sglang_shaped_proxy.py`` in front of real engines): its own weights digest,
no /get_weight_version, no /fence, no drain pause mode, a bare pause answer. The digest is mapped
onto the canonical checksum, so the gate compares canonical checksums unchanged."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from rollout_contract import update_all

from miles.protocol.sglang import PauseMode
from miles.rollout.engine_process import EngineProcess, engine_command, free_port
from miles.rollout.sglang_digests import UNTRANSLATED_PREFIX
from miles.rollout.sglang_rollout import SGLangRollout
from miles.rollout.spec import HealthSettings, RolloutSpec
from miles.rollout.state import ServerState
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROXY = Path(__file__).parent / "sglang_shaped_proxy.py"


@pytest.fixture(scope="module")
def sglang_shaped(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two engines on v1, each behind a proxy that answers as SGLang does; yields the proxies' URLs."""
    log_dir = tmp_path_factory.mktemp("sglang-shaped")
    processes, urls = [], []
    try:
        for _ in range(2):
            engine_port, proxy_port = free_port(), free_port()
            engine = EngineProcess(
                command=engine_command(checkpoints["v1"], port=engine_port, num_threads=1),
                log_path=log_dir / f"engine-{engine_port}.log",
            )
            proxy = EngineProcess(
                command=[sys.executable, str(PROXY), "--upstream", f"http://127.0.0.1:{engine_port}"]
                + ["--port", str(proxy_port)],
                log_path=log_dir / f"proxy-{proxy_port}.log",
            )
            for process in (engine, proxy):
                process.start()
                processes.append(process)
            urls.append(f"http://127.0.0.1:{proxy_port}")
        yield urls
    finally:
        for process in processes:
            process.kill()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(
    checkpoints: dict[str, Path], sglang_shaped: list[str], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SGLangRollout]:
    spec = RolloutSpec(
        name="native",
        checkpoint=checkpoints["v1"],
        num_servers=2,
        urls=tuple(sglang_shaped),
        health=HealthSettings(interval_s=0.2, timeout_s=2.0, failure_threshold=2),
        log_dir=tmp_path_factory.mktemp("native-logs"),
        startup_timeout_s=120,
    )
    rollout = SGLangRollout(spec)
    await rollout.start()
    try:
        yield rollout
    finally:
        await rollout.stop()


async def salt(url: str, value: str) -> None:
    async with httpx.AsyncClient(trust_env=False) as http:
        (await http.post(f"{url}/_fake/digest_salt", json={"salt": value})).raise_for_status()


async def test_sglang_digests_are_confirmed_as_canonical_checksums(
    server: SGLangRollout, checkpoints: dict[str, Path]
) -> None:
    v1 = read_manifest(checkpoints["v1"]).checksum
    for snap in server.snapshot():
        assert snap.state is ServerState.SERVING
        assert snap.checksum == v1
    reported = await server.client(server.server_ids[0]).weights_checksum()
    assert reported.algorithm == "sglang_per_engine_sha256" and reported.checksum != v1
    assert reported.layout == "tp1-dp1-pp1"
    assert await update_all(server, checkpoints["v2"]) == "2"
    assert await update_all(server, checkpoints["v1"]) == "1"


async def test_a_server_digesting_verified_weights_otherwise_is_a_mismatch(
    server: SGLangRollout, checkpoints: dict[str, Path]
) -> None:
    sid = server.server_ids[1]
    url = server.cell(sid).url
    assert url is not None
    await salt(url, "-partial-load")
    try:
        server.begin_update(sid, reason="a load that goes wrong")
        v2 = read_manifest(checkpoints["v2"])
        response = await server.load(sid, checkpoints["v2"], weight_version="2", expected_checksum=v2.checksum)
        assert response.success
        confirmed = await server.confirm(sid)
        assert confirmed.checksum != v2.checksum
        assert confirmed.checksum.startswith(UNTRANSLATED_PREFIX)
    finally:
        await salt(url, "")
    await server.rollback(sid, reason="restore after the bad load")
    assert server.cell(sid).state is ServerState.SERVING
    assert server.cell(sid).checksum == read_manifest(checkpoints["v1"]).checksum


async def test_sglang_pause_modes_and_probes(server: SGLangRollout, supervisor_rounds) -> None:  # type: ignore[no-untyped-def]
    sid = server.server_ids[0]
    # SGLang has no drain: its updates wait for running requests themselves; nothing to pause.
    assert await server.pause(sid, PauseMode.DRAIN) == 0
    assert await server.pause(sid, PauseMode.ABORT) == 0
    await server.resume(sid)
    await server.fence(sid, 7, window_open=False)  # SGLang has no /fence: nothing to tell it
    identity = await server.identity(sid)
    assert identity.weight_version == "1" and identity.checksum is None  # from /model_info
    await supervisor_rounds(server, 3)
    assert all(snap.state is ServerState.SERVING for snap in server.snapshot())


async def test_the_rest_of_sglangs_api_through_the_client(server: SGLangRollout) -> None:
    client = server.client(server.server_ids[1])
    assert await client.health()
    assert await client.health_generate()
    model = await client.model_info()
    assert model["served_model_name"] == server.model_name and model["weight_version"] == "1"
    info = await client.server_info()
    assert info["served_model_name"] == server.model_name and info["tp_size"] == 1
    await client.abort_request(abort_all=True, abort_message="nothing to abort")
    await client.abort_request("no-such-request")
    await client.flush_cache()

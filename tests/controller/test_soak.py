"""A bounded soak: clients, racing updates (both strategies) and training windows all at once.

Zero requests may fail; every answer must be exactly what one committed version's weights produce;
the model's serving version never decreases; the event log passes ``miles events --check``.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from miles.testing import running_controller
from miles.utils.audit_utils.event_logger.models import WeightUpdateCommittedEvent
from miles.utils.weight_version import version_number
from miles.weights.checkpoint import read_manifest

pytestmark = pytest.mark.asyncio

SOAK_S = 20.0
PROMPTS = ["a", "12+7=", "hello", "zz"]
WEIGHTS = ("v2", "v3", "v4")


def body(prompt: str) -> dict[str, object]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


async def test_soak_updates_windows_and_clients(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    events_dir = tmp_path / "events"
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2, events_dir=events_dir) as (
        controller,
        url,
    ):
        assert url is not None
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False, limits=limits) as http:
            versions = itertools.count(10)
            weights_of: dict[str, str] = {}
            reference: dict[str, list[list[int]]] = {}
            for name in WEIGHTS:
                version = str(next(versions))
                result = await controller.update_rollout_weights(checkpoints[name], weight_version=version)
                assert result.ok, result.message
                weights_of[version] = name
                reference[name] = [(await http.post("/generate", json=body(p))).json()["output_ids"] for p in PROMPTS]
            assert len({tuple(map(tuple, r)) for r in reference.values()}) == len(WEIGHTS)

            stop = asyncio.Event()
            answers: list[tuple[int, int, dict]] = []
            serving_seen: list[int] = []
            outcomes: list[str] = []

            async def client(worker: int) -> None:
                for i in itertools.count(worker):
                    if stop.is_set():
                        return
                    index = i % len(PROMPTS)
                    answer = await http.post("/generate", json=body(PROMPTS[index]))
                    answers.append((index, answer.status_code, answer.json()))

            async def updater(seed: int) -> None:
                rng = random.Random(seed)
                while not stop.is_set():
                    version, name = str(next(versions)), rng.choice(WEIGHTS)
                    weights_of[version] = name
                    strategy = rng.choice(["barrier", "rolling"])
                    answer = await http.post(
                        "/update_weights",
                        json={"checkpoint": str(checkpoints[name]), "weight_version": version, "strategy": strategy},
                    )
                    outcomes.append(answer.json()["status"])
                    await asyncio.sleep(rng.uniform(0, 0.2))

            async def trainer(seed: int) -> None:
                rng = random.Random(seed)
                async with httpx.AsyncClient(timeout=120, trust_env=False) as direct:
                    while not stop.is_set():
                        window = await http.post("/update_weights/start", json={"ttl_s": 60})
                        assert window.status_code == 200, window.text
                        opened = window.json()
                        version, name = str(next(versions)), rng.choice(WEIGHTS)
                        weights_of[version] = name
                        for server in opened["servers"]:
                            pushed = await direct.post(
                                f"{server['url']}/update_weights_from_disk",
                                json={"model_path": str(checkpoints[name]), "weight_version": version},
                                headers={"authorization": f"Bearer {opened['credential']}"},
                            )
                            assert pushed.json()["success"], pushed.text
                        manifest = read_manifest(checkpoints[name])
                        ended = await http.post(
                            "/update_weights/end",
                            json={"token": opened["token"], "checksum": manifest.checksum, "step": int(version)},
                        )
                        outcomes.append(ended.json()["status"])
                        await asyncio.sleep(rng.uniform(0, 0.3))

            async def watcher() -> None:
                while not stop.is_set():
                    newest = controller.health().models["tiny"].versions
                    numbers = [version_number(v) for v in newest]
                    if numbers and None not in numbers:
                        serving_seen.append(max(n for n in numbers if n is not None))
                    await asyncio.sleep(0.05)

            tasks = [asyncio.create_task(client(w)) for w in range(4)]
            tasks += [asyncio.create_task(updater(s)) for s in range(2)]
            tasks += [asyncio.create_task(trainer(7)), asyncio.create_task(watcher())]
            # Run for SOAK_S, or until a task ends early (a failure, raised by the gather below).
            await asyncio.wait(tasks, timeout=SOAK_S, return_when=asyncio.FIRST_COMPLETED)
            stop.set()
            await asyncio.gather(*tasks)

        commits = [e for e in controller.event_logger.events if isinstance(e, WeightUpdateCommittedEvent)]

    failed = [(status, answer) for _, status, answer in answers if status != 200]
    assert not failed, failed[:3]
    assert len(answers) > 100
    committed = {e.weight_version for e in commits}
    for index, _, answer in answers:
        meta = answer["meta_info"]
        version = meta["weight_version"]
        assert meta["weight_version_start"] == version, meta
        assert version in committed, f"served uncommitted version {version}"
        assert answer["output_ids"] == reference[weights_of[version]][index], f"output matches no weights of {version}"
    assert outcomes.count("committed") >= 5, outcomes
    assert set(outcomes) <= {"committed", "rejected"}, outcomes
    numbers = [int(e.weight_version) for e in commits]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert serving_seen == sorted(serving_seen), "the serving version went backwards"
    audit = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "miles.cli", "events", str(events_dir), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr

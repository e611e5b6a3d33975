"""The trainer against one real engine process: sample, train, publish, verify, report."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_apply import EngineDiskApply

from miles.errors import PublishError, RolloutRequestError
from miles.testing import copy_checkpoint, running_engine
from miles.train import (
    DiskPublisher,
    HttpSampler,
    Phase,
    StepReport,
    Trainer,
    TrainerConfig,
    write_initial_checkpoint,
)
from miles.utils.audit_utils.event_logger import EventLogger, InferenceEngineWeightChecksumEvent, read_events
from miles.weights.checkpoint import Manifest, read_manifest

pytestmark = pytest.mark.timeout(120)

SMALL = dict(
    sft_batch_size=8,
    sft_eval_prompts=2,
    prompts_per_step=2,
    group_size=4,
    max_new_tokens=8,
    summary_window=2,
)


@pytest.fixture(scope="module")
def initial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("train-init") / "step-0"
    write_initial_checkpoint(path, TrainerConfig(**SMALL))
    return path


@pytest.fixture(scope="module")
def engine_url(initial: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_engine(initial, log_dir=tmp_path_factory.mktemp("train-engine-logs")) as url:
        yield url


class CheckedApply:
    """Loads through ``EngineDiskApply``, then asks the engine itself (plain HTTP) what it holds."""

    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url
        self.http = http
        self.inner = EngineDiskApply([url], http=http)
        self.checks: list[tuple[str, str, str]] = []

    async def __call__(self, checkpoint_dir: Path, manifest: Manifest) -> None:
        await self.inner(checkpoint_dir, manifest)
        body = (await self.http.post(f"{self.url}/weights_checker", json={"action": "checksum"})).json()
        self.checks.append((manifest.checksum, body["payload"]["checksum"], body["payload"]["weight_version"]))


async def reset(url: str, initial: Path, http: httpx.AsyncClient) -> None:
    await EngineDiskApply([url], http=http)(initial, read_manifest(initial))


async def test_short_run_publishes_verified_checkpoints(engine_url: str, initial: Path, tmp_path: Path) -> None:
    config = TrainerConfig(**SMALL, sft_steps=3, grpo_steps=3)
    reports: list[StepReport] = []
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        await reset(engine_url, initial, http)
        apply = CheckedApply(engine_url, http)
        with EventLogger(tmp_path / "events", component="trainer") as events:
            publisher = DiskPublisher(tmp_path / "ckpt", model_name=config.model_name, event_logger=events, apply=apply)
            sampler = HttpSampler([engine_url], http=http)
            trainer = Trainer(config, sampler=sampler, publisher=publisher, on_step=reports.append)
            summary = await trainer.run()
        served = (await http.get(f"{engine_url}/get_weight_version")).json()["weight_version"]

    # Every publish was verified by the engine's own checksum of the weights it held.
    assert len(apply.checks) == 6
    assert all(expected == held for expected, held, _ in apply.checks)
    assert [version for _, _, version in apply.checks] == ["1", "2", "3", "4", "5", "6"]
    assert served == "6" == summary.final_publish.weight_version
    # The checksum each publish announced is the one the engine ended up holding.
    published = [e for e in read_events(tmp_path / "events") if isinstance(e, InferenceEngineWeightChecksumEvent)]
    assert [(e.step, e.checksum) for e in published] == [(i + 1, c[0]) for i, c in enumerate(apply.checks)]

    assert summary.steps == tuple(reports)
    assert [r.phase for r in reports] == [Phase.SFT] * 3 + [Phase.GRPO] * 3
    for report in reports:
        assert report.step == reports.index(report) + 1
        assert report.num_samples == 8 and report.num_interrupted == 0
        assert 0.0 <= report.mean_reward <= 1.0
        assert report.publish is not None and report.publish.weight_version == str(report.step)
        assert report.publish.latency_s > 0
        # Published after every step: samples came from the version the step before published.
        assert [v.weight_version for v in report.rewards_by_version] == [str(report.step - 1)]
        assert report.staleness.max == 0 and report.staleness.unparsed == 0
    for report in reports[3:]:
        # On-policy samples: the trainer's logprobs equal the server's, so every ratio is ~1.
        assert report.mean_ratio == pytest.approx(1.0, abs=1e-3)
        assert report.clip_fraction == 0.0
        assert report.behaviour_kl == pytest.approx(0.0, abs=1e-6)
    assert summary.window == 2
    assert summary.reward_first == pytest.approx(sum(r.mean_reward for r in reports[:2]) / 2)
    assert summary.reward_last == pytest.approx(sum(r.mean_reward for r in reports[-2:]) / 2)
    # Only the last two checkpoints are kept on disk.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000005", "step-000006"]


async def test_publishing_every_two_steps_reports_staleness(engine_url: str, initial: Path, tmp_path: Path) -> None:
    config = TrainerConfig(**SMALL, sft_steps=3, grpo_steps=1, publish_every=2)
    reports: list[StepReport] = []
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        await reset(engine_url, initial, http)
        apply = CheckedApply(engine_url, http)
        publisher = DiskPublisher(
            tmp_path / "ckpt", model_name=config.model_name, event_logger=EventLogger(None), apply=apply
        )
        sampler = HttpSampler([engine_url], http=http)
        trainer = Trainer(config, sampler=sampler, publisher=publisher, on_step=reports.append)
        await trainer.run()

    assert [r.publish and r.publish.weight_version for r in reports] == [None, "2", None, "4"]
    assert [v for _, _, v in apply.checks] == ["2", "4"]
    assert [[v.weight_version for v in r.rewards_by_version] for r in reports] == [["0"], ["0"], ["2"], ["2"]]
    assert [r.staleness.max for r in reports] == [0, 1, 0, 1]
    # The GRPO step trains on samples from weights one SFT update old (published at step 2,
    # trained at step 3): the trainer's logprobs are no longer the server's.
    assert reports[3].phase is Phase.GRPO
    # (The mean ratio stays near 1 whatever the gap: it is 1 in expectation under the behaviour
    # policy. The KL estimate is not: here ~5e-3 against exactly 0 on-policy.)
    assert reports[3].behaviour_kl > 1e-4, reports[3].behaviour_kl


async def test_sampler_errors_name_the_server(engine_url: str) -> None:
    async with httpx.AsyncClient(trust_env=False) as http:
        sampler = HttpSampler([engine_url], http=http)
        with pytest.raises(RolloutRequestError, match="answered 400") as info:
            await sampler.sample([[999_999]], group_size=2, max_new_tokens=4)
        assert info.value.context["url"] == engine_url
        closed = HttpSampler(["http://127.0.0.1:9"], http=http, timeout_s=5)
        with pytest.raises(RolloutRequestError, match="/generate failed"):
            await closed.sample([[256, 1]], group_size=2, max_new_tokens=4)


async def test_engine_apply_refuses_a_corrupt_checkpoint(engine_url: str, initial: Path, tmp_path: Path) -> None:
    bad = copy_checkpoint(initial, tmp_path / "bad")
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8 * [0xFF]) if data[-8:] != bytes(8 * [0xFF]) else bytes(8)
    weights.write_bytes(bytes(data))
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        with pytest.raises(PublishError, match="refused") as info:
            await EngineDiskApply([engine_url], http=http)(bad, read_manifest(bad))
        assert info.value.context["server_id"] == engine_url
        # The engine still serves what it had, verified.
        body = (await http.post(f"{engine_url}/weights_checker", json={"action": "checksum"})).json()
        assert body["payload"]["weights_status"] == "verified"

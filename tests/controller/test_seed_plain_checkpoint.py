"""The seed's flow with checkpoints as trainers write them: ``save_pretrained`` directories with no
miles manifest, identified by the checksum training published (matching is by checksum, the
identity of the weights, not by step)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from miles.controller.results import ChecksumSource, UpdateStatus
from miles.models import build_model, build_tokenizer
from miles.models.presets import init_checkpoint
from miles.ray.rollout.inference_controller import AsyncInferenceController
from miles.rollout.state import ServerState
from miles.testing import running_controller
from miles.utils.audit_utils.event_logger.models import InferenceEngineWeightChecksumEvent
from miles.weights.checkpoint import MANIFEST_NAME, read_manifest
from miles.weights.checksum import model_checksum

pytestmark = pytest.mark.asyncio(loop_scope="module")


def save_plain(directory: Path, *, seed: int) -> str:
    """What a trainer writes: ``save_pretrained`` of model and tokenizer; returns its checksum."""
    model = build_model("tiny", seed=seed)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    assert not (directory / MANIFEST_NAME).exists()
    return model_checksum(model)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    root = tmp_path_factory.mktemp("gpt-xyz")
    init_checkpoint(root / "step-41", model_name="gpt-xyz", seed=0, step=41)
    made: dict[str, Path | str] = {"start": root / "step-41"}
    for step, seed in ((42, 1), (43, 2), (44, 3), (45, 4)):
        made[f"plain-{step}"] = root / f"plain-{step}"
        made[f"checksum-{step}"] = save_plain(root / f"plain-{step}", seed=seed)
    # A sealed checkpoint whose manifest says step 7 but holds step 46's weights.
    init_checkpoint(root / "sealed-as-7", model_name="gpt-xyz", seed=5, step=7)
    made["sealed-as-7"] = root / "sealed-as-7"
    # A sealed checkpoint nobody published.
    init_checkpoint(root / "sealed-as-50", model_name="gpt-xyz", seed=6, step=50)
    made["sealed-as-50"] = root / "sealed-as-50"
    return made


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def controller(trained: dict) -> AsyncIterator[AsyncInferenceController]:  # type: ignore[type-arg]
    async with running_controller(model_checkpoint=trained["start"], num_servers=1, http=False) as (ctl, _):
        yield ctl


def publish(controller: AsyncInferenceController, checksum: str, step: int) -> None:
    event = InferenceEngineWeightChecksumEvent(model_name="gpt-xyz", checksum=checksum, step=step)
    controller.event_logger.log(InferenceEngineWeightChecksumEvent, event, print_log=False)


async def test_a_plain_directory_without_a_published_checksum_says_both_ways_out(controller, trained: dict) -> None:
    result = await controller.update_rollout_weights(trained["plain-42"])
    assert result.status is UpdateStatus.REJECTED
    assert "no miles manifest" in result.message
    assert "InferenceEngineWeightChecksumEvent" in result.message and "miles checkpoint seal" in result.message
    assert controller.health().servers[0].weight_version == "41"


async def test_a_plain_directory_whose_checksum_was_published_commits_as_that_step(controller, trained: dict) -> None:
    publish(controller, trained["checksum-42"], 42)
    result = await controller.update_rollout_weights(trained["plain-42"])
    assert result.status is UpdateStatus.COMMITTED, result.message
    assert (result.step, result.weight_version, result.checksum_source) == (42, "42", ChecksumSource.PUBLISHED)
    server = controller.fleet.rollout(None)
    confirmed = await server.confirm("gpt-xyz-0")
    assert (confirmed.checksum, confirmed.weight_version) == (trained["checksum-42"], "42")


async def test_a_plain_directory_with_other_weights_than_published_is_refused_by_name(
    controller, trained: dict
) -> None:
    publish(controller, trained["checksum-43"], 43)
    # plain-44 holds weights training never published; the latest published is step 43.
    result = await controller.update_rollout_weights(trained["plain-44"])
    assert result.status is UpdateStatus.REJECTED
    assert "never published" in result.message
    assert trained["checksum-43"] in result.message and "step 43" in result.message
    assert trained["checksum-44"] in result.message
    # plain-42 holds step 42's published weights, but step 43 is the latest published.
    older = await controller.update_rollout_weights(trained["plain-42"])
    assert older.status is UpdateStatus.REJECTED
    assert "step 42" in older.message and "step 43" in older.message
    assert controller.health().servers[0].weight_version == "42"


async def test_a_sealed_checkpoint_is_matched_by_checksum_not_by_its_step(controller, trained: dict) -> None:
    sealed = read_manifest(trained["sealed-as-7"])
    publish(controller, sealed.checksum, 46)
    result = await controller.update_rollout_weights(trained["sealed-as-7"])
    assert result.status is UpdateStatus.COMMITTED, result.message
    assert (result.step, result.weight_version) == (46, "46")
    # A sealed checkpoint matching nothing published, while newer steps were, is refused by name.
    publish(controller, trained["checksum-45"], 60)
    unpublished = await controller.update_rollout_weights(trained["sealed-as-50"])
    assert unpublished.status is UpdateStatus.REJECTED
    assert "never published" in unpublished.message and "step 60" in unpublished.message
    # Unless the caller republishes it on purpose, under a version of its own.
    republished = await controller.update_rollout_weights(trained["sealed-as-50"], weight_version="70")
    assert republished.status is UpdateStatus.COMMITTED, republished.message


async def test_a_server_restarts_on_weights_from_a_plain_directory(controller, trained: dict) -> None:
    publish(controller, trained["checksum-45"], 80)
    result = await controller.update_rollout_weights(trained["plain-45"])
    assert result.status is UpdateStatus.COMMITTED, result.message
    cell = controller.fleet.rollout(None).cell("gpt-xyz-0")
    restarts = cell.restarts
    assert cell.pid is not None
    os.kill(cell.pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while not (cell.restarts > restarts and cell.state is ServerState.SERVING):
        assert time.monotonic() < deadline, "the server never came back"
        await asyncio.sleep(0.05)
    assert (cell.weight_version, cell.checksum) == ("80", trained["checksum-45"])

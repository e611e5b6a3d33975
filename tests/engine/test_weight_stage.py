"""Staged activation in one process: real models loaded as the engine loads them, both runners.

The stage is written while the runner keeps computing on the old weights, the swap re-points every
tensor (fused views included), and afterwards the model hashes to the staged checksum and computes
what a model loaded fresh from the new checkpoint computes. Nothing else may keep the old memory.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import transformers

from miles.engine.fused_decoder import FusedDecoderRunner
from miles.engine.model_runner import ModelRunner, TransformersRunner, load_model
from miles.engine.settings import StagingMode
from miles.engine.weights.buffers import StagingBuffers, StagingPolicy, StagingRefusedError
from miles.engine.weights.live import copy_weights
from miles.engine.weights.lock import WeightsLock
from miles.engine.weights.memory import StagingUnsupportedError, references
from miles.engine.weights.stage import LiveStage, Stage
from miles.errors import ConflictError, InvalidRequestError, UnsupportedTensorError
from miles.models.presets import build_model
from miles.testing import bucket_segment
from miles.weights.buckets import BucketTable, unpack
from miles.weights.checkpoint import open_checkpoint, read_manifest, save_checkpoint
from miles.weights.checksum import checksum_module, saved_state_dict
from miles.weights.reader import CheckpointReader
from miles.weights.transport.segments import SegmentMaps

DEVICE = torch.device("cpu")


def _config_model(architecture: str, seed: int, **overrides: object) -> transformers.PreTrainedModel:
    config = getattr(transformers, architecture).config_class(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


MODELS: dict[str, Callable[[int], transformers.PreTrainedModel]] = {
    "llama (preset tiny)": lambda seed: build_model("tiny", seed=seed),
    "llama, tied embeddings (preset tiny-tied)": lambda seed: build_model("tiny-tied", seed=seed),
    "qwen2, biased qkv (preset small)": lambda seed: build_model("small", seed=seed),
    "llama, attention and mlp biases": lambda seed: _config_model(
        "LlamaForCausalLM", seed, attention_bias=True, mlp_bias=True
    ),
    "qwen3, q/k norms": lambda seed: _config_model("Qwen3ForCausalLM", seed, head_dim=32),
}

RUNNERS: dict[str, type[FusedDecoderRunner] | type[TransformersRunner]] = {
    "fused": FusedDecoderRunner,
    "transformers": TransformersRunner,
}


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Path]]:
    """Three checkpoints (seeds 0, 1, 2) of each model, written on first use."""
    made: dict[str, dict[str, Path]] = {}

    def get(name: str) -> dict[str, Path]:
        if name not in made:
            root = tmp_path_factory.mktemp("stage")
            made[name] = {}
            for seed in range(3):
                path = root / f"v{seed + 1}"
                save_checkpoint(path, model=MODELS[name](seed), model_name="m", step=seed + 1)
                made[name][f"v{seed + 1}"] = path
        return made[name]

    return get


def _served(checkpoint: Path, runner: str) -> tuple[transformers.PreTrainedModel, ModelRunner]:
    model = load_model(checkpoint, device=DEVICE)
    return model, RUNNERS[runner](model, device=DEVICE, pad_token_id=0)


def _buffers(model: transformers.PreTrainedModel, runner: ModelRunner) -> StagingBuffers:
    buffers = StagingBuffers.build(model, runner_tensors=runner.weight_views())
    buffers.allocate()
    return buffers


PROMPTS = [[5, 17, 42], [7, 7], [1, 2, 3, 4, 5]]


def _generate(runner: ModelRunner, steps: int = 12) -> list[list[int]]:
    """Greedy tokens of three prompts, step by step."""
    batch, logits = runner.prefill(PROMPTS)
    tokens: list[list[int]] = []
    for _ in range(steps):
        chosen = logits.argmax(dim=-1).tolist()
        tokens.append(chosen)
        logits = runner.decode(batch, chosen)
    return tokens


def _logits(runner: ModelRunner) -> torch.Tensor:
    return runner.prefill(PROMPTS)[1].float()


def _stage_checkpoint(buffers: StagingBuffers, checkpoint: Path) -> str:
    """Stage every tensor of ``checkpoint``; returns the staged checksum."""
    stage = buffers.open()
    with open_checkpoint(checkpoint) as reader:
        stage.write_checkpoint(reader)
    checksum = stage.checksum().checksum
    stage.activate()
    return checksum


@pytest.mark.parametrize("runner_name", list(RUNNERS))
@pytest.mark.parametrize("name", list(MODELS))
def test_a_staged_update_computes_what_a_fresh_model_computes(
    versions: Callable[[str], dict[str, Path]], name: str, runner_name: str
) -> None:
    paths = versions(name)
    model, runner = _served(paths["v1"], runner_name)
    before, before_logits = _generate(runner), _logits(runner)
    buffers = _buffers(model, runner)
    stage = buffers.open()
    with open_checkpoint(paths["v2"]) as reader:
        stage.write_checkpoint(reader)
    staged = stage.checksum()
    # Staged, not active: the model still hashes to and computes the old weights.
    assert staged.checksum == read_manifest(paths["v2"]).checksum
    assert checksum_module(model).checksum == read_manifest(paths["v1"]).checksum
    assert _generate(runner) == before
    assert torch.equal(_logits(runner), before_logits)
    old = [s.live for s in buffers.memory.storages]

    assert stage.activate() == staged
    # The live checksum, recomputed from the model, is the one computed over the stage.
    assert checksum_module(model).checksum == staged.checksum
    _, fresh = _served(paths["v2"], runner_name)
    assert _generate(runner) == _generate(fresh)
    torch.testing.assert_close(_logits(runner), _logits(fresh), rtol=0, atol=0)
    assert not torch.equal(_logits(runner), before_logits)
    # Every tensor that viewed an old storage was moved: the one reference left is the Python
    # storage object the buffers keep (this list holds the same objects).
    assert [references(storage) for storage in old] == [1] * len(old)


@pytest.mark.parametrize("runner_name", list(RUNNERS))
def test_updates_alternate_between_two_sets_of_buffers(
    versions: Callable[[str], dict[str, Path]], runner_name: str
) -> None:
    paths = versions("qwen2, biased qkv (preset small)")
    model, runner = _served(paths["v1"], runner_name)
    buffers = _buffers(model, runner)
    first = {s.live.data_ptr() for s in buffers.memory.storages}
    second = {spare.data_ptr() for spare in buffers.spares if spare is not None}
    allocated = buffers.allocated_bytes
    assert allocated == buffers.nbytes > 0
    seen = []
    for version in ("v2", "v3", "v1", "v2"):
        assert _stage_checkpoint(buffers, paths[version]) == read_manifest(paths[version]).checksum
        assert checksum_module(model).checksum == read_manifest(paths[version]).checksum
        seen.append({s.live.data_ptr() for s in buffers.memory.storages})
        assert buffers.allocated_bytes == allocated
    assert seen == [second, first, second, first]
    _, fresh = _served(paths["v2"], runner_name)
    assert _generate(runner) == _generate(fresh)


def test_a_stage_that_fails_midway_leaves_the_live_weights(versions: Callable[[str], dict[str, Path]]) -> None:
    paths = versions("llama (preset tiny)")
    model, runner = _served(paths["v1"], "fused")
    before = _generate(runner)
    buffers = _buffers(model, runner)
    stage = buffers.open()
    written: list[str] = []
    with open_checkpoint(paths["v2"]) as reader:

        class GoesAway(CheckpointReader):
            def copy_into(self, name: str, target: torch.Tensor) -> str:
                if len(written) == 5:
                    raise OSError("the file went away")
                written.append(name)
                return reader.copy_into(name, target)

        failing = GoesAway(directory=reader.directory, manifest=reader.manifest, files=reader._files)
        with pytest.raises(OSError, match="went away"):
            stage.write_checkpoint(failing)
    stage.discard()
    assert checksum_module(model).checksum == read_manifest(paths["v1"]).checksum
    assert _generate(runner) == before
    with pytest.raises(RuntimeError, match="discarded"):
        stage.activate()
    # The next stage starts over and goes through.
    assert _stage_checkpoint(buffers, paths["v2"]) == read_manifest(paths["v2"]).checksum
    assert checksum_module(model).checksum == read_manifest(paths["v2"]).checksum


def test_a_tensor_nobody_reported_blocks_the_swap_and_changes_nothing(
    versions: Callable[[str], dict[str, Path]],
) -> None:
    paths = versions("llama (preset tiny)")
    model, runner = _served(paths["v1"], "fused")
    before = _generate(runner)
    buffers = _buffers(model, runner)
    stage = buffers.open()
    with open_checkpoint(paths["v2"]) as reader:
        stage.write_checkpoint(reader)
    stage.checksum()
    stray = model.model.layers[1].mlp.down_proj.weight.detach()  # a view nobody told the buffers of
    with pytest.raises(StagingRefusedError, match="do not know"):
        stage.activate()
    assert checksum_module(model).checksum == read_manifest(paths["v1"]).checksum
    assert _generate(runner) == before
    assert not buffers.memory.viewers_moved()
    del stray
    assert _stage_checkpoint(buffers, paths["v2"]) == read_manifest(paths["v2"]).checksum


def test_a_runner_that_hides_its_fused_weights_cannot_be_staged(versions: Callable[[str], dict[str, Path]]) -> None:
    model, _runner = _served(versions("llama (preset tiny)")["v1"], "fused")
    with pytest.raises(StagingUnsupportedError, match="weight_views"):
        StagingBuffers.build(model, runner_tensors=())


def test_names_not_written_keep_their_live_values(versions: Callable[[str], dict[str, Path]]) -> None:
    """A delta: one tensor staged, the rest copied from the live weights into the stage."""
    paths = versions("llama (preset tiny)")
    model, runner = _served(paths["v1"], "fused")
    buffers = _buffers(model, runner)
    name = "model.layers.0.self_attn.k_proj.weight"
    with open_checkpoint(paths["v2"]) as reader:
        new = reader.tensor(name).clone()
    expected = {k: v.clone() for k, v in saved_state_dict(model).items()}
    expected[name] = new
    stage = buffers.open()
    assert name in stage.names
    stage.write(name, new)
    checksum = stage.checksum()
    assert stage.activate() == checksum
    live = saved_state_dict(model)
    assert all(torch.equal(live[k], v) for k, v in expected.items())
    assert checksum_module(model).checksum == checksum.checksum


def test_writes_are_checked_and_a_stage_activates_only_once_hashed(versions: Callable[[str], dict[str, Path]]) -> None:
    paths = versions("llama (preset tiny)")
    model, runner = _served(paths["v1"], "fused")
    buffers = _buffers(model, runner)
    stage = buffers.open()
    with pytest.raises(RuntimeError, match="already open"):
        buffers.open()
    with pytest.raises(KeyError, match="not a tensor of the served model"):
        stage.write("model.layers.9.mlp.up_proj.weight", torch.zeros(1))
    with pytest.raises(UnsupportedTensorError, match="dtype and shape"):
        stage.write("model.norm.weight", torch.zeros(3))
    stage.write("model.norm.weight", torch.ones(64))
    with pytest.raises(RuntimeError, match="checksum"):
        stage.activate()
    stage.checksum()
    stage.write("model.norm.weight", torch.full((64,), 2.0))  # a write after the checksum needs a new one
    with pytest.raises(RuntimeError, match="checksum"):
        stage.activate()
    stage.discard()
    assert checksum_module(model).checksum == read_manifest(paths["v1"]).checksum


def test_the_policy_stages_when_asked_and_says_why_not(versions: Callable[[str], dict[str, Path]]) -> None:
    model, runner = _served(versions("llama (preset tiny)")["v1"], "fused")

    def policy(mode: StagingMode, budget: float = 0.5) -> StagingPolicy:
        staging = StagingPolicy(mode=mode, budget=budget)
        staging.attach(model, runner_tensors=runner.weight_views())
        return staging

    # A policy that does not stage hands out the live weights as the stage (an in-place copy).
    off = policy(StagingMode.OFF)
    assert isinstance(off.open_stage(model), LiveStage)
    assert off.report().as_dict() == {
        "mode": "off",
        "budget": 0.5,
        "weight_bytes": 0,
        "staging_bytes": 0,
        "last_update_staged": False,
        "reason": "--weight-staging off",
    }

    too_small = policy(StagingMode.AUTO, budget=1e-12)
    assert isinstance(too_small.open_stage(model), LiveStage)
    report = too_small.report()
    assert report.staging_bytes == 0 and report.weight_bytes > 0 and report.last_update_staged is False
    assert report.reason is not None and "--weight-staging-budget" in report.reason

    on = policy(StagingMode.ON, budget=1e-12)  # the budget only matters under auto
    stage = on.open_stage(model)
    assert not stage.in_place
    stage.discard()
    report = on.report()
    assert report.staging_bytes == report.weight_bytes > 0
    assert (report.last_update_staged, report.reason) == (True, None)


@pytest.mark.parametrize("where", ["memory", "segment"])
def test_a_pushed_bucket_is_staged_on_two_threads_and_a_bad_digest_stops_it(
    versions: Callable[[str], dict[str, Path]], where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pushed buckets are staged on the engine's threads (forced here for a small model), from a
    receive buffer or a mapped segment, fused views included; a tensor whose bytes do not match
    its digest fails the whole bucket."""
    paths = versions("qwen2, biased qkv (preset small)")
    model, runner = _served(paths["v1"], "fused")
    buffers = _buffers(model, runner)
    new = saved_state_dict(load_model(paths["v2"], device=DEVICE))
    segment, table = bucket_segment(new)
    flat = segment.flat if where == "memory" else SegmentMaps().flat(segment.ref, table.total_bytes)
    monkeypatch.setattr("miles.engine.weights.stage._PARALLEL_WRITE_BYTES", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        staged = buffers.open()
        staged.write_bucket(unpack(table, flat))
        assert staged.checksum().checksum == read_manifest(paths["v2"]).checksum
        staged.discard()

        wrong = table.entries[-1].model_copy(update={"digest": "0" * 32})
        with pytest.raises(InvalidRequestError, match=f"{wrong.name!r} arrived with digest"):
            buffers.open().write_bucket(unpack(BucketTable(entries=(*table.entries[:-1], wrong)), flat))
    finally:
        torch.set_num_threads(threads)
        segment.close()
    assert checksum_module(model).checksum == read_manifest(paths["v1"]).checksum


class ReadWatched(WeightsLock):
    """The engine's lock, telling when a reader first got in."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = threading.Event()

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with super().read():
            self.reading.set()
            yield


@pytest.mark.parametrize("runner_name", list(RUNNERS))
def test_a_swap_during_an_export_copy_goes_through_and_ends_the_copy(
    versions: Callable[[str], dict[str, Path]], runner_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy an export takes holds no view of the live weights between its slices, so a staged
    swap that comes between two of them is not refused (it would leave such a view on the old
    weights); the copy then stops, since the weights it copied are no longer the served ones."""
    monkeypatch.setattr("miles.engine.weights.live.READ_SECTION_BYTES", 64)  # thousands of read sections
    paths = versions("qwen2, biased qkv (preset small)")
    model, runner = _served(paths["v1"], runner_name)
    buffers = _buffers(model, runner)
    stage = buffers.open()
    with open_checkpoint(paths["v2"]) as reader:
        stage.write_checkpoint(reader)
    staged = stage.checksum()
    lock = ReadWatched()
    outcome: dict[str, object] = {}

    def export_copy() -> None:
        try:
            copy_weights(model, lock, writes=lock.writes, what="weights 1")
            outcome["copied"] = True
        except ConflictError as exc:
            outcome["refused"] = str(exc)

    copier = threading.Thread(target=export_copy)
    copier.start()
    assert lock.reading.wait(timeout=60), "the copy never began"
    with lock.write():
        assert stage.activate() == staged
    copier.join(timeout=120)
    assert not copier.is_alive()
    assert "copied" not in outcome, "the copy ended before the swap: make the model larger"
    assert "weights changed while they were read" in str(outcome["refused"])
    assert checksum_module(model).checksum == staged.checksum


def test_a_delta_copies_only_what_the_twins_do_not_hold_already(versions: Callable[[str], dict[str, Path]]) -> None:
    """After two swaps the twins hold the weights from before the last one: a stage given only the
    names that changed copies nothing else into them (their digests say so), and still hashes
    to the whole model's checksum."""
    paths = versions("llama (preset tiny)")
    model, runner = _served(paths["v1"], "fused")
    buffers = _buffers(model, runner)
    for _ in range(2):
        stage = buffers.open()
        with open_checkpoint(paths["v1"]) as reader:
            stage.write_checkpoint(reader)
        stage.checksum()
        stage.activate()

    def copied_by(stage: Stage) -> list[str]:
        """The names ``stage.checksum()`` copies from the live weights."""
        before = dict(buffers.twin_digests)
        stage.checksum()
        return sorted(n for n, d in buffers.twin_digests.items() if before.get(n) != d or n not in before)

    name = "model.layers.0.mlp.up_proj.weight"
    new = torch.full(dict(model.named_parameters())[name].shape, 0.5)
    stage = buffers.open()
    stage.write(name, new)
    assert copied_by(stage) == []
    assert stage.activate().checksum == checksum_module(model).checksum
    assert torch.equal(dict(model.named_parameters())[name].detach(), new)
    # The next delta, of another name, copies back only the one that changed last time.
    stage = buffers.open()
    stage.write("model.norm.weight", torch.full((64,), 2.0))
    assert copied_by(stage) == [name]
    assert stage.activate().checksum == checksum_module(model).checksum

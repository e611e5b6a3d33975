"""The fused Llama-family forward against the model's own Transformers forward.

Both runners serve the same model object (the fused one re-points the projections at its fused
weights, which the Transformers forward then reads through the same parameters), through the same
script of continuous batching: prompts of different lengths, a second group joining mid-flight,
rows leaving, and more decode steps than the preallocated KV columns hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from miles.engine.fused_decoder import FusedDecoderRunner, supports
from miles.engine.model_runner import TransformersRunner, build_runner, load_model
from miles.engine.settings import Forward
from miles.engine.weights.sources import open_verified
from miles.engine.weights.stage import LiveStage
from miles.models.presets import build_model, init_checkpoint
from miles.weights.checkpoint import read_manifest

_SMALL = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _from_config(architecture: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object):
    model_cls = getattr(transformers, architecture)
    config = model_cls.config_class(**{**_SMALL, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


MODELS = {
    "llama (preset tiny)": lambda: build_model("tiny", seed=0),
    "llama, tied embeddings (preset tiny-tied)": lambda: build_model("tiny-tied", seed=0),
    "qwen2, biased qkv (preset small)": lambda: build_model("small", seed=0),
    "llama, attention and mlp biases": lambda: _from_config(
        "LlamaForCausalLM",
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "qwen3, q/k norms": lambda: _from_config("Qwen3ForCausalLM", head_dim=32),
    "mistral without a sliding window": lambda: _from_config("MistralForCausalLM", sliding_window=None),
}


def _prompts(count: int, *, seed: int, vocab: int = 256) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (3 + (5 * i) % 11,), generator=generator).tolist() for i in range(count)]


def _script(runner, *, steps: int, forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Continuous batching, greedy: 3 prompts, 4 more join after 5 steps, rows leave after 9 and 14.

    Returns the tokens chosen at each step and the logits they were chosen from. With ``forced``,
    those tokens are fed instead of the argmax (to compare logits along one token path).
    """
    batch, logits = runner.prefill(_prompts(3, seed=1))
    tokens_per_step: list[list[int]] = []
    logits_per_step: list[torch.Tensor] = []
    for step in range(steps):
        if step == 5:
            joined, joined_logits = runner.prefill(_prompts(4, seed=2))
            batch = runner.merge(batch, joined)
            logits = torch.cat([logits, joined_logits])
        if step in (9, 14):
            keep = [row for row in range(logits.shape[0]) if row % 3 != 1]
            batch = runner.select(batch, keep)
            logits = logits[keep]
        tokens = logits.argmax(dim=-1).tolist() if forced is None else forced[step]
        tokens_per_step.append(tokens)
        logits_per_step.append(logits.float().clone())
        logits = runner.decode(batch, tokens)
    return tokens_per_step, logits_per_step


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_matches_transformers_through_joins_leaves_and_growth(name: str) -> None:
    model = MODELS[name]()
    assert supports(model) is None
    device = torch.device("cpu")
    fused = FusedDecoderRunner(model, device=device, pad_token_id=0)
    reference = TransformersRunner(model, device=device, pad_token_id=0)
    # 150 steps: past the 128 free KV columns a batch starts with, so the cache grows once.
    ours, our_logits = _script(fused, steps=150)
    theirs, their_logits = _script(reference, steps=150)
    for step, (a, b) in enumerate(zip(our_logits, their_logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, step=step: f"step {step}: {m}")
    assert ours == theirs


def test_fused_decoder_in_bfloat16_agrees_with_transformers() -> None:
    """bfloat16 rounds differently in another order of operations, and a tiny random model has
    exact ties among its bfloat16 logits; so both runners follow the same token path, logits must
    agree within bfloat16 precision, and the greedy choice wherever the reference has a clear winner."""
    model = _from_config("Qwen2ForCausalLM", dtype=torch.bfloat16)
    device = torch.device("cpu")
    theirs, their_logits = _script(TransformersRunner(model, device=device, pad_token_id=0), steps=40)
    _, our_logits = _script(FusedDecoderRunner(model, device=device, pad_token_id=0), steps=40, forced=theirs)
    clear = total = 0
    for ours, reference in zip(our_logits, their_logits, strict=True):
        torch.testing.assert_close(ours, reference, rtol=0.02, atol=0.02)
        best, second = reference.topk(2, dim=-1).values.unbind(-1)
        decided = best - second > 0.02
        clear, total = clear + int(decided.sum()), total + decided.numel()
        assert torch.equal(ours.argmax(-1)[decided], reference.argmax(-1)[decided])
    assert clear >= total // 3  # enough choices were clear for the agreement above to mean something


def test_weight_updates_reach_the_fused_weights(tmp_path: Path) -> None:
    """The fused tensors are the parameters' memory: an update through the model's parameters
    (the engine's weight loader) changes what the fused forward computes, and the checksum of the
    live model still equals the new checkpoint's manifest."""
    from miles.weights.checksum import checksum_module

    init_checkpoint(tmp_path / "v1", model_name="m", preset="small", seed=0, step=1)
    init_checkpoint(tmp_path / "v2", model_name="m", preset="small", seed=1, step=2)
    device = torch.device("cpu")
    model = load_model(tmp_path / "v1", device=device)
    runner = FusedDecoderRunner(model, device=device, pad_token_id=0)
    before, _ = _script(runner, steps=8)

    with open_verified(model, tmp_path / "v2") as checkpoint:
        stage = LiveStage(model)  # an in-place copy
        checkpoint.write(stage)
        checksum = stage.checksum()
    assert checksum.checksum == read_manifest(tmp_path / "v2").checksum
    assert checksum_module(model).checksum == read_manifest(tmp_path / "v2").checksum

    after, after_logits = _script(runner, steps=8)
    fresh = TransformersRunner(load_model(tmp_path / "v2", device=device), device=device, pad_token_id=0)
    expected, expected_logits = _script(fresh, steps=8)
    assert after == expected != before
    for a, b in zip(after_logits, expected_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_other_architectures_fall_back_and_forcing_fused_names_the_reason() -> None:
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).eval()
    device = torch.device("cpu")
    assert "GPT2LMHeadModel" in (supports(gpt2) or "")
    assert build_runner(gpt2, device=device, pad_token_id=0).name == "transformers"
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*--forward auto or transformers"):
        build_runner(gpt2, device=device, pad_token_id=0, forward=Forward.FUSED)

    windowed = _from_config("MistralForCausalLM", sliding_window=64)
    assert supports(windowed) == "sliding-window attention"
    assert build_runner(windowed, device=device, pad_token_id=0).name == "transformers"

    llama = build_model("tiny", seed=0)
    assert build_runner(llama, device=device, pad_token_id=0).name == "fused-decoder"
    assert build_runner(llama, device=device, pad_token_id=0, forward=Forward.TRANSFORMERS).name == "transformers"

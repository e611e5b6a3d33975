"""Model presets: seeded, bit-identical builds, and checkpoints that load and generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.errors import CheckpointExistsError, UnknownPresetError
from miles.models import PRESETS, build_model, build_tokenizer, get_preset, init_checkpoint
from miles.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID
from miles.weights.checkpoint import verify_checkpoint
from miles.weights.checksum import checksum_module


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied", "small"])
def test_same_seed_same_weights_other_seed_other_weights(preset: str) -> None:
    assert _same_weights(build_model(preset, seed=3), build_model(preset, seed=3))
    assert not _same_weights(build_model(preset, seed=3), build_model(preset, seed=4))


def test_build_leaves_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    build_model("tiny", seed=11)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_tiny_config_and_token_ids() -> None:
    model = build_model("tiny", seed=0)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)
    assert (config.num_key_value_heads, config.intermediate_size, config.max_position_embeddings) == (2, 128, 512)
    assert config.vocab_size == len(build_tokenizer())
    assert model.dtype == torch.float32 and not config.tie_word_embeddings
    for holder in (config, model.generation_config):
        assert (holder.bos_token_id, holder.eos_token_id, holder.pad_token_id) == (
            BOS_TOKEN_ID,
            EOS_TOKEN_ID,
            PAD_TOKEN_ID,
        )
    assert not model.training


def test_tiny_tied_shares_embedding_and_head() -> None:
    model = build_model("tiny-tied", seed=0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_small_preset_is_qwen2() -> None:
    model = build_model("small", seed=0)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (256, 4)


def test_500m_preset_is_about_500m_bf16_parameters() -> None:
    preset = get_preset("500m")
    assert preset.dtype == torch.bfloat16
    assert preset.architecture == "Qwen2ForCausalLM"
    assert 450e6 <= preset.num_parameters() <= 550e6  # counted on the meta device: no memory


def test_presets_are_read_only_and_unknown_names_are_refused() -> None:
    with pytest.raises(TypeError):
        PRESETS["new"] = PRESETS["tiny"]  # type: ignore[index]
    with pytest.raises(UnknownPresetError, match="tiny"):
        build_model("gigantic", seed=0)


def test_init_checkpoint_loads_with_auto_classes_and_generates(tmp_path: Path) -> None:
    out = tmp_path / "ck"
    manifest = init_checkpoint(out, model_name="demo", preset="tiny", seed=2, step=5)
    assert (manifest.model_name, manifest.step) == ("demo", 5)
    assert verify_checkpoint(out).ok

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert checksum_module(model).checksum == manifest.checksum
    assert _same_weights(model, build_model("tiny", seed=2))
    assert model.generation_config.eos_token_id == EOS_TOKEN_ID

    inputs = tokenizer("The weights are", return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    again = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]
    assert torch.equal(generated, again)  # greedy is deterministic
    text = tokenizer.decode(generated[0], skip_special_tokens=True)
    assert text.startswith("The weights are")


def test_init_checkpoint_tied_loads_with_the_same_checksum(tmp_path: Path) -> None:
    manifest = init_checkpoint(tmp_path / "ck", model_name="tied", preset="tiny-tied")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert checksum_module(loaded).checksum == manifest.checksum


def test_init_checkpoint_respects_overwrite(tmp_path: Path) -> None:
    first = init_checkpoint(tmp_path / "ck", model_name="m", seed=0)
    with pytest.raises(CheckpointExistsError):
        init_checkpoint(tmp_path / "ck", model_name="m", seed=1)
    second = init_checkpoint(tmp_path / "ck", model_name="m", seed=1, overwrite=True)
    assert second.checksum != first.checksum

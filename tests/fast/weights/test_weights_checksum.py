"""Checksums: the same weights give the same checksum from every representation; any change shows."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from miles.errors import CheckpointFileInvalidError, CheckpointFileMissingError, TensorNameError
from miles.models import build_model
from miles.weights.checksum import (
    TensorDigest,
    checksum_module,
    checksum_safetensors,
    checksum_state_dict,
    combine_digests,
    digest_tensor,
)
from miles.weights.digest import CHUNK_BYTES, TensorHasher, chunk_digest


def test_state_dict_module_single_file_and_shards_agree(tiny_model: PreTrainedModel, tmp_path: Path) -> None:
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    tiny_model.save_pretrained(single)
    tiny_model.save_pretrained(sharded, max_shard_size="40KB")
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2

    expected = checksum_state_dict(tiny_model.state_dict())
    assert checksum_module(tiny_model) == expected
    assert checksum_safetensors(single) == expected
    assert checksum_safetensors(single / "model.safetensors") == expected
    assert checksum_safetensors(sharded) == expected
    assert checksum_safetensors(list(reversed(shards))) == expected
    assert len(expected.checksum) == 32
    assert expected.num_bytes == sum(t.numel() * t.element_size() for t in tiny_model.state_dict().values())


def test_tied_model_live_and_saved_agree(tmp_path: Path) -> None:
    model = build_model("tiny-tied", seed=0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)

    live = checksum_module(model)
    saved = checksum_safetensors(tmp_path)
    assert live == saved
    # save_pretrained keeps the embedding and drops the tied head; so do we.
    assert "model.embed_tokens.weight" in live.tensors
    assert "lm_head.weight" not in live.tensors
    # The raw state dict lists both names, so it is a different listing.
    assert checksum_state_dict(model.state_dict()).checksum != live.checksum
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert checksum_module(reloaded) == live


def test_checksum_module_keeps_first_alias_of_untied_sharing() -> None:
    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(4, 4, bias=False)
            self.second = torch.nn.Linear(4, 4, bias=False)
            self.second.weight = self.first.weight

    module = Shared()
    result = checksum_module(module)
    assert list(result.tensors) == ["first.weight"]
    assert result == checksum_state_dict({"first.weight": module.first.weight})


def _base_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "a.weight": torch.randn(8, 6, generator=gen),
        "b.weight": torch.randn(4, 4, generator=gen).to(torch.bfloat16),
        "c.bias": torch.randn(6, generator=gen),
    }


def _flip_lowest_bit(tensor: torch.Tensor, index: int) -> torch.Tensor:
    changed = tensor.clone()
    as_int = changed.view(torch.int16 if tensor.element_size() == 2 else torch.int32).reshape(-1)
    as_int[index] ^= 1
    return changed


def test_every_change_changes_the_checksum() -> None:
    base = _base_state()
    variants: dict[str, dict[str, torch.Tensor]] = {
        "float32 element": {**base, "a.weight": _flip_lowest_bit(base["a.weight"], 5)},
        "bfloat16 element": {**base, "b.weight": _flip_lowest_bit(base["b.weight"], 3)},
        "dtype, same bytes": {**base, "a.weight": base["a.weight"].view(torch.int32)},
        "shape, same bytes": {**base, "a.weight": base["a.weight"].reshape(6, 8)},
        "names swapped": {**base, "a.weight": base["c.bias"], "c.bias": base["a.weight"]},
        "renamed": {"a.weight": base["a.weight"], "b.weight": base["b.weight"], "c.other": base["c.bias"]},
        "tensor dropped": {"a.weight": base["a.weight"], "b.weight": base["b.weight"]},
    }
    checksums = {name: checksum_state_dict(state).checksum for name, state in variants.items()}
    checksums["base"] = checksum_state_dict(base).checksum
    assert len(set(checksums.values())) == len(checksums), checksums


def test_order_of_the_mapping_does_not_matter() -> None:
    base = _base_state()
    assert checksum_state_dict(dict(reversed(base.items()))) == checksum_state_dict(base)


def chunked_xxh3(raw: bytes) -> str:
    """The digest as the module docstring defines it, written out independently of the code."""
    chunks = [raw[i : i + CHUNK_BYTES] for i in range(0, len(raw), CHUNK_BYTES)]
    return xxhash.xxh3_128(b"".join(xxhash.xxh3_128(c).digest() for c in chunks)).hexdigest()


def test_digest_is_xxh3_128_of_the_raw_bytes_chunk_digests_for_any_dtype() -> None:
    cases = {
        "bfloat16": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
        "0-d": torch.tensor(3.0),
        "bool": torch.tensor([True, False, True]),
        "float8": torch.tensor([0.5, 1.0], dtype=torch.float8_e4m3fn),
        "int64": torch.arange(5),
        "empty": torch.empty(0, 3),
        "three chunks, the last short": torch.arange(150_000, dtype=torch.float32),
    }
    for name, tensor in cases.items():
        # Read the bytes straight from memory, independently of the code under test.
        raw = ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        assert digest_tensor(tensor) == chunked_xxh3(raw), name
    assert digest_tensor(torch.empty(0)) == xxhash.xxh3_128(b"").hexdigest()
    result = checksum_state_dict(cases)
    assert result.tensors["0-d"].shape == ()
    assert result.tensors["bool"].dtype == "bool"
    assert result.tensors["bfloat16"].dtype == "bfloat16"


def test_a_digest_is_the_same_whatever_pieces_the_bytes_come_in() -> None:
    """What lets the ranks of a sharded trainer each hash their own rows: any split of the bytes,
    and chunk digests computed elsewhere, give the digest of the whole."""
    c = CHUNK_BYTES
    raw = torch.randint(0, 256, (4 * c + 7,), dtype=torch.uint8).numpy().tobytes()
    whole = chunked_xxh3(raw)
    for cuts in ([1], [c], [c - 1, c + 1], [100, 3 * c - 5], [2 * c, 4 * c]):
        hasher = TensorHasher()
        for start, end in zip([0, *cuts], [*cuts, len(raw)], strict=True):
            hasher.update(raw[start:end])
        assert hasher.hexdigest() == whole, cuts
    hasher = TensorHasher()
    hasher.update_chunks(b"".join(chunk_digest(raw[i : i + c]) for i in range(0, 3 * c, c)))
    hasher.update(raw[3 * c :])
    assert hasher.hexdigest() == whole
    with pytest.raises(ValueError, match="whole chunks"):
        hasher = TensorHasher()
        hasher.update(raw[:10])
        hasher.update_chunks(chunk_digest(raw[10:20]))


def test_zero_dim_and_one_element_share_a_digest_but_not_a_checksum() -> None:
    scalar, vector = torch.tensor(2.0), torch.tensor([2.0])
    assert digest_tensor(scalar) == digest_tensor(vector)
    assert checksum_state_dict({"x": scalar}) != checksum_state_dict({"x": vector})


def test_non_contiguous_and_grad_tensors_hash_their_logical_bytes() -> None:
    matrix = torch.randn(5, 7, generator=torch.Generator().manual_seed(1), requires_grad=True)
    transposed = matrix.t()
    assert not transposed.is_contiguous()
    assert digest_tensor(transposed) == digest_tensor(transposed.detach().contiguous())
    assert digest_tensor(matrix) == digest_tensor(matrix.detach().clone())


def test_threads_do_not_change_the_result() -> None:
    gen = torch.Generator().manual_seed(3)
    # 24 MiB in all: above the size where the pool is used.
    state = {f"layer.{i}.weight": torch.randn(512, 512, generator=gen, dtype=torch.float32) for i in range(24)}
    one = checksum_state_dict(state, threads=1)
    four = checksum_state_dict(state, threads=4)
    assert one == four
    assert checksum_state_dict(state) == one


def test_canonical_listing_is_the_documented_text() -> None:
    digests = [
        TensorDigest(name="z.weight", dtype="bfloat16", shape=(2, 3), digest="0" * 32),
        TensorDigest(name="a.scale", dtype="float32", shape=(), digest="f" * 32),
    ]
    text = f"a.scale\tfloat32\t[]\t{'f' * 32}\nz.weight\tbfloat16\t[2,3]\t{'0' * 32}\n"
    assert combine_digests(digests) == xxhash.xxh3_128(text.encode()).hexdigest()


@pytest.mark.parametrize("name", ["bad\tname", "bad\nname", ""])
def test_unencodable_names_are_refused(name: str) -> None:
    with pytest.raises(TensorNameError):
        checksum_state_dict({name: torch.zeros(1)})


def test_duplicate_tensor_across_files_is_refused(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointFileInvalidError, match="two safetensors files"):
        checksum_safetensors(tmp_path)


def test_directory_without_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFileMissingError):
        checksum_safetensors(tmp_path)


def test_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="threads"):
        checksum_state_dict({"x": torch.zeros(1)}, threads=0)

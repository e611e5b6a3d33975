"""The byte-level tokenizer: exact round trips, fixed special ids, deterministic files, a chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from miles.models.tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    build_tokenizer,
)

TEXTS = [
    "",
    "hello world",
    "digits 0123456789 and 3.14159",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\ttabbed\n\n",
    "non-ASCII: café, naïve, Straße, 日本語, Ελληνικά, 🎉🚀",
    "\x00\x01 control bytes \x7f",
]


@pytest.mark.parametrize("text", TEXTS)
def test_any_text_round_trips_exactly(text: str) -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # one token per byte, id = byte value
    assert tokenizer.decode(ids) == text


def test_special_tokens_have_fixed_ids() -> None:
    tokenizer = build_tokenizer()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
    )
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.decode([BOS_TOKEN_ID, 104, 105, EOS_TOKEN_ID], skip_special_tokens=True) == "hi"


def test_saved_files_are_identical_every_time(tmp_path: Path) -> None:
    build_tokenizer().save_pretrained(tmp_path / "a")
    build_tokenizer().save_pretrained(tmp_path / "b")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "tokenizer.json" in files
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_auto_tokenizer_loads_and_behaves_identically(tmp_path: Path) -> None:
    original = build_tokenizer()
    original.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = original.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids
        assert loaded.decode(ids) == text
    assert loaded.pad_token_id == PAD_TOKEN_ID and loaded.eos_token_id == EOS_TOKEN_ID


def test_chat_template_renders_messages() -> None:
    tokenizer = build_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>\nbe brief<|eos|>\n<|user|>\n2+2?<|eos|>\n<|assistant|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == BOS_TOKEN_ID and ids.count(EOS_TOKEN_ID) == 2

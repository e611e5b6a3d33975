"""A byte-level tokenizer built locally (no downloads): the 256 bytes plus three special tokens.

Every text round-trips exactly (digits, whitespace, newlines, any Unicode), because each byte is
its own token. Ids 0..255 are the byte values; the special tokens follow. The chat template
renders ``<|bos|>`` then, per message, ``<|role|>\\n{content}<|eos|>\\n``, and with
``add_generation_prompt`` a trailing ``<|assistant|>\\n``; the role headers are plain text.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
PAD_TOKEN_ID = 258
VOCAB_SIZE = 259

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map, the alphabet of the ByteLevel
    # pre-tokenizer: printable Latin-1 bytes map to themselves, the rest to code points 256+.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in mapping]
    return mapping | {b: chr(256 + i) for i, b in enumerate(others)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The miles byte-level tokenizer, identical on every call: bos 256, eos 257, pad 258, 259 ids."""
    vocab = {char: byte for byte, char in _byte_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the text maps byte for byte onto ids, nothing added.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer))
    if ids != (BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE):
        # The presets hard-code these ids in model configs; a tokenizers upgrade must not move them.
        raise RuntimeError(f"tokenizer special ids changed: {ids}")
    return tokenizer

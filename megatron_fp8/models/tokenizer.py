"""A small character-level tokenizer built locally with the ``tokenizers`` library.

The tiny test models need a vocabulary that loads in ``transformers.AutoTokenizer``
and in vLLM without downloading anything. This module builds one from scratch:

* ids ``0..3``: special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
  ``<|pad|>``;
* ids ``4..259``: byte-fallback tokens ``<0x00>`` .. ``<0xFF>``, so any UTF-8 text
  encodes (characters outside the base alphabet become their bytes);
* then one token per printable ASCII character (space ``0x20`` .. ``~`` ``0x7E``) plus
  ``"\\n"``;
* then a few whole words (``WORD_TOKENS``) registered as added tokens.

The model is a BPE without merges (so every character is one token) with
``byte_fallback`` and a ``ByteFallback`` + ``Fuse`` decoder, the same layout as
Llama-style sentencepiece tokenizers, which vLLM's incremental detokenizer handles.
The tokenizer has :data:`TOKENIZER_SIZE` entries; model configs pad their
``vocab_size`` above it to a multiple of 128.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
"""Special tokens, in id order starting at 0."""

BASE_CHARACTERS: tuple[str, ...] = tuple(chr(c) for c in range(0x20, 0x7F)) + ("\n",)
"""One token per printable ASCII character plus newline (96 characters)."""

WORD_TOKENS: tuple[str, ...] = ("system", "user", "assistant", "Question", "Answer")
"""Whole words matched before the character split (chat roles and prompt words)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML template (the Qwen convention) so chat APIs work on the tiny models."""


def _base_vocab() -> dict[str, int]:
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in BASE_CHARACTERS:
        vocab[ch] = len(vocab)
    return vocab


TOKENIZER_SIZE: int = len(SPECIAL_TOKENS) + 256 + len(BASE_CHARACTERS) + len(WORD_TOKENS)
"""Number of entries in the tokenizer (special + byte + character + word tokens)."""


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens.

    Returns:
        Mapping ``{"eos": id, "im_start": id, "im_end": id, "pad": id}``.
    """
    return {"eos": 0, "im_start": 1, "im_end": 2, "pad": 3}


def build_char_tokenizer() -> Tokenizer:
    """Build the character-level tokenizer in memory.

    Returns:
        A ``tokenizers.Tokenizer`` with :data:`TOKENIZER_SIZE` entries; building it
        twice gives identical JSON.
    """
    tok = Tokenizer(models.BPE(vocab=_base_vocab(), merges=[], byte_fallback=True, fuse_unk=False))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in WORD_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != TOKENIZER_SIZE:
        raise AssertionError(
            f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} entries, expected {TOKENIZER_SIZE}"
        )
    return tok


def save_tokenizer(path: str | Path, *, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    The files load with ``transformers.AutoTokenizer.from_pretrained(path)`` (as a
    ``PreTrainedTokenizerFast``) and with vLLM.

    Args:
        path: existing folder to write into.
        model_max_length: maximum sequence length in tokens recorded in the config.
    """
    path = Path(path)
    tok = build_char_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in (*SPECIAL_TOKENS, *WORD_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (path / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, sort_keys=True) + "\n")
    logger.debug("wrote character tokenizer (%d entries) to %s", TOKENIZER_SIZE, path)

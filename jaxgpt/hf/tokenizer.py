"""GPT-2's tokenizer as Hugging Face files, built from the vocabulary jaxgpt ships (no download).

tiktoken keeps a byte-level BPE as {token bytes: rank}; Hugging Face keeps the same BPE as a
vocabulary of *strings* and an ordered list of merges. Two translations turn one into the other:

- bytes -> string: GPT-2's byte-to-unicode table gives each of the 256 bytes one printable
  character (printable ASCII and most of Latin-1 stand for themselves; the control bytes, the space
  and the rest are moved to U+0100 onwards, so " the" is "Ġthe"). vocab.json maps each token's
  string to its rank, which is its id; `<|endoftext|>` is 50256.
- merges: the token of rank r >= 256 is merge number r - 256. The pair it merged is found by running
  BPE on the token's own bytes with only the ranks below r: that stops at exactly two tokens, the
  pair (byte-level BPE builds each token from two earlier ones, so the split is unique; `_merges`
  asserts it). merges.txt lists the pairs in rank order.

tokenizer.json is the same BPE in the `tokenizers` library's format, as transformers 5 writes it
for GPT-2: a ByteLevel pre-tokenizer with GPT-2's split regex (tiktoken's r50k pattern is a faster
spelling that splits identically), no prefix space, a ByteLevel decoder, no BOS added, and
`<|endoftext|>` an added special token, so "<|endoftext|>" inside text encodes to 50256 as
`gpt2_encoding().encode(text, allowed_special="all")` does. tokenizer_config.json names
`GPT2Tokenizer` and the bos/eos/unk tokens; vocab.json + merges.txt also serve older transformers
and other tools. tests/test_hf.py checks that `AutoTokenizer.from_pretrained` on these files
encodes and decodes exactly as jaxgpt's tiktoken encoding.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from jaxgpt.tokenizer import EOT_ID, EOT_TEXT, mergeable_ranks

FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@functools.cache
def _byte_to_char() -> tuple[str, ...]:
    """GPT-2's table: byte b -> the printable character that stands for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, moved = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + moved)
            moved += 1
    return tuple(table[b] for b in range(256))


def _text(token: bytes) -> str:
    table = _byte_to_char()
    return "".join(table[b] for b in token)


def _bpe(token: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    """Byte-level BPE of `token` using only merges of rank < `below` (lowest rank merges first)."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        pairs = [(ranks.get(a + b, below), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank >= below:
            break
        parts[i: i + 2] = [parts[i] + parts[i + 1]]
    return parts


@functools.cache
def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    ranks = mergeable_ranks()
    vocab, merges = {}, []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        vocab[_text(token)] = rank
        if len(token) > 1:
            pair = _bpe(token, ranks, rank)
            assert len(pair) == 2, f"token {rank} is not one merge of earlier tokens: {pair}"
            merges.append((_text(pair[0]), _text(pair[1])))
    vocab[EOT_TEXT] = EOT_ID
    return vocab, merges


def _tokenizer_json(vocab: dict[str, int], merges: list[tuple[str, str]]) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": EOT_ID, "content": EOT_TEXT, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {}},
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [list(pair) for pair in merges]},
    }


def write(out_dir: Path, model_max_length: int) -> list[str]:
    """Writes FILES into out_dir (which must exist); returns their names."""
    out_dir = Path(out_dir)
    vocab, merges = _vocab_and_merges()
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    config = {"tokenizer_class": "GPT2Tokenizer", "backend": "tokenizers", **special, "pad_token": None,
              "add_prefix_space": False, "errors": "replace", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False}

    def dump(name: str, obj) -> None:
        (out_dir / name).write_text(json.dumps(obj, ensure_ascii=False, indent=None if name == "tokenizer.json"
                                               else 2) + "\n", encoding="utf-8")

    dump("vocab.json", vocab)
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    dump("tokenizer.json", _tokenizer_json(vocab, merges))
    dump("tokenizer_config.json", config)
    dump("special_tokens_map.json", special)
    return list(FILES)

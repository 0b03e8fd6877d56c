"""A run's tokenizer as Hugging Face files (`write`): GPT-2's built from the vocabulary jaxgpt ships
(no download), a tokenizer.json copied as it is, a tiktoken BPE file converted.

A run trained with a tokenizer.json (Qwen's, one `hf import` brought) exports that file, its
tokenizer_config.json and chat_template.jinja unchanged. A tiktoken BPE file (Llama 3's
tokenizer.model) is converted as transformers' `TikTokenConverter` converts it, with the
`tokenizers` library: byte-level BPE of its ranks (every split of each token into two others is a
merge, in rank order, and `ignore_merges` takes a whole pre-token found in the vocabulary as
tiktoken does), Llama 3's split pattern, its special tokens after the ranks. Both conversions
record the source's identity in tokenizer_config.json (jaxgpt/tokenizer.py `RECORD`), so the
export, imported, is the same tokenizer to jaxgpt. tests/test_tokenizers.py checks AutoTokenizer
on the files against jaxgpt's ids.

GPT-2's files:

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
import hashlib
import json
import shutil
from pathlib import Path

from jaxgpt import tokenizer as tokenizers_
from jaxgpt.tokenizer import EOT_ID, EOT_TEXT, HF_CONFIG, HF_FILE, RECORD, TEMPLATE_FILE, byte_to_char, mergeable_ranks

FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
ALL_FILES = (*FILES, TEMPLATE_FILE)  # what any export may write


def _text(token: bytes) -> str:
    table = byte_to_char()
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


def write(out_dir: Path, model_max_length: int, tok: tokenizers_.Tokenizer | None = None,
          chat_template: str | None = None) -> list[str]:
    """Writes `tok`'s files (default GPT-2's) into out_dir (which must exist); returns their names.
    `chat_template`: the template the run was fine-tuned with, for a tokenizer without its own."""
    out_dir = Path(out_dir)
    if tok is None or tok.name == tokenizers_.TOKENIZER_NAME:
        return _write_gpt2(out_dir, model_max_length, chat_template)
    if tok.kind == "hf":
        names = [HF_FILE]
        shutil.copyfile(tok.path, out_dir / HF_FILE)
        for name in (HF_CONFIG, TEMPLATE_FILE):
            if (tok.path.parent / name).is_file():
                shutil.copyfile(tok.path.parent / name, out_dir / name)
                names.append(name)
        if HF_CONFIG not in names:
            _dump(out_dir, HF_CONFIG, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos,
                                       "eos_token": tok.eos, "model_max_length": model_max_length,
                                       **({"chat_template": chat_template} if chat_template else {})})
            names.append(HF_CONFIG)
        return names
    data = _converted(tok).encode("utf-8")
    (out_dir / HF_FILE).write_bytes(data)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "backend": "tokenizers", "bos_token": tok.bos,
              "eos_token": tok.eos, "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
              **({"chat_template": tok.chat_template or chat_template} if tok.chat_template or chat_template else {}),
              RECORD: {"sha256": tok.sha256, "json_sha256": hashlib.sha256(data).hexdigest()}}
    _dump(out_dir, HF_CONFIG, config)
    return [HF_FILE, HF_CONFIG]


def _dump(out_dir: Path, name: str, obj) -> None:
    (out_dir / name).write_text(json.dumps(obj, ensure_ascii=False, indent=None if name == HF_FILE else 2) + "\n",
                                encoding="utf-8")


def _write_gpt2(out_dir: Path, model_max_length: int, chat_template: str | None) -> list[str]:
    vocab, merges = _vocab_and_merges()
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    _dump(out_dir, "vocab.json", vocab)
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    _dump(out_dir, HF_FILE, _tokenizer_json(vocab, merges))
    written = hashlib.sha256((out_dir / HF_FILE).read_bytes()).hexdigest()
    config = {"tokenizer_class": "GPT2Tokenizer", "backend": "tokenizers", **special, "pad_token": None,
              "add_prefix_space": False, "errors": "replace", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, **({"chat_template": chat_template} if chat_template else {}),
              RECORD: {"sha256": tokenizers_.vocab_sha256(), "json_sha256": written}}
    _dump(out_dir, HF_CONFIG, config)
    _dump(out_dir, "special_tokens_map.json", special)
    return list(FILES)


def _converted(tok: tokenizers_.Tokenizer) -> str:
    """A tiktoken tokenizer (Llama 3's kind) as tokenizer.json text (module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    ranks = tok.ranks
    vocab = {_text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in local]
    merges.sort()
    model = models.BPE(vocab=vocab, merges=[(_text(a), _text(b)) for *_, a, b in merges], fuse_unk=False,
                       ignore_merges=True)
    out = Tokenizer(model)
    out.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tok.enc._pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    out.decoder = decoders.ByteLevel()
    out.post_processor = processors.ByteLevel(trim_offsets=False)
    out.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, _ in sorted(tok.specials.items(), key=lambda item: item[1])])
    return out.to_str()

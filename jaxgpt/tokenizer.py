"""Tokenizers: GPT-2's (packaged, offline), a Hugging Face `tokenizer.json`, or a tiktoken BPE file.

`data.tokenizer` names one: `gpt2` (the default), a `tokenizer.json` (or a directory holding one,
such as a Hugging Face model directory), or a tiktoken BPE file (Llama 3's `tokenizer.model`: one
"base64-token rank" line per token). `load` reads any of them into a `Tokenizer`, or refuses in one
line a file that is none of them.

GPT-2. `tiktoken.get_encoding("gpt2")` would download its vocabulary on first use; a training job
must not depend on the network, so the same `tiktoken.Encoding` is built from
`assets/r50k_base.tiktoken` (r50k_base and gpt2 share ranks, split pattern and `<|endoftext|>`).
`load_tiktoken_bpe` checks the file against its known sha256, so a damaged asset fails loudly.

tokenizer.json is read with Hugging Face's `tokenizers` library, the one transformers itself runs,
so ids are AutoTokenizer's (tests/test_tokenizers.py). Its bos/eos tokens and chat template come
from `tokenizer_config.json` (and `chat_template.jinja`) beside it.

A tiktoken BPE file holds ranks only; as Meta's Llama 3 `Tokenizer` does, jaxgpt reads it with
Llama 3's split pattern and its 256 special tokens after the ranks (`<|begin_of_text|>`,
`<|end_of_text|>`, `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`, reserved ones).

Two encodings. `encode` reads text as text: "<|endoftext|>" inside a document is ordinary
characters (tiktoken's `encode_ordinary`; tokenizers' `encode_special_tokens`), so a corpus cannot
forge a document boundary. `encode_special` parses special tokens, as a chat template's rendered
text needs and as transformers' `apply_chat_template` tokenizes it.

The document separator (`separator_id`) is what `prepare` writes between documents and what
model.document_mask (model.document_token) splits windows at: GPT-2's `<|endoftext|>`; otherwise
the tokenizer's bos token (Llama 3's `<|begin_of_text|>`), else its `<|endoftext|>` (Qwen's), else
its eos token.

Identity. `sha256` identifies a tokenizer in meta.json, in a run dir and in an HF export: the
sha256 of its file (GPT-2: of the packaged vocabulary). An export writes a `tokenizer.json`
converted from GPT-2's or a tiktoken file (jaxgpt/hf/tokenizer.py) and records the source's
identity in `tokenizer_config.json` (`jaxgpt_tokenizer`, with the written file's own sha256, so an
edited file loses it): reading the export back gives the source's identity, and data prepared with
the source still fits an imported run.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import tiktoken
import tiktoken.load

from jaxgpt import files
from jaxgpt.errors import UserError

TOKENIZER_NAME = "gpt2"
EOT_ID = 50256
EOT_TEXT = "<|endoftext|>"  # its text: GPT-2's bos, eos and document separator
N_VOCAB = 50257
HF_FILE, HF_CONFIG, TEMPLATE_FILE = "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"
RECORD = "jaxgpt_tokenizer"  # tokenizer_config.json's key for the identity of an exported tokenizer's source

_VOCAB_PATH = Path(__file__).parent / "assets" / "r50k_base.tiktoken"
_VOCAB_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# Copied from tiktoken_ext/openai_public.py (r50k_pat_str, used by both "gpt2" and "r50k_base").
# The possessive quantifiers are tiktoken's faster spelling of the original GPT-2 pattern; both
# split text identically.
_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# Llama 3's split pattern and special tokens (meta-llama/llama3, llama/tokenizer.py)
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                  r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
                   *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)))


@functools.cache
def mergeable_ranks() -> dict[bytes, int]:
    """Token bytes -> rank (its id) of the packaged vocabulary, checked against its sha256."""
    return tiktoken.load.load_tiktoken_bpe(str(_VOCAB_PATH), expected_hash=_VOCAB_SHA256)


@functools.cache
def gpt2_encoding() -> tiktoken.Encoding:
    """The GPT-2 encoding; `encode_ordinary` treats "<|endoftext|>" in text as plain text."""
    return tiktoken.Encoding(name=TOKENIZER_NAME, pat_str=_PAT_STR, mergeable_ranks=mergeable_ranks(),
                             special_tokens={EOT_TEXT: EOT_ID}, explicit_n_vocab=N_VOCAB)


@functools.cache
def vocab_sha256() -> str:
    """sha256 of the packaged vocabulary file: GPT-2's identity in meta.json."""
    return hashlib.sha256(_VOCAB_PATH.read_bytes()).hexdigest()


@functools.cache
def token_bytes(size: int = N_VOCAB) -> np.ndarray:
    """GPT-2's `Tokenizer.token_bytes` (val bits per byte of a GPT-2 run)."""
    return load(TOKENIZER_NAME).token_bytes(size)


@functools.cache
def byte_to_char() -> tuple[str, ...]:
    """GPT-2's table, which every byte-level BPE (GPT-2, Llama 3, Qwen) shares: byte b -> the
    printable character that stands for it in a Hugging Face vocabulary ("Ġ" for a space)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, moved = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + moved)
            moved += 1
    return tuple(table[b] for b in range(256))


class Tokenizer:
    """One tokenizer, whatever its file: ids, text, its special tokens and its identity."""
    kind: str

    def __init__(self, name: str, sha256: str, n_vocab: int, specials: dict[str, int], bos: str | None,
                 eos: str | None, chat_template: str | None, path: Path | None):
        self.name, self.sha256, self.n_vocab, self.specials = name, sha256, n_vocab, specials
        self.bos, self.eos, self.chat_template, self.path = bos, eos, chat_template, path
        sep = bos if bos in specials else EOT_TEXT if EOT_TEXT in specials else eos if eos in specials else None
        if sep is None:
            raise UserError(f"tokenizer {name} has no bos, <|endoftext|> or eos special token to separate documents "
                            f"with; give one in {HF_CONFIG} beside it (bos_token or eos_token)")
        self.separator, self.separator_id = sep, specials[sep]

    def encode(self, text: str) -> list[int]:
        """Text as text: special tokens' spellings are ordinary characters."""
        raise NotImplementedError

    def encode_special(self, text: str) -> list[int]:
        """Special tokens parsed (a chat template's rendered text)."""
        raise NotImplementedError

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_special`'s ids and the [start, end) characters of `text` each token covers (a
        token holding part of a character covers that character, as tokenizers' offsets say)."""
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def token_bytes(self, size: int) -> np.ndarray:
        """int32 [size]: the UTF-8 bytes each id decodes to; 0 for special tokens (boundaries, not
        text) and ids past the vocabulary (the model's padding). For a byte-level BPE the bytes of
        a token sequence's text are the sum over its tokens, exactly."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.name} ({self.n_vocab:,} tokens)"


class _Tiktoken(Tokenizer):
    kind = "tiktoken"  # GPT-2's (name 'gpt2') or a tiktoken BPE file

    def __init__(self, enc: tiktoken.Encoding, ranks: dict[bytes, int], name: str, sha: str, bos: str | None,
                 eos: str | None, chat_template: str | None, path: Path | None):
        self.enc, self.ranks = enc, ranks
        super().__init__(name, sha, enc.n_vocab, dict(enc._special_tokens), bos, eos, chat_template, path)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_special(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids = self.encode_special(text)
        starts = self.enc.decode_with_offsets(ids)[1]
        ends = [max(b, a + 1) for a, b in zip(starts, [*starts[1:], len(text)])]
        return ids, list(zip(starts, ends))

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])

    def token_bytes(self, size: int) -> np.ndarray:
        table = np.zeros(size, np.int32)
        for token, rank in self.ranks.items():
            if rank < size:
                table[rank] = len(token)
        return table


class _HF(Tokenizer):
    kind = "hf"  # a tokenizer.json

    def __init__(self, path: Path, sha: str, text: str, config: dict, chat_template: str | None):
        from tokenizers import Tokenizer as HFTokenizer  # a few hundred ms: only where a tokenizer.json is read

        self.json_text = text
        try:
            self.special, self.plain = HFTokenizer.from_str(text), HFTokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception subclasses
            raise UserError(f"{path} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0][:200]})") from None
        self.plain.encode_special_tokens = True  # "<|im_end|>" in a document is text
        added = self.special.get_added_tokens_decoder()
        specials = {t.content: i for i, t in added.items() if t.special}
        n_vocab = max(self.special.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        super().__init__(str(path), sha, n_vocab, specials, _token_text(config.get("bos_token")),
                         _token_text(config.get("eos_token")), chat_template, path)

    def encode(self, text: str) -> list[int]:
        return self.plain.encode(text, add_special_tokens=False).ids

    def encode_special(self, text: str) -> list[int]:
        return self.special.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        out = self.special.encode(text, add_special_tokens=False)
        return out.ids, list(out.offsets)

    def decode(self, ids) -> str:
        return self.special.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self, size: int) -> np.ndarray:
        table = np.zeros(size, np.int32)
        specials = set(self.specials.values())
        byte_level = "ByteLevel" in json.dumps(json.loads(self.json_text).get("decoder"))
        to_byte = {c: b for b, c in enumerate(byte_to_char())}
        for token, i in self.special.get_vocab(with_added_tokens=True).items():
            if i >= size or i in specials:
                continue
            if byte_level and all(c in to_byte for c in token):
                table[i] = len(token)  # one character per byte
            else:
                table[i] = len(self.special.decode([i]).encode())
        return table


def _token_text(value) -> str | None:
    """tokenizer_config.json's bos_token / eos_token: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_config(directory: Path) -> tuple[dict, str | None]:
    """(tokenizer_config.json beside a tokenizer, or {}; its chat template: chat_template.jinja, or
    the config's chat_template, a string or the entry named 'default' of a list)."""
    config = {}
    if (directory / HF_CONFIG).is_file():
        config = files.read_json_object(directory / HF_CONFIG, "tokenizer config")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if (directory / TEMPLATE_FILE).is_file():
        template = files.read_text(directory / TEMPLATE_FILE, "chat template")
    return config, template if isinstance(template, str) and template.strip() else None


def resolve(spec: str) -> Path:
    """data.tokenizer's PATH -> the tokenizer file (a directory's tokenizer.json or tokenizer.model)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        for name in (HF_FILE, "tokenizer.model"):
            if (path / name).is_file():
                return path / name
        raise UserError(f"data.tokenizer {path} is a directory without {HF_FILE} or tokenizer.model")
    if not path.is_file():
        raise UserError(f"data.tokenizer {spec!r} is neither 'gpt2' nor a tokenizer file ({files.kind(path)}); give "
                        f"a Hugging Face {HF_FILE}, a directory holding one, or a tiktoken BPE file")
    return path


def load(spec: str) -> Tokenizer:
    """`data.tokenizer` -> its Tokenizer (cached per file and content); UserError for anything else."""
    if spec == TOKENIZER_NAME:
        return _gpt2()
    path = resolve(spec).resolve()
    return _load_file(path, sha256_file(path))


@functools.cache
def _gpt2() -> Tokenizer:
    return _Tiktoken(gpt2_encoding(), mergeable_ranks(), TOKENIZER_NAME, vocab_sha256(), EOT_TEXT, EOT_TEXT,
                     None, None)


@functools.cache
def _load_file(path: Path, sha: str) -> Tokenizer:
    raw = path.read_bytes()
    config, template = _read_config(path.parent)
    head = raw.lstrip()[:1]
    if head == b"{":
        text = raw.decode("utf-8", errors="replace")
        record = config.get(RECORD)
        if isinstance(record, dict) and record.get("json_sha256") == sha and isinstance(record.get("sha256"), str):
            sha = record["sha256"]  # a tokenizer.json jaxgpt converted from this source (module docstring)
            if sha == vocab_sha256():
                return _gpt2()
        return _HF(path, sha, text, config, template)
    if sha == vocab_sha256():
        return _gpt2()
    ranks = _tiktoken_ranks(path, raw)
    n = len(ranks)
    enc = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                            special_tokens={t: n + i for i, t in enumerate(LLAMA3_SPECIALS)})
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    return _Tiktoken(enc, ranks, str(path), sha, bos or LLAMA3_SPECIALS[0], eos or LLAMA3_SPECIALS[1], template,
                     path)


def _tiktoken_ranks(path: Path, raw: bytes) -> dict[bytes, int]:
    """A tiktoken BPE file's {token bytes: rank}, or one UserError saying why it is not one."""
    what = (f"{path} is not a tokenizer: neither a Hugging Face {HF_FILE} (JSON) nor a tiktoken BPE file "
            f"(lines of 'base64-token rank')")
    ranks: dict[bytes, int] = {}
    try:
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error):
        raise UserError(f"{what}; line {number} is not") from None
    if not ranks:
        raise UserError(f"{what}; it is empty")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise UserError(f"{what}; its ranks are not 0..{len(ranks) - 1}, each once")
    if missing := [b for b in range(256) if bytes([b]) not in ranks]:
        raise UserError(f"{path}: a byte-level BPE needs all 256 single bytes, but byte {missing[0]} has no token")
    return ranks


def check_fits_model(tok: Tokenizer, vocab_size: int) -> None:
    """UserError (one line) if `tok` has ids past a model of `vocab_size` tokens (its embedding lookup
    would clamp them silently): not the tokenizer the model was made for."""
    if tok.n_vocab > vocab_size:
        raise UserError(f"the tokenizer {tok.describe()} has ids past this model's vocabulary of {vocab_size} "
                        f"tokens (model.vocab_size): it is not the tokenizer the model was made for"
                        + ("; a Hugging Face model comes with its own: hf import its directory with tokenizer.json "
                           "beside the weights, or set data.tokenizer" if tok.name == TOKENIZER_NAME else ""))


# --- a run's tokenizer ----------------------------------------------------------------------------
# A run trained with another tokenizer than GPT-2's keeps a copy of it in RUN_DIR/tokenizer/, so that
# sample, evaluate and `hf export` use the one it was trained with wherever its file has gone since;
# a run without one (every run before jaxgpt had other tokenizers) is GPT-2's.
RUN_SUBDIR = "tokenizer"


def run_dir_of(path: Path) -> Path:
    """A run dir, or its checkpoints dir -> the run dir."""
    path = Path(path)
    return path.parent if path.name == "checkpoints" else path


def of_run(run_dir: Path, spec: str = TOKENIZER_NAME) -> Tokenizer:
    """The tokenizer a run was trained with: its kept copy, else `spec` (its config's data.tokenizer)."""
    kept = run_dir_of(run_dir) / RUN_SUBDIR
    if kept.is_dir():
        return load(str(kept))
    return load(spec)


def check_run(tok: Tokenizer, run_dir: Path, what: str = "this run dir") -> None:
    """UserError (one line) if the run at `run_dir` (resumed, or started from) was trained with
    another tokenizer than `tok`."""
    run_dir = run_dir_of(run_dir)
    kept = run_dir / RUN_SUBDIR
    has_checkpoints = (run_dir / "checkpoints").is_dir() and any(
        c.name.isdigit() for c in (run_dir / "checkpoints").iterdir())
    if not kept.is_dir() and not has_checkpoints:
        return
    theirs = load(str(kept)) if kept.is_dir() else _gpt2()
    if theirs.sha256 != tok.sha256:
        spec = TOKENIZER_NAME if theirs.name == TOKENIZER_NAME else str(kept)
        raise UserError(f"{what} {run_dir} was trained with another tokenizer ({theirs.describe()}) than "
                        f"data.tokenizer's ({tok.describe()}); set data.tokenizer={spec}")


def keep(run_dir: Path, tok: Tokenizer) -> None:
    """Copies `tok`'s files into RUN_DIR/tokenizer/ (not GPT-2's, which the package holds), once."""
    import shutil
    import tempfile

    dest = Path(run_dir) / RUN_SUBDIR
    if tok.path is None or (dest.is_dir() and load(str(dest)).sha256 == tok.sha256):
        return
    shutil.rmtree(dest, ignore_errors=True)  # another one: what a killed `hf import` left (train refuses it first)

    staging = Path(tempfile.mkdtemp(prefix=f".{RUN_SUBDIR}-", dir=run_dir))
    try:
        shutil.copyfile(tok.path, staging / (HF_FILE if tok.kind == "hf" else "tokenizer.model"))
        for name in (HF_CONFIG, TEMPLATE_FILE):
            if (tok.path.parent / name).is_file():
                shutil.copyfile(tok.path.parent / name, staging / name)
        staging.chmod(0o777 & ~files.umask())
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def for_run(cfg, run_dir: Path) -> Tokenizer:
    """A run's tokenizer (cfg.data.tokenizer), checked before anything compiles: it is a tokenizer,
    document masking splits at its separator (model.document_token), and the run resumed or started
    from (checkpoint.init_from) was trained with it."""
    tok = load(cfg.data.tokenizer)
    m = cfg.model
    if m.document_mask and m.document_token != tok.separator_id:
        raise UserError(f"model.document_token={m.document_token} is not the document separator of data.tokenizer "
                        f"{tok.describe()} ({tok.separator!r} = {tok.separator_id}); set "
                        f"model.document_token={tok.separator_id}")
    check_run(tok, run_dir)
    if cfg.checkpoint.init_from:
        check_run(tok, Path(cfg.checkpoint.init_from), "checkpoint.init_from")
    return tok

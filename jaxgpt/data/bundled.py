"""The bundled tiny shakespeare, and `prepare`: small text files -> the single-file layout.

`prepare` is the in-memory preparation jaxgpt had before `python -m jaxgpt.prepare` streamed
into shards (corpus.py); it stays for the bundled corpus, whose 90/10 split by CHARACTERS keeps
its tokens (and every figure measured on it) unchanged, and as the baseline of
scripts/prepare_bench.py. It reads the text files in the given order and cuts the concatenated
text by characters: the first int(n_chars * (1 - val_fraction)) go to train, the rest to val.
Each split is encoded with `encode_ordinary` one file piece at a time, with one `<|endoftext|>`
(EOT_ID) between consecutive non-empty pieces, so no BPE token straddles two files; a file cut by
the split boundary puts its head in train and its tail in val, with no EOT there. Files are read
as UTF-8 with universal newlines. The splits are written as raw little-endian uint16
(`train.bin`, `val.bin`) plus `meta.json`, into a temporary directory beside `out_dir` that is
then renamed onto it: several processes preparing the same directory at once never see a
half-written one, and whoever renames second keeps the first one's (identical) result.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxgpt import files, tokenizer
from jaxgpt.data.splits import load_meta
from jaxgpt.errors import UserError

_BUNDLED_TEXT = Path(__file__).parent.parent / "assets" / "tinyshakespeare.txt"
# meta.json fields that identify what a prepared directory was made from.
_IDENTITY = ("tokenizer", "tokenizer_sha256", "sources", "sources_sha256", "val_fraction")


def prepare(text_files: Sequence[Path], out_dir: Path, val_fraction: float = 0.1,
            tok: tokenizer.Tokenizer | None = None) -> dict:
    """Tokenizes `text_files` into out_dir/{train,val}.bin + meta.json and returns the meta.
    `tok`: the tokenizer (default GPT-2's; a vocabulary past 2**16 is written as uint32, which
    meta.json's dtype says).

    Idempotent: if out_dir already holds the same preparation it is kept as it is.
    """
    tok = tok or tokenizer.load(tokenizer.TOKENIZER_NAME)
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}.")
    if not text_files:
        raise UserError("No text files given to prepare.")
    paths = [Path(p) for p in text_files]
    texts, raw_bytes = zip(*(_read_text(p) for p in paths))
    if not any(texts):
        raise UserError(f"The text files hold no text: {', '.join(map(str, paths))}.")

    sources_hash = hashlib.sha256()
    for raw in raw_bytes:  # length-prefixed so that moving text between files changes the hash
        sources_hash.update(len(raw).to_bytes(8, "little") + raw)
    meta = {
        "tokenizer": tok.name,
        "tokenizer_sha256": tok.sha256,
        "vocab_size": tok.n_vocab,
        **({} if tok.n_vocab <= 1 << 16 else {"dtype": "uint32"}),
        "train_tokens": 0,
        "val_tokens": 0,
        "sources": [p.name for p in paths],
        "sources_sha256": sources_hash.hexdigest(),
        "val_fraction": val_fraction,
    }
    out_dir = Path(out_dir)
    existing = _existing_meta(out_dir, meta)
    if existing is not None:
        return existing

    train_ids, val_ids = _encode_split(texts, val_fraction, tok)
    for name, ids in zip(("train", "val"), (train_ids, val_ids)):
        if len(ids) == 0:
            raise UserError(f"Too little text: the {name} split would be empty; add text or "
                            f"change val_fraction ({val_fraction}).")
    meta["train_tokens"], meta["val_tokens"] = len(train_ids), len(val_ids)
    _write_atomically(out_dir, {
        "train.bin": train_ids.tobytes(),
        "val.bin": val_ids.tobytes(),
        "meta.json": (json.dumps(meta, indent=2) + "\n").encode(),
    })
    return load_meta(out_dir)


def _read_text(path: Path) -> tuple[str, bytes]:
    raw = files.require_file(path, "Text file").read_bytes()
    try:
        # Same newline handling as open(path).read(): "\r\n" and "\r" become "\n".
        text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise UserError(f"Text file {path} is not valid UTF-8 ({e.reason} at byte {e.start}).")
    return text, raw


def _encode_split(texts: Sequence[str], val_fraction: float, tok: tokenizer.Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    cut = int(sum(map(len, texts)) * (1.0 - val_fraction))
    train_parts, val_parts, start = [], [], 0
    for text in texts:
        k = min(max(cut - start, 0), len(text))
        train_parts.append(text[:k])
        val_parts.append(text[k:])
        start += len(text)
    return _encode_pieces(train_parts, tok), _encode_pieces(val_parts, tok)


def _encode_pieces(pieces: Sequence[str], tok: tokenizer.Tokenizer) -> np.ndarray:
    ids: list[int] = []
    for piece in filter(None, pieces):
        if ids:
            ids.append(tok.separator_id)
        ids.extend(tok.encode(piece))
    return np.asarray(ids, dtype="<u2" if tok.n_vocab <= 1 << 16 else "<u4")  # GPT-2's 50257 < 2**16


def _existing_meta(out_dir: Path, meta: dict) -> dict | None:
    """The meta of an identical earlier preparation, None if out_dir is free, else UserError."""
    files.writable_dir(out_dir, "--out")
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return None
    if (out_dir / "meta.json").is_file():
        existing = load_meta(out_dir)
        if all(existing.get(k) == meta[k] for k in _IDENTITY):
            return existing
    raise UserError(f"{out_dir} already exists and does not hold this preparation; remove it "
                    "or choose another output directory.")


def _write_atomically(out_dir: Path, files: dict[str, bytes]) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the dataset is meant to be shared
        try:
            os.rename(tmp, out_dir)  # atomic; succeeds onto a missing or empty directory only
        except OSError:
            # Another process published first. Its result is identical (deterministic), keep it.
            if not (out_dir / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bundled_shakespeare_dir(tok: tokenizer.Tokenizer | None = None) -> Path:
    """Tiny shakespeare (90/10 split) tokenized by `tok` (default GPT-2's), prepared on first use in
    the jaxgpt cache directory."""
    tok = tok or tokenizer.load(tokenizer.TOKENIZER_NAME)
    cache = files.cache_dir()
    digest = hashlib.sha256(_BUNDLED_TEXT.read_bytes())
    digest.update(tok.sha256.encode())
    out_dir = cache / f"shakespeare-{digest.hexdigest()[:12]}"
    if not (out_dir / "meta.json").is_file():
        prepare([_BUNDLED_TEXT], out_dir, val_fraction=0.1, tok=tok)
    return out_dir

"""Token data: text -> .bin files on disk -> windows -> this process's rows of each global batch.

How a token travels:

1. `prepare` reads the text files in the given order and cuts the concatenated text by
   CHARACTERS: the first int(n_chars * (1 - val_fraction)) go to train, the rest to val. Each
   split is encoded with `encode_ordinary` one file piece at a time, with one `<|endoftext|>`
   (EOT_ID) between consecutive non-empty pieces, so no BPE token straddles two files; a file cut
   by the split boundary puts its head in train and its tail in val, with no EOT there. Files are
   read as UTF-8 with universal newlines. The splits are written as raw little-endian uint16
   (`train.bin`, `val.bin`) plus `meta.json`, into a temporary directory beside `out_dir` that
   is then renamed onto it: several processes preparing the same directory at once never see a
   half-written one, and whoever renames second keeps the first one's (identical) result.
2. `load_split` memory-maps a .bin file read-only; nothing is read until a window is used.
3. Window i is tokens[i*T : i*T + T + 1] (T = seq_len): non-overlapping starts, T+1 tokens so
   inputs/targets are x[:, :-1] / x[:, 1:]. There are (len(tokens) - 1) // T windows.
4. `train_iterator` shuffles the window indices (a lazy permutation, never materialised),
   repeats forever (each epoch gets a fresh permutation from the seed and the epoch number) and
   cuts the endless stream into global batches of G consecutive windows. Global batch s is the
   same whatever the process count P is; process p reads only rows p*G/P : (p+1)*G/P of it.
   This is done by batching into local batches of G/P windows and letting process p take local
   batches p, p+P, p+2P, ...: it never reads another process's windows.
   A batch may hold the last windows of one epoch and the first of the next; every window is
   still seen exactly once per epoch.
5. The iterator is grain's, so `get_state()` / `set_state()` resume it exactly (the state is the
   index of the next local batch, the same on every process).

`eval_batches` is the unshuffled counterpart for evaluation: batch b holds windows
[b*G, (b+1)*G) modulo the number of windows, cut the same way into per-process rows.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import grain
import numpy as np

from jaxgpt import files, tokenizer
from jaxgpt.errors import UserError

SPLITS = ("train", "val")
BUNDLED = "shakespeare"
_PREPARE_HINT = "python -m jaxgpt.prepare FILES --out DIR"
_BUNDLED_TEXT = Path(__file__).parent / "assets" / "tinyshakespeare.txt"
# meta.json fields that identify what a prepared directory was made from.
_IDENTITY = ("tokenizer", "tokenizer_sha256", "sources", "sources_sha256", "val_fraction")
# meta.json fields that loading relies on, and their JSON types.
_META_SHAPE = {"tokenizer_sha256": str, "vocab_size": int, "train_tokens": int, "val_tokens": int}


# ---------------------------------------------------------------- preparing .bin files


def prepare(text_files: Sequence[Path], out_dir: Path, val_fraction: float = 0.1) -> dict:
    """Tokenizes `text_files` into out_dir/{train,val}.bin + meta.json and returns the meta.

    Idempotent: if out_dir already holds the same preparation it is kept as it is.
    """
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
        "tokenizer": tokenizer.TOKENIZER_NAME,
        "tokenizer_sha256": tokenizer.vocab_sha256(),
        "vocab_size": tokenizer.N_VOCAB,
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

    train_ids, val_ids = _encode_split(texts, val_fraction)
    for name, ids in zip(SPLITS, (train_ids, val_ids)):
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


def _encode_split(texts: Sequence[str], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(sum(map(len, texts)) * (1.0 - val_fraction))
    train_parts, val_parts, start = [], [], 0
    for text in texts:
        k = min(max(cut - start, 0), len(text))
        train_parts.append(text[:k])
        val_parts.append(text[k:])
        start += len(text)
    return _encode_pieces(train_parts), _encode_pieces(val_parts)


def _encode_pieces(pieces: Sequence[str]) -> np.ndarray:
    enc = tokenizer.gpt2_encoding()
    ids: list[int] = []
    for piece in filter(None, pieces):
        if ids:
            ids.append(tokenizer.EOT_ID)
        ids.extend(enc.encode_ordinary(piece))
    return np.asarray(ids, dtype="<u2")  # n_vocab 50257 < 2**16


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


def bundled_shakespeare_dir() -> Path:
    """Tiny shakespeare (90/10 split), prepared on first use in the jaxgpt cache directory."""
    if "JAXGPT_CACHE" in os.environ:
        cache = Path(os.environ["JAXGPT_CACHE"])
    elif "XDG_CACHE_HOME" in os.environ:
        cache = Path(os.environ["XDG_CACHE_HOME"]) / "jaxgpt"
    else:
        cache = Path.home() / ".cache" / "jaxgpt"
    digest = hashlib.sha256(_BUNDLED_TEXT.read_bytes())
    digest.update(tokenizer.vocab_sha256().encode())
    out_dir = cache / f"shakespeare-{digest.hexdigest()[:12]}"
    if not (out_dir / "meta.json").is_file():
        prepare([_BUNDLED_TEXT], out_dir, val_fraction=0.1)
    return out_dir


# ---------------------------------------------------------------- loading


def resolve_data_dir(path: str) -> Path:
    """"shakespeare" -> the bundled corpus; otherwise a prepared directory, checked."""
    if path == BUNDLED:
        return bundled_shakespeare_dir()
    data_dir = Path(path).expanduser()
    if not data_dir.is_dir():
        kind = files.kind(data_dir)
        there = "does not exist" if kind == "missing" else f"is {kind}, not a directory"
        raise UserError(f"Data directory {data_dir} {there}; make it with "
                        f"`{_PREPARE_HINT}` or use '{BUNDLED}'.")
    missing = [n for n in ("meta.json", "train.bin", "val.bin") if not (data_dir / n).exists()]
    if missing:
        raise UserError(f"Data directory {data_dir} lacks {', '.join(missing)}; make it with "
                        f"`{_PREPARE_HINT}`.")
    for name in ("meta.json", "train.bin", "val.bin"):
        files.require_file(data_dir / name, "data file")  # not a directory
    load_meta(data_dir)
    return data_dir


def load_meta(data_dir: Path) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        raise UserError(f"{path} is missing; make the directory with `{_PREPARE_HINT}`.")
    try:
        meta = files.read_json_object(path, "data file", required=_META_SHAPE)
    except UserError as e:
        raise UserError(f"{e}; prepare the data again with `{_PREPARE_HINT}`.") from None
    if meta.get("tokenizer_sha256") != tokenizer.vocab_sha256():
        raise UserError(f"{data_dir} was tokenized with another vocabulary than this jaxgpt's "
                        f"GPT-2 one; prepare it again with `{_PREPARE_HINT}`.")
    return meta


def load_split(data_dir: Path, split: str) -> np.ndarray:
    """The split's tokens as a read-only uint16 memmap (nothing is read until indexed)."""
    if split not in SPLITS:
        raise UserError(f"Unknown split {split!r}; expected one of {SPLITS}.")
    load_meta(data_dir)
    path = Path(data_dir) / f"{split}.bin"
    if not path.is_file():
        raise UserError(f"{path} is missing; make the directory with `{_PREPARE_HINT}`.")
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise UserError(f"{path} holds {'no' if size == 0 else 'an odd number of'} bytes; "
                        f"prepare the data again with `{_PREPARE_HINT}`.")
    return np.memmap(path, dtype="<u2", mode="r")


# ---------------------------------------------------------------- windows and batches


class Windows:
    """Grain map source: window i = tokens[i*T : i*T + T + 1] as int32."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise UserError(f"seq_len must be at least 1, got {seq_len}.")
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len
        if self.n <= 0:
            raise UserError(f"{len(tokens)} tokens are too few for one window of seq_len "
                            f"{seq_len} (needs {seq_len + 1}); use more data or a shorter seq_len.")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(f"window {i} out of range [0, {self.n})")
        start = i * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32)


def _local_batch(global_batch: int, process_index: int, process_count: int) -> int:
    if global_batch < 1 or process_count < 1 or global_batch % process_count:
        raise UserError(f"global batch {global_batch} must be a positive multiple of the "
                        f"process count {process_count}.")
    if not 0 <= process_index < process_count:
        raise UserError(f"process_index {process_index} is outside [0, {process_count}).")
    return global_batch // process_count


def train_iterator(tokens: np.ndarray, *, seq_len: int, global_batch: int, seed: int,
                   process_index: int, process_count: int, prefetch: int = 2,
                   num_threads: int = 2) -> grain.DatasetIterator:
    """Endless shuffled [global_batch // process_count, seq_len + 1] int32 batches."""
    local = _local_batch(global_batch, process_index, process_count)
    ds = (grain.MapDataset.source(Windows(tokens, seq_len))
          .shuffle(seed=seed)  # before repeat: epoch e is permuted with (seed, e)
          .repeat(None)
          .batch(local, drop_remainder=True)  # the stream is endless, so every batch is full
          .slice(slice(process_index, None, process_count)))
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return iter(ds.to_iter_dataset(options))


def eval_batches(tokens: np.ndarray, *, seq_len: int, global_batch: int, num_batches: int,
                 process_index: int, process_count: int) -> list[np.ndarray]:
    """Fixed unshuffled batches: global batch b = windows [b*G, (b+1)*G) mod #windows."""
    local = _local_batch(global_batch, process_index, process_count)
    windows = Windows(tokens, seq_len)
    batches = []
    for b in range(num_batches):
        ids = (b * global_batch + process_index * local + np.arange(local)) % len(windows)
        batches.append(np.stack([windows[int(i)] for i in ids]))
    return batches

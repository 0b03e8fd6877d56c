"""Prepared directories -> one token stream per split -> windows -> this process's batch rows.

1. A split is either one file (`train.bin`, the single-file layout `prepare` wrote before shards
   and still writes for the bundled corpus) or the shards meta.json lists. Each file is
   memory-mapped read-only; nothing is read until a window is used. `ShardedTokens` makes the
   shards one sequence: a slice that crosses a shard boundary is stitched from both shards.
2. Window i is tokens[i*T : i*T + T + 1] (T = seq_len): non-overlapping starts, T+1 tokens so
   inputs/targets are x[:, :-1] / x[:, 1:]. There are (len(tokens) - 1) // T windows. Windows
   run over shard boundaries (and over the `<|endoftext|>` between documents) like any token.
3. `train_iterator` shuffles the window indices (a lazy permutation, never materialised),
   repeats forever (each epoch gets a fresh permutation from the seed and the epoch number) and
   cuts the endless stream into global batches of G consecutive windows. Global batch s is the
   same whatever the process count P is; process p reads only rows p*G/P : (p+1)*G/P of it.
   This is done by batching into local batches of G/P windows and letting process p take local
   batches p, p+P, p+2P, ...: it never reads another process's windows.
   A batch may hold the last windows of one epoch and the first of the next; every window is
   still seen exactly once per epoch. (A mixture, see mix.py, changes only the stream of windows.)
4. The iterator is grain's, so `get_state()` / `set_state()` resume it exactly (the state is the
   index of the next local batch, the same on every process).

`eval_batches` is the unshuffled counterpart for evaluation: batch b holds windows
[b*G, (b+1)*G) modulo the number of windows, cut the same way into per-process rows.
"""

from collections.abc import Sequence
from pathlib import Path

import grain
import numpy as np

from jaxgpt import files, tokenizer
from jaxgpt.errors import UserError

SPLITS = ("train", "val")
BUNDLED = "shakespeare"
PREPARE_HINT = "python -m jaxgpt.prepare INPUT... --out DIR"
# meta.json fields that loading relies on, and their JSON types.
_META_SHAPE = {"tokenizer_sha256": str, "vocab_size": int, "train_tokens": int, "val_tokens": int}


def resolve_data_dir(path: str) -> Path:
    """"shakespeare" -> the bundled corpus; otherwise a prepared directory, checked."""
    if path == BUNDLED:
        from jaxgpt.data.bundled import bundled_shakespeare_dir
        return bundled_shakespeare_dir()
    data_dir = Path(path).expanduser()
    if not data_dir.is_dir():
        kind = files.kind(data_dir)
        there = "does not exist" if kind == "missing" else f"is {kind}, not a directory"
        raise UserError(f"Data directory {data_dir} {there}; make it with "
                        f"`{PREPARE_HINT}` or use '{BUNDLED}'.")
    if (data_dir / "meta.json").exists() and "shards" in load_meta(data_dir):
        names = [s["file"] for split in SPLITS for s in load_meta(data_dir)["shards"][split]]
    else:
        names = ["meta.json", "train.bin", "val.bin"]
    missing = [n for n in names if not (data_dir / n).exists()]
    if missing:
        unfinished = " (an unfinished preparation: run the same prepare command to finish it)" \
            if (data_dir / ".prepare-state.json").is_file() else ""
        raise UserError(f"Data directory {data_dir} lacks {', '.join(missing[:3])}"
                        f"{' and more' if len(missing) > 3 else ''}{unfinished}; make it with "
                        f"`{PREPARE_HINT}`.")
    for name in names:
        files.require_file(data_dir / name, "data file")  # not a directory
    load_meta(data_dir)
    return data_dir


def load_meta(data_dir: Path) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        raise UserError(f"{path} is missing; make the directory with `{PREPARE_HINT}`.")
    try:
        meta = files.read_json_object(path, "data file", required=_META_SHAPE)
    except UserError as e:
        raise UserError(f"{e}; prepare the data again with `{PREPARE_HINT}`.") from None
    if meta.get("tokenizer_sha256") != tokenizer.vocab_sha256():
        raise UserError(f"{data_dir} was tokenized with another vocabulary than this jaxgpt's "
                        f"GPT-2 one; prepare it again with `{PREPARE_HINT}`.")
    return meta


def _memmap(path: Path, dtype: np.dtype, tokens: int | None) -> np.ndarray:
    if not path.is_file():
        raise UserError(f"{path} is missing; make the directory with `{PREPARE_HINT}`.")
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize or (tokens is not None and size != tokens * dtype.itemsize):
        raise UserError(f"{path} holds {'no' if size == 0 else f'{size:,}'} bytes, not "
                        f"{'the tokens meta.json lists' if tokens else 'whole tokens'}; prepare the "
                        f"data again with `{PREPARE_HINT}`.")
    return np.memmap(path, dtype=dtype, mode="r")


def load_split(data_dir: Path, split: str) -> "np.ndarray | ShardedTokens":
    """The split's tokens: a read-only memmap, or `ShardedTokens` over several (nothing read yet)."""
    if split not in SPLITS:
        raise UserError(f"Unknown split {split!r}; expected one of {SPLITS}.")
    meta = load_meta(data_dir)
    if "shards" not in meta:  # the single-file layout
        return _memmap(Path(data_dir) / f"{split}.bin", np.dtype("<u2"), None)
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    parts = [_memmap(Path(data_dir) / s["file"], dtype, s["tokens"]) for s in meta["shards"][split]]
    if not parts:
        raise UserError(f"{data_dir} holds no {split} tokens; prepare it again with more documents "
                        "or another --val-fraction.")
    return parts[0] if len(parts) == 1 else ShardedTokens(parts)


class ShardedTokens:
    """Several token arrays read as one: len() and slices [a:b] that may cross arrays."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("ShardedTokens supports contiguous slices only")
            if stop <= start:
                return np.empty(0, self.dtype)
            first = int(np.searchsorted(self.starts, start, side="right")) - 1
            out, pos = [], start
            for k in range(first, len(self.parts)):
                if pos >= stop:
                    break
                lo = pos - int(self.starts[k])
                take = min(stop, int(self.starts[k + 1])) - pos
                out.append(self.parts[k][lo:lo + take])
                pos += take
            return out[0] if len(out) == 1 else np.concatenate(out)
        i = int(index) + (len(self) if int(index) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"token {index} out of range [0, {len(self)})")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k][i - int(self.starts[k])]


class Windows:
    """Grain map source: window i = tokens[i*T : i*T + T + 1] as int32."""

    def __init__(self, tokens, seq_len: int):
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


def train_iterator(tokens, *, seq_len: int, global_batch: int, seed: int, process_index: int,
                   process_count: int, prefetch: int = 2, num_threads: int = 2) -> grain.DatasetIterator:
    """Endless shuffled [global_batch // process_count, seq_len + 1] int32 batches.

    `tokens` is one split's tokens, or a `mix.Mixture` of several.
    """
    from jaxgpt.data.mix import Mixture
    local = _local_batch(global_batch, process_index, process_count)
    if isinstance(tokens, Mixture):
        ds = tokens.train_windows(seq_len, seed)
    else:
        ds = (grain.MapDataset.source(Windows(tokens, seq_len))
              .shuffle(seed=seed)  # before repeat: epoch e is permuted with (seed, e)
              .repeat(None))
    ds = (ds.batch(local, drop_remainder=True)  # the stream is endless, so every batch is full
          .slice(slice(process_index, None, process_count)))
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return iter(ds.to_iter_dataset(options))


def eval_batches(tokens, *, seq_len: int, global_batch: int, num_batches: int,
                 process_index: int, process_count: int) -> Sequence[np.ndarray]:
    """Fixed unshuffled batches: global batch b = windows [b*G, (b+1)*G) mod #windows. Each batch is
    read when it is asked for (every evaluation), not all at the start: a run's memory check comes
    after this, and a batch too big for the host must fail there, not hang here."""
    from jaxgpt.data.mix import Mixture
    local = _local_batch(global_batch, process_index, process_count)
    windows = tokens.eval_windows(seq_len) if isinstance(tokens, Mixture) else Windows(tokens, seq_len)
    return _EvalBatches(windows, global_batch, local, process_index, num_batches)


class _EvalBatches(Sequence):
    def __init__(self, windows, global_batch: int, local: int, process_index: int, num_batches: int):
        self.windows, self.global_batch, self.local = windows, global_batch, local
        self.process_index, self.num_batches = process_index, num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, b: int) -> np.ndarray:
        if not 0 <= b < self.num_batches:
            raise IndexError(b)
        ids = (b * self.global_batch + self.process_index * self.local + np.arange(self.local)) % len(self.windows)
        return np.stack([self.windows[int(i)] for i in ids])

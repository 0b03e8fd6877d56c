"""A prepared directory's meta.json, checked, and each split's token files as one read-only sequence.

A split is either one file (`train.bin`, the single-file layout `prepare` wrote before shards and
still writes for the bundled corpus, bundled.py) or the shards meta.json lists. Each file is
memory-mapped read-only; nothing is read until a window is used. `ShardedTokens` makes the shards
one sequence: a slice that crosses a shard boundary is stitched from both shards.
"""

from pathlib import Path

import numpy as np

from jaxgpt import files
from jaxgpt.errors import UserError

SPLITS = ("train", "val")
PREPARE_HINT = "python -m jaxgpt.prepare INPUT... --out DIR"
# meta.json fields that loading relies on, and their JSON types.
_META_SHAPE = {"tokenizer_sha256": str, "vocab_size": int, "train_tokens": int, "val_tokens": int}


def load_meta(data_dir: Path) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        raise UserError(f"{path} is missing; make the directory with `{PREPARE_HINT}`.")
    try:
        meta = files.read_json_object(path, "data file", required=_META_SHAPE)
    except UserError as e:
        raise UserError(f"{e}; prepare the data again with `{PREPARE_HINT}`.") from None
    return meta  # its tokenizer is checked against the run's where a run opens it (sources.py)


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
    if "shards" not in meta:  # the single-file layout: uint16 unless meta.json says otherwise (bundled.py)
        return _memmap(Path(data_dir) / f"{split}.bin", np.dtype(meta.get("dtype", "uint16")).newbyteorder("<"), None)
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

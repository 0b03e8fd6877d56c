"""Checking prepared token files against meta.json before they are trained on (or called done).

meta.json records each shard's token count and sha256. `check_dir` reads every token file of a
prepared directory once, streamed in 16 MiB blocks (memory stays flat whatever the shard size),
several files at a time in threads (hashlib and NumPy release the GIL), and checks

    size      bytes == tokens * itemsize (the loader checks this too, without reading)
    sha256    the file's hash == meta.json's: bytes overwritten in place, same size, are caught
    token ids every id < meta.json's vocab_size: a file written by something else, or the
              single-file layout (train.bin, val.bin), which records no hashes

Each failure is one UserError naming the file. SHA-256 runs at about 1.5 GB/s a core where the CPU
has SHA extensions (docs/benchmarks.md has the measured time for a 1 GB directory), so a large
corpus costs seconds to a minute at start-up. `remember` writes the verdicts with each file's size,
mtime and inode to RUN_DIR/data-verified.json; `check_dir(cache=...)` skips the files it vouches
for, so a resumed run reads only files that changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxgpt.errors import UserError

_BLOCK = 16 << 20
_VERIFIED: dict[str, list] = {}  # this process's verdicts: resolved path -> [size, mtime, inode, sha, vocab]
PREPARE_HINT = "python -m jaxgpt.prepare INPUT... --out DIR"


def token_files(data_dir: Path, meta: dict) -> list[tuple[Path, int | None, str | None]]:
    """(path, tokens or None, sha256 or None) of every token file the directory's meta.json names."""
    data_dir = Path(data_dir)
    if "shards" not in meta:  # the single-file layout: no counts or hashes recorded
        return [(data_dir / f"{split}.bin", None, None) for split in ("train", "val")]
    return [(data_dir / s["file"], s.get("tokens"), s.get("sha256"))
            for split in ("train", "val") for s in meta["shards"][split]]


def _scan(path: Path, dtype: np.dtype, vocab: int) -> tuple[str, int, int]:
    """(sha256, largest token id, its position) of one file, read in blocks."""
    digest, top, where, done = hashlib.sha256(), -1, -1, 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            ids = np.frombuffer(block, dtype=dtype, count=len(block) // dtype.itemsize)
            if len(ids) and (m := int(ids.max())) > top:  # max is ~20x faster than argmax
                top = m
                if m >= vocab:  # where it is, only when it will be reported
                    where = done + int(np.flatnonzero(ids == m)[0])
            done += len(ids)
    return digest.hexdigest(), top, where


def _stamp(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def check_dir(data_dir: Path, meta: dict, *, cache: Path | None = None, threads: int | None = None,
              fix_hint: str | None = None) -> int:
    """Checks every token file of a prepared directory (see the module docstring); returns the
    number of bytes read (0 when the cache vouched for every file)."""
    data_dir = Path(data_dir)
    dtype = np.dtype(meta.get("dtype", "uint16")).newbyteorder("<")
    vocab = int(meta["vocab_size"])
    hint = fix_hint or f"prepare the data again with `{PREPARE_HINT}`"
    known = _read_cache(cache)
    todo = []
    for path, tokens, sha in token_files(data_dir, meta):
        if not path.is_file():
            raise UserError(f"{path} is missing; {hint}.")
        size = path.stat().st_size
        if tokens is not None and size != tokens * dtype.itemsize:
            raise UserError(f"{path} holds {size:,} bytes, not the {tokens:,} tokens ({tokens * dtype.itemsize:,} "
                            f"bytes) meta.json lists; {hint}.")
        key = str(path.resolve())
        if known.get(key) == [*_stamp(path), sha, vocab]:
            continue
        todo.append((path, sha, key))
    if not todo:
        return 0
    workers = threads or min(len(todo), os.cpu_count() or 1, 16)
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda t: _scan(t[0], dtype, vocab), todo))
    for (path, sha, key), (got, top, where) in zip(todo, results):
        if sha is not None and got != sha:
            ids = (f" and holds token id {top}, outside the vocabulary of {vocab:,} ids" if top >= vocab else "")
            raise UserError(f"{path} does not match meta.json: its sha256 is {got[:16]}..., not "
                            f"{sha[:16]}...{ids} (changed or damaged after it was prepared); {hint}.")
        if top >= vocab:
            raise UserError(f"{path} holds token id {top} at token {where:,}, outside the vocabulary of "
                            f"{vocab:,} ids (not written by jaxgpt.prepare, or damaged); {hint}.")
        _VERIFIED[key] = [*_stamp(path), sha, vocab]
    return sum(p.stat().st_size for p, _, _ in todo)


def remember(cache: Path) -> None:
    """Adds this process's verdicts to `cache` (train.py calls it once the run dir is set up, so a
    run refused later for another reason leaves no file behind)."""
    if _VERIFIED:
        _write_cache(cache, {**_read_cache(cache), **_VERIFIED})


def _read_cache(cache: Path | None) -> dict:
    if cache is None or not cache.is_file():
        return {}
    try:
        obj = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}  # a cache is only ever a shortcut: unreadable means check again
    return obj if isinstance(obj, dict) else {}


def _write_cache(cache: Path, known: dict) -> None:
    try:
        tmp = cache.with_name(f".{cache.name}.tmp")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        os.replace(tmp, cache)
    except OSError:
        pass  # not being able to remember a verdict costs a re-check next time, nothing more

"""Token shards on disk, the resume state, and the manifest (meta.json) written last.

Layout of a prepared directory:

    train-00000.bin, train-00001.bin, ...  raw little-endian token ids, `shard_tokens` each
    val-00000.bin, ...                     (the last shard of a split is shorter); uint16 while the
                                           vocabulary fits in 16 bits, uint32 otherwise
    meta.json                              the manifest: shards with token counts and sha256,
                                           token and document counts, tokenizer and source hashes

While a preparation runs, the shard being filled is `SPLIT-NNNNN.bin.partial` and
`.prepare-state.json` records, after every batch of input, how far the input was read and how
many tokens each split's partial shard holds. The order of writes makes any kill resumable:

1. tokens are appended to the partial shard, flushed and fsync'ed;
2. a full shard is renamed to its final name (a final name only ever holds a complete shard);
3. the state is replaced atomically (write a temporary file, fsync, rename).

A kill between 1 and 3 leaves more bytes on disk than the state records; resuming truncates
them (a shard finished in step 2 but not yet recorded is renamed back to partial first) and reads
the input again from the recorded position, so the result is byte-identical to an uninterrupted
run. meta.json is written last, after every shard is final: a directory without it is unfinished
and the loader refuses it.
"""

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from jaxgpt.errors import UserError

STATE = ".prepare-state.json"
META = "meta.json"
# What a preparation writes before its first state: shards (partial or, for a tiny shard size,
# finished), the state's or meta.json's temporary file, and the lock (jaxgpt/lock.py). A directory
# holding only these is free.
_LEFTOVER = re.compile(r"(train|val)-\d{5}\.bin(\.partial)?|\.(\.prepare-state|meta)\.json\.tmp|\.jaxgpt\.lock")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def write_json_atomically(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SplitWriter:
    """Appends one split's tokens to fixed-size shards; `state()` is what resuming needs."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: np.dtype,
                 state: dict | None = None):
        self.out_dir, self.split, self.shard_tokens, self.dtype = out_dir, split, shard_tokens, dtype
        self.shards: list[dict] = list(state["shards"]) if state else []
        partial_tokens = state["partial_tokens"] if state else 0
        self.total = sum(s["tokens"] for s in self.shards) + partial_tokens
        self._open_partial(partial_tokens)

    @property
    def _partial(self) -> Path:
        return self.out_dir / (shard_name(self.split, len(self.shards)) + ".partial")

    def _open_partial(self, keep_tokens: int) -> None:
        """Opens the current partial shard holding exactly its first `keep_tokens` recorded tokens."""
        final = self.out_dir / shard_name(self.split, len(self.shards))
        if final.exists():  # finished after the last recorded state: not recorded, so partial again
            os.replace(final, self._partial)
        keep = keep_tokens * self.dtype.itemsize
        if keep and (not self._partial.exists() or self._partial.stat().st_size < keep):
            raise UserError(f"{self._partial} is missing or shorter than its recorded state; the "
                            f"preparation in {self.out_dir} cannot be resumed: remove the directory "
                            "and prepare again.")
        self._file = open(self._partial, "r+b" if keep else "wb")
        self._file.truncate(keep)
        self._hash = hashlib.sha256()
        while self._file.tell() < keep:  # the hash of a resumed shard covers its head too
            self._hash.update(self._file.read(min(1 << 24, keep - self._file.tell())))
        self._file.seek(keep)
        self._in_shard = keep_tokens
        # Shards past the current one can only be left over from a batch that was not recorded.
        index = len(self.shards) + 1
        while True:
            stale = [self.out_dir / (shard_name(self.split, index) + s) for s in ("", ".partial")]
            if not any(p.exists() for p in stale):
                break
            for p in stale:
                p.unlink(missing_ok=True)
            index += 1

    def append(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=self.dtype)
        while len(tokens):
            room = self.shard_tokens - self._in_shard
            head, tokens = tokens[:room], tokens[room:]
            data = head.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._in_shard += len(head)
            self.total += len(head)
            if self._in_shard == self.shard_tokens:
                self._close_shard()
                self._open_partial(0)

    def _close_shard(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = shard_name(self.split, len(self.shards))
        os.replace(self._partial, self.out_dir / name)
        self.shards.append({"file": name, "tokens": self._in_shard, "sha256": self._hash.hexdigest()})

    def state(self) -> dict:
        """Flushes to disk, then describes what is on disk."""
        self._file.flush()
        os.fsync(self._file.fileno())
        return {"shards": list(self.shards), "partial_tokens": self._in_shard}

    def finish(self) -> list[dict]:
        """Makes the last, shorter shard final; returns every shard's entry for meta.json."""
        if self._in_shard:
            self._close_shard()
        else:
            self._file.close()
            self._partial.unlink()
        return self.shards

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_state(out_dir: Path, fingerprint: str) -> dict | None:
    """The resume state of an unfinished identical preparation, None if out_dir is free, else UserError.

    Free is missing, empty, or holding only the files of a run killed before its first state (the
    shards it started are truncated or removed when writing begins).

    A finished identical preparation returns its meta.json with "finished": True.
    """
    if not out_dir.exists() or (out_dir.is_dir() and all(_LEFTOVER.fullmatch(p.name) for p in out_dir.iterdir())):
        return None  # empty, or what a run killed before recording its first batch left: start over
    for name in (META, STATE):
        path = out_dir / name
        if path.is_file():
            try:
                obj = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                obj = {}
            if obj.get("fingerprint") == fingerprint:
                return {**obj, "finished": name == META}
            break
    raise UserError(f"{out_dir} already exists and holds another preparation (other inputs or "
                    "options, or another jaxgpt version's) or other files; remove it or choose another output "
                    "directory.")

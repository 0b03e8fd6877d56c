"""`prepare_corpus`: input files -> sharded tokens, streamed in bounded memory on every core.

The pipeline, and why its output never depends on the number of workers:

1. The inputs are hashed (sha256, in threads) before anything else: the hashes identify the
   sources in meta.json and, with the options, form the preparation's *fingerprint*, which
   decides whether an existing output directory is this preparation (finished: nothing to do;
   unfinished: resume) or another one (refused).
2. readers.py turns the files into a stream of pieces (a document, or a safe slice of a long
   one). The main process cuts the stream into batches of about `batch_chars` characters; batch
   boundaries depend only on the input, never on the workers.
3. Each batch is split into tasks of about a MiB of text, encoded by a pool of worker processes
   (`encode_ordinary`, then uint16/uint32 bytes: cheap to send back, unlike lists of ints) and
   collected in task order. While the workers encode batch b, the main process reads batch
   b + 1; at most `_IN_FLIGHT` batches exist at once, so memory does not grow with the corpus.
4. Documents are assigned to val in order: document i (counting non-empty documents from 0)
   goes to val when floor((i + 1) * f) > floor(i * f) for f = val_fraction, i.e. every 1/f-th
   document, so the split is exact, streamable and never cuts a document. One `<|endoftext|>`
   goes between consecutive documents of a split. The exception is a single text file without
   --separator (a nanoGPT-style corpus: one document): its first int(n_chars * (1 - f))
   characters are train and the rest val, nanoGPT's split, and the bundled shakespeare's
   (bundled.py), token for token.
5. writer.py appends each split's tokens to fixed-size shards and records a resume state after
   every batch; meta.json is written last.

Because every step is a deterministic function of the input stream, any worker count, and any
number of interruptions, gives the same bytes. Measured throughput: docs/benchmarks.md.
"""

import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from multiprocessing import resource_tracker
from pathlib import Path

import numpy as np

from jaxgpt import tokenizer
from jaxgpt.data import readers
from jaxgpt.data.integrity import check_dir
from jaxgpt.data.writer import META, STATE, SplitWriter, read_state, write_json_atomically
from jaxgpt.errors import UserError
from jaxgpt.files import writable_dir
from jaxgpt.lock import DirLock

FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16, as nanoGPT's FineWeb shards
_TASK_CHARS = 1 << 20
_IN_FLIGHT = 2


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def token_dtype(n_vocab: int = tokenizer.N_VOCAB) -> np.dtype:
    return np.dtype("<u2") if n_vocab <= 1 << 16 else np.dtype("<u4")


_TOKENIZER = [tokenizer.TOKENIZER_NAME]  # a worker's data.tokenizer (--tokenizer), set by _worker_init


def encode_task(texts: list[str]) -> tuple[bytes, list[int], int]:
    """Worker: the pieces' tokens (concatenated bytes), each piece's token count, UTF-8 bytes in.

    Special tokens' spellings are text (`Tokenizer.encode`). For GPT-2's, `encode_to_numpy` with no
    special token allowed or disallowed is `encode_ordinary` without building a Python list of ints.
    """
    tok = tokenizer.load(_TOKENIZER[0])
    dtype = token_dtype(tok.n_vocab)
    if tok.name == tokenizer.TOKENIZER_NAME:
        enc = tokenizer.gpt2_encoding()
        ids = [enc.encode_to_numpy(t, allowed_special=set(), disallowed_special=()) for t in texts]
    else:
        ids = [np.asarray(tok.encode(t), dtype) for t in texts]
    flat = np.concatenate(ids).astype(dtype) if ids else np.empty(0, dtype)
    return flat.tobytes(), [len(p) for p in ids], sum(len(t.encode("utf-8")) for t in texts)


def _hash_file(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as e:
        raise UserError(f"Cannot read {path}: {e.strerror}.") from None
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": digest}


def prepare_corpus(inputs: Sequence[str | Path], out_dir: Path, *, text_field: str = "text",
                   separator: str | None = None, val_fraction: float = 0.1,
                   shard_tokens: int = DEFAULT_SHARD_TOKENS, workers: int | None = None,
                   skip_bad_lines: bool = False, progress: str = "auto",
                   batch_chars: int = 8 << 20, tokenizer_spec: str = tokenizer.TOKENIZER_NAME) -> dict:
    """Prepares (or resumes, or finds already prepared) `out_dir` with the tokenizer `tokenizer_spec`
    (data.tokenizer's forms: gpt2, a tokenizer.json, a tiktoken BPE file); returns its meta.json."""
    tok = tokenizer.load(tokenizer_spec)  # not a tokenizer: one line, before anything is read
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val-fraction must lie strictly between 0 and 1, got {val_fraction}.")
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens must be positive, got {shard_tokens}.")
    workers = workers or default_workers()
    if workers < 1:
        raise UserError(f"--workers must be positive, got {workers}.")
    if workers > (most := max(256, 2 * default_workers())):  # each is a process: 100,000 hung the machine
        raise UserError(f"--workers must be at most {most} (this machine has {default_workers()} cores), got {workers}.")
    started = time.time()
    out_dir = writable_dir(Path(out_dir), "--out")  # before any output: a file there is one error line
    files = readers.find_inputs(inputs, exclude=out_dir)  # never the output of an earlier run
    # One preparation per directory (jaxgpt/lock.py): a second one would append to the same shards.
    with _ctrl_c_remembered() as ctrl_c, DirLock(
            out_dir, "--out", "wait for it to end, then run the same command again (it resumes, or finds "
            "the preparation done)"):
        return _prepare(files, out_dir, text_field, separator, val_fraction, shard_tokens, workers,
                        skip_bad_lines, progress, batch_chars, started, ctrl_c, tok)


def _prepare(files: list[Path], out_dir: Path, text_field: str, separator: str | None, val_fraction: float,
             shard_tokens: int, workers: int, skip_bad_lines: bool, progress: str, batch_chars: int,
             started: float, ctrl_c: "_CtrlC", tok: tokenizer.Tokenizer) -> dict:
    """`prepare_corpus` once its arguments are checked and out_dir is this process's."""
    # One text file is one document: its val split is its last val_fraction of characters (README).
    tail = len(files) == 1 and readers.kind(files[0]) == "text" and separator is None
    reader = readers.Reader(files, text_field=text_field, separator=separator,
                            skip_bad_lines=skip_bad_lines, val_tail=val_fraction if tail else None)
    show = Progress(progress, [p.stat().st_size for p in files])
    show.note(f"hashing {len(files)} input file{'s' * (len(files) > 1)}")
    with ThreadPoolExecutor(workers) as pool:
        sources = list(pool.map(_hash_file, files))
    ctrl_c.check()
    dtype = token_dtype(tok.n_vocab)
    identity = {"format_version": FORMAT_VERSION, "tokenizer_sha256": tok.sha256,
                "text_field": text_field, "separator": separator, "val_fraction": val_fraction,
                "shard_tokens": shard_tokens, "dtype": dtype.name, "piece_chars": readers.MAX_PIECE_CHARS,
                "cuts": readers.CUT_RULE,  # where pieces end: a resume counts pieces
                "sources": [(s["bytes"], s["sha256"]) for s in sources],
                **({"val_split": "tail"} if tail else {})}
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    state = read_state(out_dir, fingerprint)
    if state and state["finished"]:
        show.close()
        meta = {k: v for k, v in state.items() if k != "finished"}
        check_dir(out_dir, meta, fix_hint=f"remove {out_dir} and run this command again")
        (out_dir / STATE).unlink(missing_ok=True)  # a kill between meta.json and this unlink
        print(f"{out_dir} already holds this preparation; nothing to do", flush=True)
        return meta
    fresh = state is None  # out_dir is missing, empty, or holds only a killed first batch's files
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        run = _Run(out_dir, reader, dtype, shard_tokens, Fraction(val_fraction).limit_denominator(10**6),
                   state, fingerprint, tail, tok)
    except OSError as e:
        raise UserError(f"Cannot write to --out {out_dir}: {e.strerror}.") from None
    if state:
        show.note(f"resuming at input file {state['cursor'][0] + 1} of {len(files)}, "
                  f"{run.tokens():,} tokens already written")
    show.start(run)
    bytes_before = run.text_bytes  # a resumed run's rate counts only this session's text
    try:
        spec = tok.name if tok.path is None else str(tok.path)
        with _spawn_pool(workers, spec) as pool:
            in_flight: deque = deque()
            for batch, cursor, bad_lines in run.batches(batch_chars):
                tasks = _tasks([text for text, _ in batch])
                in_flight.append((batch, cursor, bad_lines, pool.map_async(encode_task, tasks, chunksize=1)))
                if len(in_flight) > _IN_FLIGHT:
                    run.commit(*in_flight.popleft())
                    show.update(run.cursor, reader.file_bytes_read)
                    ctrl_c.check()
            while in_flight:
                run.commit(*in_flight.popleft())
                show.update(run.cursor, reader.file_bytes_read)
                ctrl_c.check()
        ctrl_c.check()
        meta = run.finish(sources, skip_bad_lines, text_field, separator, val_fraction,
                          shard_tokens, identity)
    except OSError as e:  # reading errors are UserErrors already: this is the output (full, read-only)
        run.close()
        show.close(failed=True)
        raise UserError(f"Cannot write to {e.filename or out_dir}: {e.strerror}; fix that and run the "
                        "same command again to resume.") from None
    except UserError as e:
        run.close()
        show.close(failed=True)
        # Bad input before anything was committed, or a split left empty (nothing to resume: the
        # same input empties it again): leave no directory that a corrected run would refuse.
        if fresh and (not (out_dir / STATE).exists() or isinstance(e, EmptySplit)):
            shutil.rmtree(out_dir)
        raise
    finally:
        run.close()
        show.close()
    took = time.time() - started
    n_tokens, n_docs = meta["train_tokens"] + meta["val_tokens"], meta["train_documents"] + meta["val_documents"]
    print(f"prepared {out_dir}: {n_tokens:,} tokens ({meta['train_tokens']:,} train, "
          f"{meta['val_tokens']:,} val) from {n_docs:,} documents in {len(meta['shards']['train'])} + "
          f"{len(meta['shards']['val'])} shards; {n_tokens / max(meta['text_bytes'], 1):.3f} tokens "
          f"per byte; {took:.1f} s ({(meta['text_bytes'] - bytes_before) / 1e6 / max(took, 1e-9):.1f} MB/s"
          f"{', resumed' if bytes_before else ''})"
          + (f"; skipped {meta['bad_lines_skipped']:,} bad lines" if meta["bad_lines_skipped"] else ""),
          flush=True)
    return meta


class EmptySplit(UserError):
    """The input fills only one split: there is nothing to resume."""


def _worker_init(tokenizer_spec: str = tokenizer.TOKENIZER_NAME) -> None:
    """Workers leave Ctrl-C to the main process, which stops them and prints one line. (They start
    with SIGINT blocked, _spawn_pool; ignoring it also discards one pending since.) They encode
    with `tokenizer_spec`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _TOKENIZER[0] = tokenizer_spec


class _CtrlC:
    """Ctrl-C raises KeyboardInterrupt as usual, and is also remembered: Python drops an exception
    raised while it runs a __del__ method or a weakref callback (multiprocessing's pipes and pool
    finalizers have them, and garbage collection runs them at any moment), printing "Exception
    ignored" and going on. So a remembered Ctrl-C is raised again by `check()` after hashing, after
    each batch and before meta.json, and on leaving (its "Exception ignored" report is dropped): a
    preparation interrupted anywhere ends as interrupted, one line and exit 130, never as finished.
    It is in place from taking the --out lock to the end (prepare_corpus)."""

    def __init__(self):
        self.pressed = False

    def check(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt


@contextlib.contextmanager
def _sigint(handler):
    """SIGINT handled by `handler` within. Outside the main thread, which alone may change signal
    handlers, as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _ctrl_c_remembered():
    ctrl_c = _CtrlC()

    def on_ctrl_c(signum, frame):
        ctrl_c.pressed = True
        raise KeyboardInterrupt

    def unraisable(report):
        if not (ctrl_c.pressed and report.exc_type is KeyboardInterrupt):
            previous_hook(report)

    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        with _sigint(on_ctrl_c):
            yield ctrl_c
    finally:
        sys.unraisablehook = previous_hook
    ctrl_c.check()


@contextlib.contextmanager
def _spawn_pool(workers: int, tokenizer_spec: str = tokenizer.TOKENIZER_NAME):
    """The encoding workers, deaf to Ctrl-C from their first instruction, and a Ctrl-C that lands
    while they are spawned deferred, never dropped.

    A worker must not see Ctrl-C before _worker_init ignores it: one still importing numpy would
    print its own traceback above the one line. Ignoring SIGINT in the main process while it
    spawns (a disposition exec keeps) did that, but a Ctrl-C in those 0.1-0.2 s was lost and the
    preparation ran to its end (issue 39). Instead SIGINT is *blocked* there, as
    multiprocessing's resource tracker protects its own child (bpo-33613): a spawned process
    inherits the signal mask through fork and exec, and a Ctrl-C sent to it stays pending until
    _worker_init ignores it, which discards it. In the main process a blocked Ctrl-C stays
    pending too (one that another thread takes runs the deferring handler): it is recorded when
    the mask is restored, and raised again once the pool exists, for the handler in place
    (_ctrl_c_remembered's) to stop the preparation as anywhere else. The resource tracker is
    started first because its start unblocks SIGINT (its bpo-33613 code restores an empty mask).
    """
    context = multiprocessing.get_context("spawn")
    with _sigint_deferred() as deferred:
        pool = context.Pool(workers, initializer=_worker_init, initargs=(tokenizer_spec,))
    with pool:  # terminated on leaving, a deferred Ctrl-C included
        if deferred:
            signal.raise_signal(signal.SIGINT)
        yield pool


@contextlib.contextmanager
def _sigint_deferred():
    """Within: SIGINT blocked in this thread (and so in the processes it spawns) and, should it
    still arrive, recorded instead of handled; yields the record, a list that is non-empty after
    the block if a Ctrl-C came. Outside the main thread, as is (no handler can change there)."""
    deferred: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield deferred
        return
    resource_tracker.ensure_running()  # its first start unblocks SIGINT: not inside the block
    with _sigint(lambda signum, frame: deferred.append(signum)):
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield deferred
        finally:  # a pending Ctrl-C runs the recording handler here, before `_sigint` restores its own
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _tasks(texts: list[str]) -> list[list[str]]:
    tasks, size = [[]], 0
    for t in texts:
        if size >= _TASK_CHARS:
            tasks.append([])
            size = 0
        tasks[-1].append(t)
        size += len(t)
    return tasks


class _Run:
    """One preparation's mutable state: the input cursor, counts and the two split writers."""

    def __init__(self, out_dir, reader, dtype, shard_tokens, val_fraction, state, fingerprint, tail=False, tok=None):
        self.out_dir, self.reader, self.val_fraction, self.fingerprint = out_dir, reader, val_fraction, fingerprint
        self.tok = tok or tokenizer.load(tokenizer.TOKENIZER_NAME)
        self.fresh = state is None  # this session created out_dir's preparation
        self.tail = tail  # one text file: document 0 is its head (train), document 1 its tail (val)
        s = state or {"cursor": [0, 0], "documents": {"train": 0, "val": 0}, "current_split": None,
                      "text_bytes": 0, "bad_lines": 0, "splits": {"train": None, "val": None}}
        self.cursor, self.documents = list(s["cursor"]), dict(s["documents"])
        self.current, self.text_bytes, self.bad_lines = s["current_split"], s["text_bytes"], s["bad_lines"]
        self.writers = {split: SplitWriter(out_dir, split, shard_tokens, dtype, s["splits"][split])
                        for split in ("train", "val")}

    def tokens(self) -> int:
        return sum(w.total for w in self.writers.values())

    def batches(self, batch_chars: int):
        """(pieces, cursor after them, bad lines so far) from the cursor on."""
        files = self.reader.files
        batch, size = [], 0
        for i in range(self.cursor[0], len(files)):
            n = self.cursor[1] if i == self.cursor[0] else 0
            for piece in self.reader.pieces(i, n, self.bad_lines if i == self.cursor[0] else None):
                batch.append(piece)
                size += len(piece[0])
                n += 1
                if size >= batch_chars:
                    yield batch, (i, n), self.reader.bad_lines
                    batch, size = [], 0
            if batch and i == len(files) - 1:
                yield batch, (i, n), self.reader.bad_lines

    def _is_val(self, doc: int) -> bool:
        if self.tail:
            return doc > 0
        f = self.val_fraction
        return math.floor((doc + 1) * f) > math.floor(doc * f)

    def commit(self, batch, cursor, bad_lines, result) -> None:
        """Writes one encoded batch, then records the state that resuming after it needs."""
        dtype = self.writers["train"].dtype
        eot = np.asarray([self.tok.separator_id], dtype=dtype)  # GPT-2's <|endoftext|>
        pieces = iter(batch)
        for data, lengths, text_bytes in result.get():
            tokens, start = np.frombuffer(data, dtype=dtype), 0
            for n in lengths:
                _, starts_document = next(pieces)
                if starts_document:
                    doc = sum(self.documents.values())
                    self.current = "val" if self._is_val(doc) else "train"
                    self.documents[self.current] += 1
                    if self.writers[self.current].total:
                        self.writers[self.current].append(eot)
                self.writers[self.current].append(tokens[start:start + n])
                start += n
            self.text_bytes += text_bytes
        self.cursor, self.bad_lines = list(cursor), bad_lines
        write_json_atomically(self.out_dir / STATE, {
            "fingerprint": self.fingerprint, "cursor": self.cursor, "documents": self.documents,
            "current_split": self.current, "text_bytes": self.text_bytes, "bad_lines": self.bad_lines,
            "splits": {s: w.state() for s, w in self.writers.items()}})

    def finish(self, sources, skip_bad_lines, text_field, separator, val_fraction, shard_tokens,
               identity) -> dict:
        docs = sum(self.documents.values())
        for split in ("train", "val"):
            if not self.writers[split].total:
                if docs <= 1:
                    hint = ("each split needs documents of its own: add documents, or split text files into "
                            "documents with --separator")
                else:
                    hint = "add documents or raise --val-fraction" if split == "val" else "add text"
                kept = not self.fresh  # else prepare_corpus removes out_dir
                end = f"; remove {self.out_dir} and prepare again." if kept else "."
                if self.tail:
                    path = self.reader.files[0]
                    chars = self.reader.tail_cut(path)[0]
                    if not chars:
                        raise EmptySplit(f"The {split} split is empty: {path} holds no text{end}")
                    raise EmptySplit(f"The {split} split is empty: the {chars:,} character"
                                    f"{'s are' if chars != 1 else ' is'} too few in {path} to split with "
                                    f"--val-fraction {val_fraction} (add text){end}")
                raise EmptySplit(f"The {split} split is empty: {docs:,} document{'s' * (docs != 1)} "
                                f"with --val-fraction {val_fraction} put none in it ({hint}){end}")
        shards = {split: w.finish() for split, w in self.writers.items()}
        meta = {
            "tokenizer": self.tok.name,
            "tokenizer_sha256": self.tok.sha256,
            "vocab_size": self.tok.n_vocab,
            "dtype": identity["dtype"],
            "train_tokens": sum(s["tokens"] for s in shards["train"]),
            "val_tokens": sum(s["tokens"] for s in shards["val"]),
            "train_documents": self.documents["train"],
            "val_documents": self.documents["val"],
            "text_bytes": self.text_bytes,
            "bad_lines_skipped": self.bad_lines,
            "shards": shards,
            "sources": sources,
            "sources_sha256": hashlib.sha256("".join(s["sha256"] for s in sources).encode()).hexdigest(),
            "val_fraction": val_fraction,
            **({"val_split": "tail"} if self.tail else {}),
            "text_field": text_field,
            "separator": separator,
            "shard_tokens": shard_tokens,
            "skip_bad_lines": skip_bad_lines,
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
        }
        write_json_atomically(self.out_dir / META, meta)
        (self.out_dir / STATE).unlink()
        (self.out_dir / f".{STATE}.tmp").unlink(missing_ok=True)  # a kill mid-write, long replaced
        return meta

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


class Progress:
    """A tqdm bar on a terminal; otherwise a plain line every `every` seconds (logs, CI).

    Notes and plain lines go to stdout and the bar (a terminal only) to stderr, which it leaves
    when an error ends the run: stderr then holds the error's one line and nothing else.
    """

    def __init__(self, mode: str, file_sizes: list[int], every: float = 30.0):
        if mode not in ("auto", "bar", "lines"):
            raise UserError(f"--progress must be auto, bar or lines, got {mode!r}.")
        self.bar_mode = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.before = np.cumsum([0] + file_sizes)  # input bytes before file i
        self.total, self.every, self.bar, self.run = int(self.before[-1]), every, None, None

    def note(self, text: str) -> None:
        print(f"prepare: {text}", flush=True)

    def start(self, run: _Run) -> None:
        done_bytes = int(self.before[run.cursor[0]])
        self.run, self.t0, self.b0, self.last = run, time.time(), done_bytes, time.time()
        self.tokens0 = run.tokens()
        if self.bar_mode:
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, initial=done_bytes, unit="B", unit_scale=True,
                            desc="prepare", dynamic_ncols=True)

    def update(self, cursor, file_bytes_read) -> None:
        done = min(int(self.before[cursor[0]]) + file_bytes_read, self.total)
        docs, tokens = sum(self.run.documents.values()), self.run.tokens()
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix(docs=f"{docs:,}", tokens=f"{tokens:,}", refresh=False)
        elif time.time() - self.last >= self.every:
            self.last = time.time()
            elapsed = self.last - self.t0
            rate = (done - self.b0) / max(elapsed, 1e-9)
            eta = (self.total - done) / rate if rate > 0 else float("inf")
            print(f"prepare: {done / 1e6:,.0f} of {self.total / 1e6:,.0f} MB ({100 * done / max(self.total, 1):.0f}%), "
                  f"{docs:,} documents, {tokens:,} tokens, {rate / 1e6:.1f} MB/s, "
                  f"{(tokens - self.tokens0) / max(elapsed, 1e-9):,.0f} tokens/s, ETA {eta:.0f} s",
                  flush=True)

    def close(self, failed: bool = False) -> None:
        if self.bar is not None:
            self.bar.leave = not failed  # an error's line replaces the bar
            self.bar.close()
            self.bar = None

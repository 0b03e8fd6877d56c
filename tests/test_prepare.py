"""Properties of `python -m jaxgpt.prepare` (streamed, sharded, resumable) and of mixtures.

The corpus is the bundled shakespeare cut into paragraphs (7,222 documents). Preparations run
the real worker pool (spawned processes) and real files; the kill test kills a real process.
"""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from jaxgpt import data, tokenizer
from jaxgpt.config import load_config
from jaxgpt.data import readers, writer
from jaxgpt.data.corpus import encode_task, prepare_corpus
from jaxgpt.errors import UserError
from jaxgpt.prepare import main

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / "jaxgpt" / "assets" / "tinyshakespeare.txt"
DOCS = SHAKESPEARE.read_text().split("\n\n")


def files_of(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def write_jsonl(path: Path, docs, opener=open) -> Path:
    with opener(path, "wt") as f:
        for d in docs:
            f.write(json.dumps({"id": 1, "text": d}) + "\n")
    return path


def all_tokens(out: Path, split: str) -> np.ndarray:
    return np.asarray(data.load_split(out, split)[0:len(data.load_split(out, split))])


# ---------------------------------------------------------------- formats and tokens


def test_every_input_format_gives_the_same_shards(tmp_path):
    docs = DOCS[:400]
    (tmp_path / "dir").mkdir()
    text = tmp_path / "dir" / "corpus.txt"
    text.write_text("\n\n".join(docs))
    write_jsonl(tmp_path / "c.jsonl", docs)
    write_jsonl(tmp_path / "c.jsonl.gz", docs, gzip.open)
    with zstandard.open(tmp_path / "c.jsonl.zst", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    pq.write_table(pa.table({"text": docs[:150]}), tmp_path / "p-0.parquet", row_group_size=64)
    pq.write_table(pa.table({"text": docs[150:]}), tmp_path / "p-1.parquet", row_group_size=64)
    for suffix, compress in ((".gz", gzip.compress), (".zst", zstandard.ZstdCompressor().compress)):
        (tmp_path / f"dir{suffix}").mkdir()  # text compressed (was read as raw bytes)
        (tmp_path / f"dir{suffix}" / f"corpus.txt{suffix}").write_bytes(compress(text.read_bytes()))

    kw = dict(shard_tokens=4_000, workers=1, progress="lines")
    outs = {
        "text (a directory, --separator)": prepare_corpus([tmp_path / "dir"], tmp_path / "o-txt",
                                                          separator="\n\n", **kw),
        "jsonl": prepare_corpus([tmp_path / "c.jsonl"], tmp_path / "o-jsonl", **kw),
        "jsonl.gz": prepare_corpus([tmp_path / "c.jsonl.gz"], tmp_path / "o-gz", **kw),
        "jsonl.zst": prepare_corpus([tmp_path / "c.jsonl.zst"], tmp_path / "o-zst", **kw),
        "parquet (a glob, two files)": prepare_corpus([str(tmp_path / "p-*.parquet")], tmp_path / "o-pq", **kw),
        "text.gz": prepare_corpus([tmp_path / "dir.gz"], tmp_path / "o-txt-gz", separator="\n\n", **kw),
        "text.zst": prepare_corpus([tmp_path / "dir.zst"], tmp_path / "o-txt-zst", separator="\n\n", **kw),
    }
    shards = {name: meta["shards"] for name, meta in outs.items()}
    assert all(s == shards["jsonl"] for s in shards.values()), shards
    meta = outs["jsonl"]
    assert (meta["train_documents"], meta["val_documents"]) == (360, 40)
    assert len(meta["shards"]["train"]) > 1 and meta["dtype"] == "uint16"

    # The token stream is the documents, every 10th in val, one <|endoftext|> between documents.
    enc = tokenizer.gpt2_encoding()
    val_docs = [d for i, d in enumerate(docs) if i % 10 == 9]
    train_docs = [d for i, d in enumerate(docs) if i % 10 != 9]
    out = tmp_path / "o-jsonl"
    assert enc.decode(list(all_tokens(out, "train"))) == "<|endoftext|>".join(train_docs)
    assert enc.decode(list(all_tokens(out, "val"))) == "<|endoftext|>".join(val_docs)
    assert meta["train_tokens"] == len(data.load_split(out, "train"))


def test_long_documents_are_cut_where_tokens_do_not_change(tmp_path, monkeypatch):
    text = SHAKESPEARE.read_text()
    enc = tokenizer.gpt2_encoding()
    pieces = list(readers.split_document(text, max_chars=3_000))
    assert len(pieces) > 300 and "".join(p for p, _ in pieces) == text
    assert [first for _, first in pieces] == [True] + [False] * (len(pieces) - 1)
    assert sum((enc.encode_ordinary(p) for p, _ in pieces), []) == enc.encode_ordinary(text)
    # Without line breaks (minified JSON, base64) the cuts fall where a letter or digit run ends.
    blob = json.dumps([{f"key{i}": [i, i * 2.5, f"v{i:x}"]} for i in range(2_000)], separators=(",", ":"))
    pieces = [p for p, _ in readers.split_document(blob, max_chars=3_000)]
    assert len(pieces) > 15 and max(map(len, pieces)) <= 3_000 and "".join(pieces) == blob
    assert sum(map(enc.encode_ordinary, pieces), []) == enc.encode_ordinary(blob)
    rng = np.random.default_rng(0)  # and in any mix of classes: letters, digits, punctuation, contractions, Unicode
    alphabet = list("abcXYZ019_-'\"{}[]:,.!?/+= \t\x00\x1f") + ["\u00e9", "\u65e5", "'s", "'ll"]
    for _ in range(40):
        text_ = "".join(rng.choice(alphabet, size=int(rng.integers(500, 5_000))))
        pieces = [p for p, _ in readers.split_document(text_, max_chars=int(rng.integers(20, 300)))]
        assert "".join(pieces) == text_ and sum(map(enc.encode_ordinary, pieces), []) == enc.encode_ordinary(text_)
    # The workers' encoder is encode_ordinary: text spelling <|endoftext|> is not the EOT token.
    tricky = ["a <|endoftext|> b", "", "x" * 5]
    data_bytes, lengths, _ = encode_task(tricky)
    assert np.frombuffer(data_bytes, "<u2").tolist() == sum(map(enc.encode_ordinary, tricky), [])
    assert lengths == [len(enc.encode_ordinary(t)) for t in tricky]

    # Streaming a text file in small reads, with and without a separator, loses nothing.
    monkeypatch.setattr(readers, "_READ_CHARS", 5_000)
    path = tmp_path / "s.txt"
    path.write_bytes(text.replace("\n", "\r\n").encode())  # universal newlines
    whole = list(readers.Reader([path], max_chars=3_000).pieces(0))
    assert "".join(p for p, _ in whole) == text and sum(f for _, f in whole) == 1
    split = list(readers.Reader([path], separator="\n\n", max_chars=3_000).pieces(0))
    docs, current = [], None
    for p, first in split:
        if first:
            docs.append(current) if current is not None else None
            current = ""
        current += p
    assert docs + [current] == [d for d in DOCS if d]


def test_output_does_not_depend_on_the_worker_count(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS[:2000])
    kw = dict(shard_tokens=10_000, progress="lines", batch_chars=20_000, val_fraction=0.05)
    prepare_corpus([corpus], tmp_path / "w1", workers=1, **kw)
    prepare_corpus([corpus], tmp_path / "w3", workers=3, **kw)
    assert files_of(tmp_path / "w1") == files_of(tmp_path / "w3")
    # Same command again: already prepared, nothing rewritten.
    mtime = (tmp_path / "w3" / "meta.json").stat().st_mtime_ns
    prepare_corpus([corpus], tmp_path / "w3", workers=2, **kw)
    assert (tmp_path / "w3" / "meta.json").stat().st_mtime_ns == mtime


# ---------------------------------------------------------------- interruption


def run_prepare(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "jaxgpt.prepare", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_kill_9_at_any_moment_resumes_to_identical_bytes(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS * 3)  # 3.3 MB
    args = [corpus, "--shard-tokens", 30_000, "--batch-mb", 0.02, "--workers", 1, "--progress", "lines"]
    prepare_corpus([corpus], tmp_path / "ref", shard_tokens=30_000, batch_chars=20_000, workers=1,
                   progress="lines")

    out = tmp_path / "out"
    state = out / writer.STATE
    for min_cursor in (1, 40):  # kill twice: early, then after resuming
        proc = run_prepare(*args, "--out", out)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if json.loads(state.read_text())["cursor"][1] >= min_cursor:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert not (out / "meta.json").exists()  # killed before the end: unfinished
        with pytest.raises(UserError, match="unfinished preparation"):
            data.resolve_data_dir(str(out))
    proc = run_prepare(*args, "--out", out)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert "resuming at input file 1" in proc.stdout.read()
    assert files_of(out) == files_of(tmp_path / "ref")


def test_crash_between_shard_rename_and_state_resumes(tmp_path, monkeypatch):
    """A kill right after a shard was renamed final but before the state recorded it."""
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS[:3000])
    kw = dict(shard_tokens=7_000, workers=1, progress="lines", batch_chars=30_000)
    prepare_corpus([corpus], tmp_path / "ref", **kw)
    real = writer.write_json_atomically
    calls = []

    def dies_on_fifth_state(path, obj):
        calls.append(path)
        if len(calls) == 5:
            raise KeyboardInterrupt  # the process dies here: shards renamed, state not written
        real(path, obj)

    monkeypatch.setattr("jaxgpt.data.corpus.write_json_atomically", dies_on_fifth_state)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus([corpus], tmp_path / "out", **kw)
    finished = sorted(p.name for p in (tmp_path / "out").glob("train-*.bin"))
    recorded = json.loads((tmp_path / "out" / writer.STATE).read_text())["splits"]["train"]["shards"]
    assert len(finished) > len(recorded)  # the dangerous moment really happened
    partial = next((tmp_path / "out").glob("*.partial"))
    with open(partial, "ab") as f:
        f.write(b"\x01\x02garbage")  # bytes written after the last recorded state
    monkeypatch.setattr("jaxgpt.data.corpus.write_json_atomically", real)
    prepare_corpus([corpus], tmp_path / "out", **kw)
    assert files_of(tmp_path / "out") == files_of(tmp_path / "ref")


# ---------------------------------------------------------------- loading shards


def test_windows_cross_shard_boundaries_like_one_file(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS[:1500])
    prepare_corpus([corpus], tmp_path / "out", shard_tokens=997, workers=1, progress="lines")
    tokens = data.load_split(tmp_path / "out", "train")
    assert isinstance(tokens, data.ShardedTokens) and len(tokens.parts) > 20
    flat = np.concatenate([np.fromfile(tmp_path / "out" / s["file"], "<u2")
                           for s in data.load_meta(tmp_path / "out")["shards"]["train"]])
    assert len(tokens) == len(flat)
    for a, b in [(990, 1010), (0, 997), (997, 1994), (5, 3500), (len(flat) - 3, len(flat))]:
        np.testing.assert_array_equal(tokens[a:b], flat[a:b])
    assert tokens[997] == flat[997] and tokens[-1] == flat[-1]
    kw = dict(seq_len=50, global_batch=8, seed=1, process_index=0, process_count=1)
    sharded, single = data.train_iterator(tokens, **kw), data.train_iterator(flat, **kw)
    for _ in range(30):
        np.testing.assert_array_equal(next(sharded), next(single))


# ---------------------------------------------------------------- mixtures


def synthetic_dir(path: Path, first: int, n: int) -> Path:
    path.mkdir()
    np.arange(first, first + n, dtype="<u2").tofile(path / "train.bin")
    np.arange(first, first + 101, dtype="<u2").tofile(path / "val.bin")
    (path / "meta.json").write_text(json.dumps({
        "tokenizer": "gpt2", "tokenizer_sha256": tokenizer.vocab_sha256(), "vocab_size": 50257,
        "train_tokens": n, "val_tokens": 101, "sources": ["x"]}))
    return path


def test_mixture_weights_disjoint_processes_and_exact_resume(tmp_path):
    a = synthetic_dir(tmp_path / "a", 0, 4 * 60 + 1)  # 60 windows of 4, ids 0..59
    b = synthetic_dir(tmp_path / "b", 10_000, 4 * 25 + 1)  # 25 windows, ids 2500..2524
    train, val, vocab, described = data.open_splits("shakespeare", f"{a}:3,{b}:1")
    assert vocab == 50257 and described == f"{a}:0.75,{b}:0.25"
    seq, g = 4, 8

    def batches(p, count, n=40):
        it = data.train_iterator(train, seq_len=seq, global_batch=g, seed=5, process_index=p,
                                 process_count=count)
        return [next(it) for _ in range(n)]

    ref = batches(0, 1)
    ids = np.concatenate([x[:, 0] // seq for x in ref])  # window ids in stream order
    np.testing.assert_array_equal(ref[0][:, 1:], ref[0][:, :-1] + 1)  # true windows
    from_a = ids < 2500
    assert from_a[:320].sum() == 240  # 3:1, exactly, in every 4 * 100 windows (grain's integer shares)
    assert sorted(ids[from_a][:60]) == list(range(60))  # a's first epoch: each window once
    assert sorted(ids[~from_a][:25]) == list(range(2500, 2525))
    assert list(ids[from_a][60:120]) != list(ids[from_a][:60])  # a new permutation per epoch
    for count in (2, 4):
        shards = [batches(p, count) for p in range(count)]
        for step in range(40):
            local = [shards[p][step] for p in range(count)]
            np.testing.assert_array_equal(np.concatenate(local), ref[step])  # disjoint rows
    it = data.train_iterator(train, seq_len=seq, global_batch=g, seed=5, process_index=1, process_count=2)
    [next(it) for _ in range(7)]
    state, expected = it.get_state(), [next(it) for _ in range(10)]
    again = data.train_iterator(train, seq_len=seq, global_batch=g, seed=5, process_index=1, process_count=2)
    again.set_state(state)
    for got, want in zip([next(again) for _ in range(10)], expected, strict=True):
        np.testing.assert_array_equal(got, want)
    evals = data.eval_batches(val, seq_len=seq, global_batch=g, num_batches=2, process_index=0,
                              process_count=1)
    assert [list(e[:, 0]) for e in evals] == [list(e[:, 0]) for e in data.eval_batches(
        val, seq_len=seq, global_batch=g, num_batches=2, process_index=0, process_count=1)]
    with pytest.raises(UserError, match="positive weight"):
        data.parse_mix("a:0.5,b")
    yaml_file = tmp_path / "mix.yaml"  # the YAML list form of data.mix
    yaml_file.write_text(f"data:\n  mix:\n    - {a}: 3\n    - {b}: 1\n")
    assert load_config(str(yaml_file)).data.mix == f"{a}:3,{b}:1"
    with pytest.raises(UserError, match="does not exist"):
        data.open_splits("shakespeare", f"{a}:1,{tmp_path / 'nowhere'}:1")


# ---------------------------------------------------------------- bad input


def cli(capsys, *args):
    """The CLI's main() in this process (the kill test runs the real command)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    return code, lines[-1] if lines else "", out, err


def test_bad_inputs_are_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n\n{"body": "no text"}\n' + '{"text": "ok"}\n' * 30)
    code, line, _, err = cli(capsys, bad, "--out", tmp_path / "o1")
    assert code == 2 and "Traceback" not in err and not (tmp_path / "o1").exists()
    assert line.startswith("error:") and f"{bad}:2: not valid JSON" in line and "--skip-bad-lines" in line
    code, line, out, err = cli(capsys, bad, "--out", tmp_path / "o2", "--skip-bad-lines")
    assert code == 0, err
    assert "skipped 2 bad lines" in out and data.load_meta(tmp_path / "o2")["bad_lines_skipped"] == 2

    checks = []
    nofield = write_jsonl(tmp_path / "nofield.jsonl", ["a", "b"])
    checks.append(((nofield, "--text-field", "content"), f"{nofield}:1: no 'content' field (found: id, text)"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    checks.append(((tmp_path / "p.parquet",), "has no column 'text' (columns: body)"))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    checks.append(((latin,), f"{latin} is not valid UTF-8"))
    unreadable = tmp_path / "secret.txt"
    unreadable.write_text("x")
    unreadable.chmod(0)
    if os.access(unreadable, os.R_OK):  # running as root: a directory given as a file instead
        unreadable = tmp_path / "fake.jsonl.gz"
        unreadable.write_bytes(b"not gzip at all")
    checks.append(((unreadable,), f"Cannot read {unreadable}"))
    checks.append(((tmp_path / "missing*.jsonl",), "matches no files"))
    damaged = bytearray(gzip.compress(b'{"text": "a line"}\n' * 2_000))
    damaged[15] ^= 0xFF  # a zlib.error, not an OSError: was a traceback
    (tmp_path / "damaged.jsonl.gz").write_bytes(bytes(damaged))
    checks.append(((tmp_path / "damaged.jsonl.gz",), f"Cannot read {tmp_path / 'damaged.jsonl.gz'}: Error -3 while "
                                                      f"decompressing data"))
    checks.append((("/dev/zero",), "Input /dev/zero is not a regular file or a directory"))  # never ends
    surrogate = tmp_path / "surrogate.jsonl"  # JSON's \ud800 escape alone: a traceback from the tokenizer's encode
    surrogate.write_text('{"text": "a\\ud800b"}\n{"text": "fine"}\n')
    checks.append(((surrogate,), f"{surrogate}:1: the 'text' field holds a lone surrogate escape"))
    pq.write_table(pa.table({"text": ["x", None, "y"]}), tmp_path / "nulls.parquet")  # were dropped silently
    checks.append(((tmp_path / "nulls.parquet",), f"error: {tmp_path / 'nulls.parquet'}: row 2: the 'text' column "
                   "is null; fix the row or pass --skip-bad-lines to skip such rows."))  # was "fix the line"
    checks.append(((nofield, "--workers", "100000"), "--workers must be at most"))  # 100,000 processes
    for mb in ("nan", "inf", "0", "-1"):
        checks.append(((nofield, "--batch-mb", mb), "--batch-mb must be in (0, 1e6)"))
    for args, fragment in checks:
        code, line, _, err = cli(capsys, *args, "--out", tmp_path / "o3")
        assert code == 2 and line.startswith("error:") and fragment in line, (args, err)
        assert "Traceback" not in err and not (tmp_path / "o3").exists()
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--skip-bad-lines skip (and count) JSON Lines that are not JSON or lack the text field, and Parquet " \
           "rows whose text is null" in " ".join(capsys.readouterr().out.split())

    # An output dir holding a different preparation (other options, or other files) is refused.
    code, line, _, _ = cli(capsys, bad, "--out", tmp_path / "o2", "--skip-bad-lines", "--val-fraction", "0.5")
    assert code == 2 and "holds another preparation" in line
    one = write_jsonl(tmp_path / "one.jsonl", ["Only one document here.\n"])
    code, line, _, _ = cli(capsys, one, "--out", tmp_path / "o4")
    assert code == 2 and "val split is empty: 1 document" in line and "add documents" in line


def test_each_error_is_the_only_stderr_line(tmp_path, capsys):
    """Progress goes to stdout, so an error is stderr's one line (issue 25)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    proc = run_prepare(empty, "--out", tmp_path / "o", "--workers", 1)
    assert proc.wait(timeout=120) == 2
    assert proc.stderr.read() == f"error: The train split is empty: {empty} holds no text.\n"
    assert not (tmp_path / "o").exists()

    binary = tmp_path / "bin.dat"
    binary.write_bytes(bytes(range(128, 256)))
    one = tmp_path / "one.txt"
    one.write_text("x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("y")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    too_short = ("error: The val split is empty: the 1 character is too few in {} to split with "
                 "--val-fraction 0.1 (add text).\n")  # one text file: val is its tail
    for args, expected in [
        ((binary, "--out", tmp_path / "o"),
         f"error: {binary} is not valid UTF-8 (invalid start byte); convert it to UTF-8.\n"),
        ((one, "--out", tmp_path / "o1"), too_short.format(one)),
        ((tmp_path / "d", "--out", tmp_path / "o2"), too_short.format(tmp_path / "d" / "a.txt")),
        ((one, "--out", other),
         f"error: {other} already exists and holds another preparation (other inputs or options, or another "
         "jaxgpt version's) or other files; remove it or choose another output directory.\n")]:
        code = main([str(a) for a in (*args, "--workers", "1")])
        out, err = capsys.readouterr()
        assert (code, err) == (2, expected), out

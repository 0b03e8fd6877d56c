"""Data and run integrity (issue 20): every input shape a user has, damaged inputs and shards, and
`prepare` re-runnable at every instant. Each bad case asserts the exact line the user sees.

Corpora are a few hundred of the bundled shakespeare's paragraphs; preparations run the real
worker pool with one worker, and the kill and Ctrl-C tests a real `python -m jaxgpt.prepare`.
"""

import contextlib
import gzip
import json
import os
import shutil
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
from jaxgpt.cli import INTERRUPTED
from jaxgpt.data import corpus as corpus_module
from jaxgpt.data import integrity, readers, writer
from jaxgpt.data.corpus import prepare_corpus
from jaxgpt.errors import UserError
from jaxgpt.prepare import main as prepare_main
from jaxgpt.report import render

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / "jaxgpt" / "assets" / "tinyshakespeare.txt"
DOCS = SHAKESPEARE.read_text().split("\n\n")
KW = dict(workers=1, progress="lines", shard_tokens=5_000)


def jsonl_bytes(docs) -> bytes:
    return b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)


def files_of(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def tokens_of(out: Path, split: str = "train") -> list[int]:
    t = data.load_split(out, split)
    return list(np.asarray(t[0:len(t)]))


def cli(capsys, *args) -> tuple[int, str, str]:
    """`python -m jaxgpt.prepare ARGS` in this process: (exit code, stdout, stderr)."""
    code = prepare_main([str(a) for a in (*args, "--workers", "1")])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- compressed inputs read to the end


def test_a_truncated_gzip_or_zstd_stream_is_one_error_even_when_skipping_bad_lines(tmp_path, capsys):
    raw = jsonl_bytes(DOCS[:300])
    for suffix, compress in ((".zst", zstandard.ZstdCompressor().compress), (".gz", gzip.compress)):
        whole = compress(raw)
        cut = tmp_path / f"cut.jsonl{suffix}"
        cut.write_bytes(whole[:int(len(whole) * 0.6)])
        kind = {".zst": "zstd", ".gz": "gzip"}[suffix]
        code, _, err = cli(capsys, cut, "--out", tmp_path / "o", "--skip-bad-lines")
        assert (code, err) == (2, f"error: {cut} is cut short: its {kind} stream ends before its end "
                                  "marker (an interrupted download or copy?); fetch the file again.\n")
        assert not (tmp_path / "o").exists()
    # Several zstd frames back to back (zstd -c a b > ab.zst) and an empty file read whole.
    frames = tmp_path / "frames.jsonl.zst"
    frames.write_bytes(b"".join(zstandard.ZstdCompressor().compress(jsonl_bytes(DOCS[i:i + 100]))
                                for i in (0, 100, 200)))
    (tmp_path / "empty.jsonl.zst").write_bytes(b"")
    reader = readers.Reader([frames, tmp_path / "empty.jsonl.zst"])
    assert [p for p, _ in reader.pieces(0)] == [d for d in DOCS[:300] if d]
    assert list(reader.pieces(1)) == []


# ---------------------------------------------------------------- input shapes


def test_input_shapes_people_have(tmp_path, capsys):
    docs = DOCS[:40]
    # A UTF-8 BOM (Windows Notepad) starts no document and is no token, in JSON Lines and in text.
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(readers.BOM + jsonl_bytes(docs))
    assert [p for p, _ in readers.Reader([bom]).pieces(0)] == docs
    text = tmp_path / "bom.txt"
    text.write_bytes(readers.BOM + docs[0].encode())
    assert [p for p, _ in readers.Reader([text]).pieces(0)] == [docs[0]]

    # Parquet: every Arrow string type, dictionary-encoded or not, reads as the same documents.
    for name, array in [("string", pa.array(docs)), ("large_string", pa.array(docs, pa.large_string())),
                        ("string_view", pa.array(docs, pa.string_view())),
                        ("dictionary", pa.array(docs).dictionary_encode())]:
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"text": array}), path)
        assert [p for p, _ in readers.Reader([path]).pieces(0)] == docs, name

    # A JSON array is not JSON Lines: say so, not "--text-field".
    for content in (json.dumps([{"text": d} for d in docs[:3]]), json.dumps([{"text": "a"}], indent=2)):
        array = tmp_path / "array.json"
        array.write_text(content)
        code, _, err = cli(capsys, array, "--out", tmp_path / "o")
        assert (code, err) == (2, f"error: {array} holds {'a' if content[1] == '{' else 'one'} JSON array, "
                                  "not JSON Lines (one object per line); convert it, e.g. "
                                  f"`jq -c '.[]' {array} > array.jsonl`.\n")

    # Symlinked directories are followed, each once (a link loop ends); a file named twice is read
    # once, with a warning.
    tree = tmp_path / "tree"
    (tree / "real").mkdir(parents=True)
    (tree / "real" / "a.txt").write_text("alpha")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.txt").write_text("beta")
    (tree / "linked").symlink_to(tmp_path / "elsewhere")
    (tree / "real" / "loop").symlink_to(tree)
    found = readers.find_inputs([tree, tree / "real" / "a.txt"])
    _, err = capsys.readouterr()
    assert found == [tree / "linked" / "b.txt", tree / "real" / "a.txt"]
    assert err == f"warning: input {tree / 'real' / 'a.txt'} is named more than once; reading it once\n"


def test_an_output_dir_inside_an_input_dir_is_not_read_back(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "c.jsonl").write_bytes(jsonl_bytes(DOCS[:200]))
    out = corpus / "prepared"
    first = prepare_corpus([corpus], out, **KW)
    again = prepare_corpus([corpus], out, **KW)  # the shards under out are not inputs
    assert again == first and [s["path"] for s in first["sources"]] == [str(corpus / "c.jsonl")]
    capsys.readouterr()
    assert readers.find_inputs([corpus], exclude=out) == [corpus / "c.jsonl"]
    with pytest.raises(UserError, match="holds no files besides the output directory"):
        readers.find_inputs([out], exclude=out)


# ---------------------------------------------------------------- prepare re-runnable at every instant


def test_leftovers_of_a_run_killed_before_its_first_record_are_not_another_preparation(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(DOCS[:300]))
    prepare_corpus([corpus], tmp_path / "ref", **KW)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("train-00000.bin.partial", "val-00000.bin.partial", "..prepare-state.json.tmp"):
        (out / name).write_bytes(b"")
    (out / "train-00000.bin").write_bytes(b"\x01\x02" * 100)  # a shard filled by the first batch
    (out / "train-00003.bin.partial").write_bytes(b"\x07" * 10)
    prepare_corpus([corpus], out, **KW)
    assert files_of(out) == files_of(tmp_path / "ref")
    # Someone else's files are still refused.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="holds another preparation"):
        prepare_corpus([corpus], tmp_path / "mine", **KW)


# ---------------------------------------------------------------- shards checked before training


def test_a_tampered_shard_is_refused_before_training(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(DOCS[:300]))
    out = tmp_path / "out"
    prepare_corpus([corpus], out, **KW)
    cache = tmp_path / "run" / "data-verified.json"
    data.open_splits(str(out), cache=cache)
    cache.parent.mkdir()
    integrity.remember(cache)
    assert data.check_dir(out, data.load_meta(out), cache=cache) == 0  # every verdict remembered
    shard = out / "train-00001.bin"
    with open(shard, "r+b") as f:  # same size, other bytes, one id outside the vocabulary
        f.seek(100)
        f.write(b"\xff\xff" * 8)
    sha = data.load_meta(out)["shards"]["train"][1]["sha256"]
    import hashlib
    got = hashlib.sha256(shard.read_bytes()).hexdigest()
    with pytest.raises(UserError) as e:
        data.open_splits(str(out), cache=cache)
    assert str(e.value) == (
        f"{shard} does not match meta.json: its sha256 is {got[:16]}..., not {sha[:16]}... and holds "
        "token id 65535, outside the vocabulary of 50,257 ids (changed or damaged after it was "
        "prepared); prepare the data again with `python -m jaxgpt.prepare INPUT... --out DIR`.")

    # The single-file layout records no hashes: its token ids are still checked.
    single = tmp_path / "single"
    single.mkdir()
    np.asarray([1, 2, 3, 65535, 5], "<u2").tofile(single / "train.bin")
    np.asarray([1, 2], "<u2").tofile(single / "val.bin")
    (single / "meta.json").write_text(json.dumps({
        "tokenizer": "gpt2", "tokenizer_sha256": tokenizer.vocab_sha256(), "vocab_size": 50257,
        "train_tokens": 5, "val_tokens": 2}))
    with pytest.raises(UserError) as e:
        data.open_splits(str(single))
    assert str(e.value) == (
        f"{single / 'train.bin'} holds token id 65535 at token 3, outside the vocabulary of 50,257 ids "
        "(not written by jaxgpt.prepare, or damaged); prepare the data again with "
        "`python -m jaxgpt.prepare INPUT... --out DIR`.")


# ---------------------------------------------------------------- the report names the data


def test_report_names_the_data_dirs_with_counts_and_weights(tmp_path):
    start = {"event": "start", "time": 0.0, "step": 0, "data": "web:0.7,code:0.3", "data_sources": [
        {"name": "web", "dir": "/d/web", "weight": 0.7, "tokenizer": "gpt2", "train_tokens": 1_000_000,
         "val_tokens": 5_000, "documents": 321},
        {"name": "code", "dir": "/d/code", "weight": 0.3, "tokenizer": "gpt2", "train_tokens": 2_000,
         "val_tokens": 100}]}
    row = next(line for line in render(tmp_path, [], [start], {}).splitlines() if line.startswith("| data |"))
    assert row == ("| data | mixture of `/d/web`: gpt2 tokens, 1,000,000 train + 5,000 val, 321 documents, "
                   "weight 0.7; `/d/code`: gpt2 tokens, 2,000 train + 100 val, weight 0.3 |")
    single = {**start, "data": "shakespeare", "data_sources": [
        {"name": "shakespeare", "dir": "/c/shakespeare-1", "tokenizer": "gpt2", "train_tokens": 301_966,
         "val_tokens": 36_059}]}
    row = next(line for line in render(tmp_path, [], [single], {}).splitlines() if line.startswith("| data |"))
    assert row == ("| data | the bundled shakespeare (`/c/shakespeare-1`): gpt2 tokens, 301,966 train + "
                   "36,059 val |")
    # An older run's events say nothing more than the config does: its data.path, not "unknown".
    old = {"event": "start", "time": 0.0, "step": 0}
    row = next(line for line in render(tmp_path, [], [old], {"data": {"path": "/d/web", "mix": ""}}).splitlines()
               if line.startswith("| data |"))
    assert row == "| data | /d/web |"


def test_a_tampered_shard_stops_training_and_a_prepare_rerun(tmp_path, capsys):
    from jaxgpt.train import main as train_main
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(DOCS[:300]))
    out = tmp_path / "out"
    assert cli(capsys, corpus, "--out", out, "--shard-tokens", 5000)[0] == 0
    shard = out / "val-00000.bin"
    shard.write_bytes(shard.read_bytes()[::-1])  # same size, other bytes
    code, err = train_main(["--run-dir", str(tmp_path / "run"), f"data.path={out}"]), capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {shard} does not match meta.json: its sha256 is ")
    assert err.endswith("(changed or damaged after it was prepared); prepare the data again with "
                        "`python -m jaxgpt.prepare INPUT... --out DIR`.\n")
    code, stdout, err = cli(capsys, corpus, "--out", out, "--shard-tokens", 5000)  # not 'nothing to do'
    assert code == 2 and "nothing to do" not in stdout and err.startswith(f"error: {shard} does not match")
    assert err.endswith(f"(changed or damaged after it was prepared); remove {out} and run this command "
                        "again.\n")


def test_one_plain_text_file_prepares_with_the_defaults(tmp_path, capsys, shakespeare_dir):
    """nanoGPT's corpus shape: val is the file's last 10% of characters, as the bundled split."""
    code, stdout, err = cli(capsys, SHAKESPEARE, "--out", tmp_path / "out")
    assert (code, err) == (0, "") and "from 2 documents" in stdout
    assert tokens_of(tmp_path / "out") == list(np.fromfile(shakespeare_dir / "train.bin", "<u2"))
    assert tokens_of(tmp_path / "out", "val") == list(np.fromfile(shakespeare_dir / "val.bin", "<u2"))
    assert data.load_meta(tmp_path / "out")["val_split"] == "tail"


def test_an_unwritable_out_is_one_line(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text\n" * 50)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    out = locked / "out"
    if os.access(locked, os.W_OK):  # root ignores modes: /sys is read-only in containers too
        out = Path("/sys/jaxgpt-test-out")
        if os.access("/sys", os.W_OK) and not Path("/sys").is_mount():
            pytest.skip("no read-only directory to write into")
    code, stdout, err = cli(capsys, corpus, "--out", out)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: Cannot write to --out {out}: ")


# ---------------------------------------------------------------- kills and Ctrl-C at any moment


def run_prepare(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "jaxgpt.prepare", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 3.3 MB corpus in small batches, and its uninterrupted preparation."""
    root = tmp_path_factory.mktemp("big")
    corpus = root / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(DOCS * 3))
    args = [corpus, "--shard-tokens", 30_000, "--batch-mb", 0.05, "--progress", "lines"]
    proc = run_prepare(*args, "--workers", 1, "--out", root / "ref")
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    return args, files_of(root / "ref")


def stopped(pid: int) -> bool:
    """Once a SIGSTOP sent to pid has taken effect: True if it stopped, False if it had exited first.
    (kill() returns before the signal lands: a process still running then can finish meanwhile.)"""
    while True:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("T", "Z", "X"):
            return state == "T"
        time.sleep(0.001)


def test_ctrl_c_is_one_line_and_exit_130_then_the_same_command_finishes(tmp_path, big):
    args, ref = big
    out = tmp_path / "out"
    for _ in range(5):  # a loaded machine may let the whole preparation finish before the test sees it start
        proc = run_prepare(*args, "--workers", 2, "--out", out, start_new_session=True)
        deadline = time.time() + 120
        while not (out / writer.STATE).exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGSTOP)  # frozen mid-way: Ctrl-C lands where it stopped
            if stopped(proc.pid) and not (out / writer.META).exists():
                os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
                os.killpg(proc.pid, signal.SIGCONT)
                if proc.wait(timeout=60) != 0:
                    break
                # Exit 0: the run finished although it was stopped before meta.json. Seen twice in CI
                # on 2 loaded cores, never reproduced by hand (160 tries under load). One way it can
                # happen, a Ctrl-C landing in a __del__, is fixed and tested above; whether it was
                # CI's is unconfirmed, so such an attempt is still checked for its output and retried.
                assert files_of(out) == ref
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        shutil.rmtree(out)
    assert proc.returncode == 130
    assert proc.stderr.read() == f"interrupted: {out} keeps what was prepared; run the same command again to resume\n"
    proc = run_prepare(*args, "--workers", 1, "--out", out)  # another worker count
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert "resuming at input file 1" in proc.stdout.read()
    assert files_of(out) == ref


def sigint_held_off(pid: int) -> bool:
    """Whether pid's main thread ignores or blocks SIGINT now (/proc/PID/status)."""
    masks = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                 if line.startswith(("SigIgn:", "SigBlk:")))
    return bool((int(masks["SigIgn"], 16) | int(masks["SigBlk"], 16)) & 1 << (signal.SIGINT - 1))


def _until(condition, proc) -> None:
    while not condition() and proc.poll() is None:
        time.sleep(0.001)


def _opened_a_shard(pid: int) -> bool:
    """Whether pid holds a partial shard open (/proc/PID/fd): its writers exist, the pool is next."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(fd).endswith(".partial"):
                return True
    return False


def test_ctrl_c_from_0_s_on_is_never_ignored(tmp_path, big):
    """Issue 39: a Ctrl-C at any instant of `prepare` stops it with exit 130 and one `interrupted`
    line, never a run that goes on to meta.json: one while the workers were spawned (0.2-0.4 s in,
    SIGINT ignored then) was dropped. The instants: 0 s after the process starts (Python itself may
    still be starting: then its default action kills it, or its start-up fails on the interrupt); its
    first line on stdout (jaxgpt imported, arguments read); while it holds SIGINT off to spawn its
    workers (/proc/PID/status, once its shards are open); 0.1 s and 0.5 s after it opens its first
    partial shard. Before each Ctrl-C the process is frozen (SIGSTOP: the main process only, as a
    vfork child stopped before its exec would hold its parent) and checked to be running without a
    meta.json, so each Ctrl-C lands where the preparation must still stop. All share one --out,
    which the same command then finishes to the uninterrupted bytes."""
    args, ref = big
    out = tmp_path / "out"
    resumable = {f"interrupted: {out} keeps what was prepared; run the same command again to resume\n",
                 "interrupted: run the same command again to prepare\n"}
    instants = {"0 s": lambda proc: None,
                "first line": lambda proc: proc.stdout.readline(),
                "spawning workers": lambda proc: _until(lambda: _opened_a_shard(proc.pid) and sigint_held_off(proc.pid),
                                                        proc),  # not OpenBLAS's start, which blocks it too
                "0.1 s after the first shard": lambda proc: (_until(lambda: _opened_a_shard(proc.pid), proc),
                                                             time.sleep(0.1)),
                "0.5 s after the first shard": lambda proc: (_until(lambda: _opened_a_shard(proc.pid), proc),
                                                             time.sleep(0.5))}
    for instant, wait in instants.items():
        for _ in range(5):  # the worker spawn's window can pass between seeing it and the freeze
            proc = run_prepare(*args, "--workers", 2, "--out", out, start_new_session=True)
            try:
                wait(proc)
                assert proc.poll() is None, (instant, proc.stderr.read())
                os.kill(proc.pid, signal.SIGSTOP)
                assert stopped(proc.pid) and not (out / writer.META).exists(), instant
                if instant != "spawning workers" or sigint_held_off(proc.pid):
                    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
                    os.kill(proc.pid, signal.SIGCONT)
                    try:
                        code = proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:  # say where it hung (CI at 8dc5899 met this once)
                        status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                        raise AssertionError((instant, "still running 60 s after its Ctrl-C",
                                              [line for line in status if line.startswith(("State", "Sig"))])) from None
                    err = proc.stderr.read()
                    break
            finally:
                if proc.poll() is None:  # missed the window, or a failed assertion: leave nothing behind
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=60)
        else:
            raise AssertionError("the worker spawn was never caught holding SIGINT off")
        assert code != 0 and not (out / writer.META).exists(), (instant, err)
        if instant == "0 s" and code != 130:
            continue  # Python itself was still starting: its default action, or its start-up failing
        starting = {INTERRUPTED + "\n"} if instant == "0 s" else set()  # jaxgpt/__init__.py's, while importing
        assert code == 130 and err in resumable | starting, (instant, code, err)
    proc = run_prepare(*args, "--workers", 1, "--out", out)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert files_of(out) == ref


def test_kill_9_at_half_a_second_then_the_same_command_finishes(tmp_path, big):
    args, ref = big
    out = tmp_path / "out"
    proc = run_prepare(*args, "--workers", 2, "--out", out)
    time.sleep(0.5)  # interpreter start-up: hashing, or the first batch, or before anything
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc = run_prepare(*args, "--workers", 1, "--out", out)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert files_of(out) == ref


def test_ctrl_c_that_lands_in_a_finalizer_still_interrupts(tmp_path, monkeypatch, capfd):
    """Python drops an exception raised inside a __del__ (multiprocessing's pipes and pool have
    them; garbage collection runs them anywhere) and prints "Exception ignored": a Ctrl-C landing
    there would let the preparation finish and exit 0. It is remembered and raised again, silently."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(DOCS[:300]))

    class Finalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, handled at the next bytecode: in here
            sum(range(1000))

    real_commit = corpus_module._Run.commit

    def commit(self, *args):
        real_commit(self, *args)
        Finalizer()  # collected at once

    monkeypatch.setattr(corpus_module._Run, "commit", commit)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus([corpus], tmp_path / "out", **KW, batch_chars=20_000)
    assert "Exception ignored" not in capfd.readouterr().err
    assert not (tmp_path / "out" / writer.META).exists()


@pytest.mark.parametrize("moment", ["before the first record", "before meta.json", "after meta.json"])
def test_a_kill_at_the_start_or_the_end_resumes_to_the_same_bytes(tmp_path, monkeypatch, moment):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(DOCS[:600]))
    kw = dict(progress="lines", shard_tokens=4_000, batch_chars=20_000)
    prepare_corpus([corpus], tmp_path / "ref", workers=1, **kw)
    real_write, real_unlink = writer.write_json_atomically, Path.unlink

    def dies(path, obj):
        if moment == "before the first record" or (moment == "before meta.json" and path.name == writer.META):
            raise KeyboardInterrupt  # the process dies here
        real_write(path, obj)

    def dies_unlinking(self, *a, **k):
        if moment == "after meta.json" and self.name == writer.STATE:
            raise KeyboardInterrupt
        return real_unlink(self, *a, **k)

    monkeypatch.setattr("jaxgpt.data.corpus.write_json_atomically", dies)
    monkeypatch.setattr(Path, "unlink", dies_unlinking)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus([corpus], tmp_path / "out", workers=1, **kw)
    monkeypatch.undo()
    prepare_corpus([corpus], tmp_path / "out", workers=2, **kw)
    assert files_of(tmp_path / "out") == files_of(tmp_path / "ref")

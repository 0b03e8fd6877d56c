"""Properties of the data path: preparation, per-process batches, epochs, resumption, errors.

Synthetic token files are arange(N): window i then starts with token i * seq_len, which makes
each window's identity readable from its first token. No JAX needed.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxgpt import data, tokenizer
from jaxgpt.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / "jaxgpt" / "assets" / "tinyshakespeare.txt"


def window_ids(batch_BxT1, seq_len):
    return list(batch_BxT1[:, 0] // seq_len)


def take(it, n):
    return [next(it) for _ in range(n)]


# ---------------------------------------------------------------- tokenizer and prepare


def test_tokenizer_is_gpt2_offline():
    enc = tokenizer.gpt2_encoding()
    assert enc.n_vocab == 50257 and enc.eot_token == tokenizer.EOT_ID == 50256
    assert enc.encode_ordinary("hello world") == [31373, 995]  # GPT-2's known ids
    assert tokenizer.vocab_sha256() == (
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930")


def test_shakespeare_prepare_counts_roundtrip_and_determinism(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path / "cache"))
    bundled = data.resolve_data_dir("shakespeare")
    assert bundled.parent == tmp_path / "cache"
    meta = data.load_meta(bundled)
    assert (meta["train_tokens"], meta["val_tokens"]) == (301_966, 36_059)
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257
    assert meta["sources"] == ["tinyshakespeare.txt"]

    train, val = data.load_split(bundled, "train"), data.load_split(bundled, "val")
    assert train.dtype == np.dtype("<u2") and not train.flags.writeable
    assert (len(train), len(val)) == (301_966, 36_059)
    enc = tokenizer.gpt2_encoding()
    assert enc.decode(list(train)) + enc.decode(list(val)) == SHAKESPEARE.read_text()

    again = data.prepare([SHAKESPEARE], tmp_path / "again", val_fraction=0.1)
    assert again == meta
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "again" / name).read_bytes() == (bundled / name).read_bytes()
    # Second use of the cache does not prepare again.
    mtime = (bundled / "train.bin").stat().st_mtime_ns
    assert data.bundled_shakespeare_dir() == bundled
    assert (bundled / "train.bin").stat().st_mtime_ns == mtime


def test_prepare_joins_files_with_one_eot_and_splits_by_characters(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Hello there.\n" * 8)
    b.write_text("General Kenobi!\n" * 2)
    n_chars = len(a.read_text()) + len(b.read_text())  # 104 + 32; cut at int(136 * 0.75) = 102
    meta = data.prepare([a, b], tmp_path / "out", val_fraction=0.25)
    enc = tokenizer.gpt2_encoding()
    train = list(data.load_split(tmp_path / "out", "train"))
    val = list(data.load_split(tmp_path / "out", "val"))
    cut = int(n_chars * 0.75)
    assert enc.decode(train) == a.read_text()[:cut]
    assert val.count(tokenizer.EOT_ID) == 1
    assert enc.decode(val) == a.read_text()[cut:] + "<|endoftext|>" + b.read_text()
    assert meta["sources"] == ["a.txt", "b.txt"] and meta["val_tokens"] == len(val)


def test_prepare_into_existing_dir(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Some words to tokenize here.\n" * 20)
    out = tmp_path / "out"
    first = data.prepare([text], out)
    assert data.prepare([text], out) == first  # same preparation: kept, no error
    with pytest.raises(UserError, match="already exists"):
        data.prepare([text], out, val_fraction=0.5)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(UserError, match="already exists"):
        data.prepare([text], tmp_path / "junk")


def test_prepare_keeps_a_dir_that_appears_meanwhile(tmp_path, monkeypatch):
    """Another process publishing first (between our check and our rename) wins, no error."""
    text = tmp_path / "t.txt"
    text.write_text("Racing processes write the same bytes.\n" * 20)
    data.prepare([text], tmp_path / "winner")
    out = tmp_path / "out"
    real_rename = os.rename

    def rename_after_winner(src, dst):
        shutil.copytree(tmp_path / "winner", dst)
        (Path(dst) / "marker").write_text("winner's dir")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_after_winner)
    meta = data.prepare([text], out)
    assert (out / "marker").exists()  # the winner's dir is kept
    assert meta == data.load_meta(tmp_path / "winner")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # temp removed


# ---------------------------------------------------------------- training batches


def synthetic(n_windows, seq_len):
    return np.arange(n_windows * seq_len + 1, dtype="<u2")


def test_process_shards_are_disjoint_and_rebuild_the_global_batch():
    seq_len, global_batch, steps = 4, 8, 12  # 40 windows: 12 steps cross two epoch boundaries
    tokens = synthetic(40, seq_len)

    def batches(process_index, process_count):
        it = data.train_iterator(tokens, seq_len=seq_len, global_batch=global_batch, seed=3,
                                 process_index=process_index, process_count=process_count)
        return take(it, steps)

    reference = batches(0, 1)
    assert reference[0].shape == (global_batch, seq_len + 1) and reference[0].dtype == np.int32
    np.testing.assert_array_equal(reference[0][:, 1:], reference[0][:, :-1] + 1)  # true windows
    for process_count in (2, 4):
        shards = [batches(p, process_count) for p in range(process_count)]
        for step in range(steps):
            local = [shards[p][step] for p in range(process_count)]
            assert all(x.shape == (global_batch // process_count, seq_len + 1) for x in local)
            ids = [set(window_ids(x, seq_len)) for x in local]
            assert sum(map(len, ids)) == len(set().union(*ids)) == global_batch  # disjoint
            np.testing.assert_array_equal(np.concatenate(local), reference[step])


def test_each_epoch_is_a_fresh_permutation():
    seq_len, n_windows, global_batch = 3, 24, 6
    tokens = synthetic(n_windows, seq_len)

    def order(seed, epochs=2):
        it = data.train_iterator(tokens, seq_len=seq_len, global_batch=global_batch, seed=seed,
                                 process_index=0, process_count=1)
        steps = epochs * n_windows // global_batch
        return [int(i) for b in take(it, steps) for i in window_ids(b, seq_len)]

    seen = order(seed=0)
    epoch1, epoch2 = seen[:n_windows], seen[n_windows:]
    assert sorted(epoch1) == sorted(epoch2) == list(range(n_windows))
    assert epoch1 != epoch2
    assert epoch1 != list(range(n_windows))  # shuffled at all
    assert order(seed=0) == seen  # the seed fixes the order
    assert order(seed=1) != seen


def test_restored_iterator_yields_the_same_batches():
    seq_len, global_batch = 4, 4
    tokens = synthetic(30, seq_len)  # 30 windows: batches straddle epoch ends

    def make(process_index):
        return data.train_iterator(tokens, seq_len=seq_len, global_batch=global_batch, seed=7,
                                   process_index=process_index, process_count=2)

    for process_index in (0, 1):
        it = make(process_index)
        take(it, 5)
        state = it.get_state()
        expected = take(it, 20)
        restored = make(process_index)
        restored.set_state(state)
        for got, want in zip(take(restored, 20), expected, strict=True):
            np.testing.assert_array_equal(got, want)


def test_eval_batches_are_fixed_and_cover_windows_in_order():
    seq_len, n_windows, global_batch = 5, 10, 4
    tokens = synthetic(n_windows, seq_len)
    kwargs = dict(seq_len=seq_len, global_batch=global_batch, num_batches=4)
    single = data.eval_batches(tokens, process_index=0, process_count=1, **kwargs)
    assert [window_ids(b, seq_len) for b in single] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5]]  # wraps modulo 10 windows
    for b in single:
        for row, w in zip(b, window_ids(b, seq_len)):
            np.testing.assert_array_equal(row, tokens[w * seq_len:(w + 1) * seq_len + 1])
    shards = [data.eval_batches(tokens, process_index=p, process_count=2, **kwargs)
              for p in range(2)]
    for b in range(4):
        np.testing.assert_array_equal(np.concatenate([shards[0][b], shards[1][b]]), single[b])
    again = data.eval_batches(tokens, process_index=1, process_count=2, **kwargs)
    assert all(np.array_equal(x, y) for x, y in zip(again, shards[1], strict=True))


# ---------------------------------------------------------------- bad input


def write_prepared(directory, train_tokens, val_tokens, **meta_overrides):
    directory.mkdir()
    np.asarray(train_tokens, "<u2").tofile(directory / "train.bin")
    np.asarray(val_tokens, "<u2").tofile(directory / "val.bin")
    meta = {"tokenizer": "gpt2", "tokenizer_sha256": tokenizer.vocab_sha256(),
            "vocab_size": 50257, "train_tokens": len(train_tokens),
            "val_tokens": len(val_tokens), "sources": ["x.txt"], **meta_overrides}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def test_bad_data_dirs_raise_helpful_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"does not exist.*jaxgpt\.prepare"):
        data.resolve_data_dir(str(tmp_path / "nowhere"))

    partial = write_prepared(tmp_path / "partial", [1, 2, 3], [4, 5])
    (partial / "val.bin").unlink()
    with pytest.raises(UserError, match=r"lacks val\.bin.*jaxgpt\.prepare"):
        data.resolve_data_dir(str(partial))

    no_meta = write_prepared(tmp_path / "no_meta", [1, 2, 3], [4, 5])
    (no_meta / "meta.json").unlink()
    with pytest.raises(UserError, match=r"meta\.json"):
        data.load_split(no_meta, "train")

    empty = write_prepared(tmp_path / "empty", [1, 2, 3], [])
    assert data.resolve_data_dir(str(empty)) == empty
    with pytest.raises(UserError, match="no bytes"):
        data.load_split(empty, "val")

    other_vocab = write_prepared(tmp_path / "other", [1, 2], [3], tokenizer_sha256="0" * 64)
    with pytest.raises(UserError, match="was tokenized with another tokenizer .* than this run's data.tokenizer=gpt2"):
        data.open_splits(str(other_vocab))


def test_too_little_data_or_bad_batch_raise_user_errors(tmp_path):
    short = data.load_split(write_prepared(tmp_path / "short", [1, 2, 3, 4], [5]), "train")
    with pytest.raises(UserError, match="too few for one window"):
        data.train_iterator(short, seq_len=4, global_batch=2, seed=0,
                            process_index=0, process_count=1)
    with pytest.raises(UserError, match="too few for one window"):
        data.eval_batches(short, seq_len=8, global_batch=2, num_batches=1,
                          process_index=0, process_count=1)
    with pytest.raises(UserError, match="multiple of the process count"):
        data.train_iterator(synthetic(10, 2), seq_len=2, global_batch=6, seed=0,
                            process_index=0, process_count=4)


def test_prepare_rejects_bad_text_input(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(UserError, match="no text"):
        data.prepare([empty], tmp_path / "out")
    with pytest.raises(UserError, match="does not exist"):
        data.prepare([tmp_path / "missing.txt"], tmp_path / "out")
    with pytest.raises(UserError, match="between 0 and 1"):
        data.prepare([SHAKESPEARE], tmp_path / "out", val_fraction=0.0)
    one_char = tmp_path / "one.txt"
    one_char.write_text("a")
    with pytest.raises(UserError, match="split would be empty"):
        data.prepare([one_char], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def run_prepare_cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxgpt.prepare", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_prepare_cli(tmp_path):
    missing = run_prepare_cli(tmp_path / "missing.txt", "--out", tmp_path / "out")
    assert missing.returncode == 2
    assert "Traceback" not in missing.stderr
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "missing.txt" in lines[0]

    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 10)
    ok = run_prepare_cli(text, "--out", tmp_path / "out", "--val-fraction", "0.2", "--separator", "\\n")
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.strip().splitlines()  # progress, then the summary; stderr is for errors
    assert lines[0] == "prepare: hashing 1 input file" and len(lines) == 2 and str(tmp_path / "out") in lines[1]
    assert ok.stderr == ""
    meta = data.load_meta(tmp_path / "out")
    assert meta["val_fraction"] == 0.2 and (meta["train_documents"], meta["val_documents"]) == (8, 2)

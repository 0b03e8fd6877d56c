"""Bad input through the real command line: one clear `error:` line, no traceback, non-zero exit.
And one real end-to-end run on a 2 x 2 x 2 mesh writing metrics.jsonl."""

from __future__ import annotations

import json

import pytest
from helpers import TINY, read_metrics, run_cli

from jaxgpt.cli import EXIT_DIVERGED, EXIT_USER_ERROR


def _assert_one_line_error(proc, *fragments: str, code: int = EXIT_USER_ERROR) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture(scope="module")
def empty_data_dir(tmp_path_factory, shakespeare_dir):
    d = tmp_path_factory.mktemp("empty-data")
    (d / "meta.json").write_text((shakespeare_dir / "meta.json").read_text())
    (d / "train.bin").write_bytes(b"")
    (d / "val.bin").write_bytes((shakespeare_dir / "val.bin").read_bytes())
    return d


@pytest.mark.parametrize("args, fragments", [
    (["model.n_layr=2"], ["unknown config key 'model.n_layr'", "did you mean 'model.n_layer'"]),
    (["train.steps=many"], ["'train.steps' wants an int"]),
    (["--config", "gpt3"], ["config file 'gpt3' not found"]),
    (["--mesh", "dp=3"], ["has 3 devices but 8 are available"]),
    (["--mesh", "dp=2,fsdp=2,tq=2"], ["unknown axis 'tq'", "did you mean 'tp'"]),
    (["--mesh", "dp=8", "train.batch_size=12"], ["does not split over dp x fsdp = 8"]),
    (["--mesh", "dp=4,tp=2", "model.n_head=3", "model.n_embd=48"], ["model.n_head=3 is not divisible by the tp axis"]),
    (["--mesh", "dp=8", "model.vocab_size=1000"], ["50257 tokens", "model.vocab_size"]),
    (["--mesh", "dp=8", "data.path=/nonexistent/data"], ["/nonexistent/data"]),
    (["--no-such-flag"], ["unrecognized arguments"]),
])
def test_bad_input_is_one_clear_line(args, fragments, tmp_path):
    proc = run_cli("--run-dir", str(tmp_path / "run"), *args)
    _assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing ran


def test_empty_data_is_one_clear_line(empty_data_dir, tmp_path):
    proc = run_cli("--run-dir", str(tmp_path), "--mesh", "dp=8", f"data.path={empty_data_dir}")
    _assert_one_line_error(proc, "train")


def test_non_finite_loss_stops_with_its_own_code(tmp_path):
    proc = run_cli("--run-dir", str(tmp_path), "--mesh", "dp=8", *TINY, "train.steps=30",
                   "optimizer.lr=1e12", "optimizer.grad_clip=0", "optimizer.warmup_steps=0")
    _assert_one_line_error(proc, "the loss became", code=EXIT_DIVERGED)


def test_help_lists_every_key():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for key in ["model.n_layer", "model.seq_len", "train.batch_size", "train.grad_accum", "mesh.fsdp",
                "optimizer.lr", "data.path", "logging.every"]:
        assert key in proc.stdout


def test_end_to_end_run_writes_metrics(tmp_path):
    proc = run_cli("--run-dir", str(tmp_path), "--mesh", "dp=2,fsdp=2,tp=2", *TINY, "train.steps=4",
                   "train.eval_every=2", "train.eval_batches=2")
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(tmp_path)
    train_lines = [r for r in records if "loss" in r]
    eval_lines = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train_lines] == [1, 2, 3, 4]
    assert [r["step"] for r in eval_lines] == [0, 2, 4]
    for r in train_lines:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu"} <= set(r)
        assert r["mfu"] is None  # no peak FLOP/s is known for CPUs
    assert all(r["tokens_per_sec"] > 0 for r in train_lines[1:])
    assert "tok/s" in proc.stdout
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0

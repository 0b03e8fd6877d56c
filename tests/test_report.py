"""Run tracking and the run report: TensorBoard scalars, events.jsonl, report.md and loss.png, the
report command, restarts, profiling, the progress bar, and the W&B error.

TensorBoard event files are read back without TensorBoard (not a dependency): a TFRecord file is a
sequence of [uint64 length][uint32 crc][length bytes of an Event proto][uint32 crc] records, and
tensorboardX ships the Event proto."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import sys
import types
from pathlib import Path

import pytest
from helpers import TINY, TINY_TOKENIZER, main_in_process, read_metrics, run_cli, tiny_config

from jaxgpt.cli import EXIT_USER_ERROR
from jaxgpt.train import train

FIRST = ("train.steps=4", "train.eval_every=2", "checkpoint.every=2", "logging.profile_steps=2:3")


def _scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                if v.WhichOneof("value") == "simple_value":
                    out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _row(report: str, name: str) -> str:
    return next(line for line in report.splitlines() if line.startswith(f"| {name} |"))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, shakespeare_dir):
    run_dir = tmp_path_factory.mktemp("first")
    train(tiny_config(*FIRST, mesh="dp=8"), run_dir)
    return run_dir


def test_tensorboard_has_the_metrics_scalars(first_run):
    scalars, metrics = _scalars(first_run / "tb"), read_metrics(first_run)
    train_lines = [r for r in metrics if "loss" in r]
    for key, tag in [("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm")]:
        assert scalars[tag] == {r["step"]: pytest.approx(r[key], rel=1e-6) for r in train_lines}
    assert set(scalars["perf/tokens_per_sec"]) == {r["step"] for r in train_lines if r["tokens_per_sec"] is not None}
    assert "perf/mfu" not in scalars  # null on CPU: not written
    assert scalars["val/loss"] == {r["step"]: pytest.approx(r["val_loss"], rel=1e-6) for r in metrics
                                   if "val_loss" in r}


def test_events_and_report(first_run):
    events = _events(first_run)
    assert [e["event"] for e in events] == ["start", "end"]
    start = events[0]
    assert start["step"] == 0 and start["mesh"] == {"pp": 1, "dp": 8, "fsdp": 1, "cp": 1, "ep": 1, "tp": 1} and start["devices"] == 8
    assert start["process_count"] == 1 and start["device_kind"] and start["time"] <= events[1]["time"]
    assert events[1]["step"] == 4

    report = (first_run / "report.md").read_text()
    metrics = read_metrics(first_run)
    last_val = [r for r in metrics if "val_loss" in r][-1]["val_loss"]
    last_loss = [r for r in metrics if "loss" in r][-1]["loss"]
    assert "8 × cpu" in _row(report, "accelerator")
    assert "1 process" in _row(report, "hosts")
    assert "pp=1, dp=8, fsdp=1, cp=1, ep=1, tp=1" in _row(report, "mesh")
    assert "unknown" in _row(report, "interconnect")
    assert "512 tokens per step" in _row(report, "effective batch")  # 16 sequences x 32 tokens
    assert "32" in _row(report, "sequence length")
    assert "float32 compute, fp8 off" in _row(report, "precision")
    assert "xla" in _row(report, "attention kernel")
    assert "every 2 steps, keep 3, async" in _row(report, "checkpoints")
    assert f"{last_val:.4f} (step 4)" in _row(report, "final val loss")
    assert f"{last_loss:.4f} (step 4)" in _row(report, "final train loss")
    assert _row(report, "restarts") == "| restarts | 0 |" and _row(report, "preemptions") == "| preemptions | 0 |"
    assert "over 1 session" in _row(report, "wall time")
    assert _row(report, "data").startswith("| data | the bundled shakespeare (`")
    assert _row(report, "data").endswith(f"`): {TINY_TOKENIZER} tokens, 422,136 train + 50,760 val |")
    assert start["data_sources"][0]["train_tokens"] == 422_136
    assert "| tokens/s |" in report and "MFU | n/a" in report and "Slow intervals" in report

    png = (first_run / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_profile_trace_is_written(first_run):
    traces = list((first_run / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0


def test_report_command_regenerates_and_rejects_a_missing_dir(first_run, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(first_run, run_dir, ignore=shutil.ignore_patterns("checkpoints", "profile", "tb"))
    (run_dir / "report.md").unlink()
    (run_dir / "loss.png").unlink()
    proc = main_in_process(str(run_dir), module="jaxgpt.report")
    assert proc.returncode == 0, proc.stderr
    def body(path: Path) -> list[str]:  # all but the title and the run dir's path
        return path.read_text().splitlines()[3:]

    assert body(run_dir / "report.md") == body(first_run / "report.md")
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"

    missing = main_in_process(str(tmp_path / "nope"), module="jaxgpt.report")
    assert missing.returncode == EXIT_USER_ERROR and missing.stderr.strip().count("\n") == 0
    assert missing.stderr.startswith("error: ") and "does not exist" in missing.stderr


def test_resumed_run_counts_a_restart_and_draws_a_bar(first_run, tmp_path, capsys):
    shutil.copytree(first_run, tmp_path, dirs_exist_ok=True)
    train(tiny_config(*FIRST[:-1], "train.steps=6", "logging.progress=bar", mesh="dp=8"), tmp_path)
    assert [e["event"] for e in _events(tmp_path)] == ["start", "end", "start", "resume", "end"]
    report = (tmp_path / "report.md").read_text()
    assert _row(report, "restarts") == "| restarts | 1 |"
    assert "over 2 sessions" in _row(report, "wall time")
    assert "resumed at step 4" in report
    out = capsys.readouterr().out
    assert "\r" in out and "6/6" in out  # tqdm redraws in place
    assert "step      5 | loss" not in out  # train lines go to the bar, not the console
    assert _scalars(tmp_path / "tb")["train/loss"].keys() == {1, 2, 3, 4, 5, 6}


def test_non_tty_output_is_plain_lines(tmp_path, shakespeare_dir):
    proc = run_cli("--run-dir", str(tmp_path), "--mesh", "dp=8", *TINY, "train.steps=2")
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout and "\x1b" not in proc.stdout
    assert [line.split("|")[0].split() for line in proc.stdout.splitlines() if line.startswith("step")] == [
        ["step", "1"], ["step", "2"]]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_wandb_is_one_line(tmp_path):
    proc = run_cli("--run-dir", str(tmp_path / "run"), "--mesh", "dp=8", *TINY, "logging.wandb=true")
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: logging.wandb=true needs the wandb package")
    assert not (tmp_path / "run").exists()  # stopped before anything ran


def test_wandb_gets_the_same_scalars(tmp_path, monkeypatch, shakespeare_dir):
    """Against a stand-in module: what jaxgpt hands W&B, not W&B itself (no network in tests)."""
    runs = []

    class Run:
        def __init__(self, **kwargs):
            self.init, self.logged, self.exit_code = kwargs, {}, None
            runs.append(self)

        def log(self, data, step):
            self.logged.setdefault(step, {}).update(data)

        def finish(self, exit_code=0):
            self.exit_code = exit_code

    stub = types.SimpleNamespace(init=lambda **kw: Run(**kw), util=types.SimpleNamespace(generate_id=lambda: "id42"))
    monkeypatch.setitem(sys.modules, "wandb", stub)
    # first_run's 4 steps: its compiled step serves (tests/conftest.py)
    train(tiny_config("train.steps=4", "logging.wandb=true", "logging.wandb_project=p", mesh="dp=8"), tmp_path)
    (run,) = runs
    assert run.init["project"] == "p" and run.init["id"] == "id42" and run.init["config"]["train"]["steps"] == 4
    assert {s: d["train/loss"] for s, d in run.logged.items()} == {r["step"]: r["loss"] for r in read_metrics(tmp_path) if "loss" in r}
    assert run.exit_code == 0 and _events(tmp_path)[0]["wandb_id"] == "id42"


def test_profiling_turns_off_gpu_command_buffers_unless_the_user_set_them(monkeypatch, tmp_path):
    """So that a GPU trace shows kernels, not one event per CUDA graph launch: `train` with
    logging.profile_steps adds the flag before its backend starts (XLA:CPU accepts it and traces)."""
    from jaxgpt.tracking import kernels_in_traces

    proc = run_cli("--run-dir", str(tmp_path), *TINY, "train.steps=2", "logging.profile_steps=2:2")
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    kernels_in_traces()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_gpu_enable_command_buffer="
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    kernels_in_traces()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=FUSION"


def test_bad_profile_steps_is_a_user_error(tmp_path):
    proc = main_in_process("--run-dir", str(tmp_path / "run"), *TINY, "logging.profile_steps=3")
    assert proc.returncode == EXIT_USER_ERROR and proc.stderr.startswith("error: logging.profile_steps must be")


@pytest.mark.parametrize("kind, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12), ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H200", "fp8", 1979e12), ("NVIDIA L40S", "bfloat16", 362e12), ("NVIDIA L40", "bfloat16", 181e12), ("NVIDIA L4", "bfloat16", 121e12),
    ("NVIDIA H100 NVL", "bfloat16", 835e12), ("NVIDIA GB200", "bfloat16", 2500e12), ("NVIDIA B200", "fp8", 4500e12),
    ("TPU v5 lite", "bfloat16", 197e12), ("TPU v5", "bfloat16", 459e12),
    ("NVIDIA A100-SXM4-80GB", "fp8", None), ("cpu", "bfloat16", None)])
def test_peak_flops_takes_the_most_specific_device_name(kind, precision, peak):
    from jaxgpt.metrics import peak_flops  # MFU's denominator; null (None) where the peak is unknown
    assert peak_flops(types.SimpleNamespace(device_kind=kind), precision) == peak


def test_a_non_finite_time_in_events_is_an_unknown_duration():
    from jaxgpt.report import _duration  # JSON lets a hand-edited events.jsonl hold NaN or Infinity
    assert [_duration(x) for x in (float("nan"), float("inf"), 59.94, 3725)] == ["unknown", "unknown", "59.9s",
                                                                                 "1h 02m 05s"]

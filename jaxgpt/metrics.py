"""FLOPs, MFU, and the metrics log.

FLOPs per token follow the PaLM/nanoGPT count: 6N for the matmuls of forward and backward (N the
parameters touched per token: everything but the position embedding, the tied output head
included once) plus 12 * L * T * D for the attention scores and the weighted sum
(QK^T and AV, forward and backward, causal masking not discounted). For an MoE model N counts the
*active* parameters: the router and moe_top_k of the E experts per MoE block (the one-hot dispatch
and combine einsums are not counted). MFU is achieved FLOP/s over the
accelerator's dense peak from `PEAK_FLOPS`; it is null where the peak is unknown (CPUs).

`metrics.jsonl` holds one JSON object per line: train lines carry step, loss, lr, grad_norm,
tokens_per_sec, mfu, step_time and data_wait (each a list, one value per process: seconds per step
and seconds per step waiting for input over the log interval; jaxgpt/resilience/watchdog.py), and
for an MoE model moe_aux_loss, moe_z_loss and moe_dropped (`loss` stays the cross-entropy alone;
jaxgpt/model/moe.py), with model.document_mask docs_per_window and masked_pairs
(jaxgpt/model/documents.py); evaluation lines carry step, val_loss, val_bpb (bits per byte; null if
no val label is text) and, with eval.tasks, task/NAME/acc and task/NAME/acc_norm; goodput lines, at
every checkpoint.every step and the last, carry step, goodput, goodput/wall_s and goodput/PART_s
(jaxgpt/resilience/goodput.py). Other tools (and `jaxgpt.report`) read these names, so nothing else goes into this file: run events (start, resume, end, ...) live in
`events.jsonl` (`jaxgpt.tracking`), and TensorBoard / W&B / the progress bar are fed the same
records by `tracking.Tracker`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import jax

from jaxgpt.config import ModelConfig
from jaxgpt.model import param_count

# Dense (no sparsity) peak FLOP/s per device for bf16 and fp8 matmuls, from the vendors' data
# sheets, by a substring of `device.device_kind` ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
# "TPU v5 lite"). The first match wins, so a more specific name comes before the one it contains
# ("H100 PCIe" before "H100", "GB200" before "B200", "L40" before "L4", "TPU v5 lite" before "TPU v5").
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bfloat16": 756e12, "fp8": 1513e12},
    "H100 NVL": {"bfloat16": 835e12, "fp8": 1671e12},
    "H100": {"bfloat16": 989e12, "fp8": 1979e12},   # SXM
    "H200 NVL": {"bfloat16": 835e12, "fp8": 1671e12},
    "H200": {"bfloat16": 989e12, "fp8": 1979e12},   # SXM, also GH200
    "H800 PCIe": {"bfloat16": 756e12, "fp8": 1513e12},
    "H800": {"bfloat16": 989e12, "fp8": 1979e12},
    "GB200": {"bfloat16": 2500e12, "fp8": 5000e12},
    "B200": {"bfloat16": 2250e12, "fp8": 4500e12},
    "A100": {"bfloat16": 312e12},
    "L40S": {"bfloat16": 362e12, "fp8": 733e12},
    "L40": {"bfloat16": 181e12, "fp8": 362e12},
    "L4": {"bfloat16": 121e12, "fp8": 242e12},
    "TPU v4": {"bfloat16": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12},             # v5e
    "TPU v5": {"bfloat16": 459e12},                  # v5p
    "TPU v6 lite": {"bfloat16": 918e12},             # v6e (Trillium)
}


def flops_per_token(cfg: ModelConfig) -> float:
    n = param_count(cfg, include_position=False, active=True)  # MoE: the top-k experts a token uses
    return 6 * n + 12 * cfg.n_layer * cfg.seq_len * cfg.n_embd


def peak_flops(device: jax.Device, precision: str = "bfloat16") -> float | None:
    """Peak FLOP/s of one device, or None when the accelerator is not in the table."""
    kind = getattr(device, "device_kind", "")
    for name, peaks in PEAK_FLOPS.items():
        if name in kind:
            return peaks.get(precision)
    return None


def mfu(tokens_per_sec: float | None, cfg: ModelConfig, n_devices: int, peak: float | None) -> float | None:
    if peak is None or tokens_per_sec is None:
        return None
    return tokens_per_sec * flops_per_token(cfg) / (n_devices * peak)


class MetricsLog:
    """Appends JSON lines to run_dir/metrics.jsonl and prints a short line (unless `echo` is off: a
    progress bar shows them instead), on process 0 only."""

    def __init__(self, run_dir: Path, enabled: bool, echo: bool = True):
        self.enabled, self.echo = enabled, echo
        self.path = Path(run_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Logs `record` with non-finite floats as null; returns what was logged (None when disabled).
        A goodput row is not echoed: the run prints the final figures once, at its end."""
        if not self.enabled:
            return None
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.echo and "goodput" not in record:
            print(format_record(record), flush=True)
        return record


def format_record(r: dict[str, Any]) -> str:
    """The console line for a train or eval record."""
    if "val_loss" in r:
        line = f"step {r['step']:>6} | val_loss {'nan' if r['val_loss'] is None else format(r['val_loss'], '.4f')}"
        if "val_bpb" in r:
            line += f" | val_bpb {'n/a' if r['val_bpb'] is None else format(r['val_bpb'], '.4f')}"
        for key, value in r.items():  # task/NAME/acc, task/NAME/acc_norm
            if key.startswith("task/"):
                line += f" | {key.removeprefix('task/')} {value:.4f}"
        return line
    def num(key: str, spec: str) -> str:  # a non-finite value is logged as null
        return "nan" if r.get(key) is None else format(r[key], spec)

    mfu_s = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
    rate = f"{r['tokens_per_sec']:,.0f}" if r.get("tokens_per_sec") is not None else "(compiling)"
    return (f"step {r['step']:>6} | loss {num('loss', '.4f')} | lr {num('lr', '.2e')} | grad_norm "
            f"{num('grad_norm', '.3f')} | {rate} tok/s | mfu {mfu_s}"
            + (f" | moe aux {num('moe_aux_loss', '.3f')} z {num('moe_z_loss', '.3f')} dropped "
               f"{num('moe_dropped', '.1%')}" if "moe_aux_loss" in r else "")
            + (f" | docs/window {num('docs_per_window', '.2f')} masked {num('masked_pairs', '.1%')}"
               if "docs_per_window" in r else ""))


# Keys whose values are timings: a resumed run writes them again with other values (everything else
# in its rows is the uninterrupted run's).
TIMING_KEYS = ("tokens_per_sec", "mfu", "step_time", "data_wait", "goodput")


def timing_key(key: str) -> bool:
    return key in TIMING_KEYS or key.startswith("goodput/")


class Throughput:
    """Tokens/s between two log points, timed on the host without extra device syncs."""

    def __init__(self) -> None:
        self.t0, self.step0 = time.perf_counter(), None

    def reset(self, step: int) -> None:
        self.t0, self.step0 = time.perf_counter(), step

    def tokens_per_sec(self, step: int, tokens_per_step: int) -> float | None:
        """None when no timed step has passed since the last reset (the compiling first step)."""
        now = time.perf_counter()
        rate = (step - self.step0) * tokens_per_step / (now - self.t0) if step > self.step0 else None
        self.t0, self.step0 = now, step
        return rate

"""Where a run's numbers go besides metrics.jsonl, the run's event log, and profiling.

`Tracker.write(record)` takes the records `metrics.MetricsLog` writes to metrics.jsonl (train:
step, loss, lr, grad_norm, tokens_per_sec, mfu; eval: step, val_loss, val_bpb, task/NAME/...) and hands the same values to

    console      one line per record, exactly as metrics.py prints them (`logging.progress=lines`,
                 and `auto` when stdout is not a terminal: CI, SLURM logs, pipes); or, on a
                 terminal, a tqdm bar with step/total, ETA, and the latest loss and tokens/s, eval
                 lines printed above it (`bar`, and `auto` on a terminal).
    RUN_DIR/tb/  TensorBoard event files (tensorboardX, no TensorFlow): train/loss, train/lr,
                 train/grad_norm, perf/tokens_per_sec, perf/mfu (when known), val/loss, val/bpb,
                 task/NAME/acc and task/NAME/acc_norm (eval.tasks), the
                 config as hparams (flattened `section.key`) and as YAML text. A resumed session
                 opens its writer with `purge_step` = the checkpoint step + 1, so TensorBoard drops
                 the earlier session's points after the checkpoint, as metrics.jsonl is trimmed.
    W&B          with `logging.wandb=true`: the same tags. The W&B run id is kept in the start
                 event, so a resumed run continues the same W&B run.

None of this touches the device. Records reach the tracker after `train._Loop.finish` has pulled
a step's metrics to the host, which it does anyway (one step late) to check the loss for NaN; the
bar advances from step numbers alone. TensorBoard's writer queues events for a background thread.

`RUN_DIR/events.jsonl` is the run's history across sessions, one JSON object per line, each with
`event` and a wall-clock `time` (Unix seconds): `start` (the step it starts from, mesh, devices,
device kind, process count, compute dtype, attention kernel, interconnect, config path, ...),
`resume` (step, checkpoint), `preempted` (step, checkpoint), `diverged` (step), `end` (step). A
start's `time` is when `train()` was entered, so a session's wall time includes start-up and
compilation. Unlike metrics.jsonl it is never trimmed on resume. `jaxgpt.report` reads it.

Everything here is process 0's job; on the other processes a Tracker does nothing. The one
exception is `require_wandb`, which every process calls so that all of them stop on the same error.

`logging.profile_steps=START:STOP` traces steps START..STOP with `jax.profiler` on process 0: the
trace starts before step START is dispatched and stops once step STOP's results are ready (one
device sync). jax writes RUN_DIR/profile/plugins/profile/<time>/<host>.xplane.pb (TensorBoard's
profile plugin, `tensorboard --logdir RUN_DIR/profile`) and <host>.trace.json.gz (Perfetto). Each
step is annotated with `StepTraceAnnotation`, so the profile plugin's step-time view works. Steps
in the trace run slower than untraced ones; their tokens/s in metrics.jsonl show it. On a GPU
such a run turns XLA's command buffers off for all its steps (`kernels_in_traces`), about 1% of
step time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import yaml

from jaxgpt import files
from jaxgpt.config import Config, LoggingConfig
from jaxgpt.data.sources import describe_sources
from jaxgpt.errors import UserError
from jaxgpt.metrics import MetricsLog, format_record

# What jaxgpt writes into a run dir; `check_run_dir` refuses a run dir where one is the wrong kind.
RUN_DIR_FILES = ("metrics.jsonl", "events.jsonl", "config.yaml", "report.md", "loss.png", "tasks.png", "data-verified.json")
RUN_DIR_DIRS = ("checkpoints", "tb", "profile")

TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "tokens_per_sec": "perf/tokens_per_sec", "mfu": "perf/mfu", "val_loss": "val/loss",
        "moe_aux_loss": "moe/aux_loss", "moe_z_loss": "moe/z_loss", "moe_dropped": "moe/dropped",  # MoE only
        "val_bpb": "val/bpb", "docs_per_window": "data/docs_per_window", "masked_pairs": "data/masked_pairs"}


def kernels_in_traces() -> None:
    """Adds `--xla_gpu_enable_command_buffer=` to XLA_FLAGS unless that flag is set already: XLA:GPU
    runs runs of kernels as CUDA graphs, and a trace then shows one `command_buffer_N` event per
    graph launch instead of the kernels in it. XLA reads XLA_FLAGS when the first backend starts,
    so this must come before that (not necessarily before `import jax`); no effect on a CPU."""
    if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()


def tags(record: dict[str, Any]) -> dict[str, Any]:
    """TensorBoard/W&B tag -> value of a record's non-null metrics; task/NAME/acc keeps its name."""
    out = {tag: record[key] for key, tag in TAGS.items() if record.get(key) is not None}
    return {**out, **{k: v for k, v in record.items() if k.startswith("task/") and v is not None}}


def require_wandb(cfg: LoggingConfig):
    """The wandb module when `logging.wandb=true` (UserError if it cannot be imported), else None."""
    if not cfg.wandb:
        return None
    try:
        import wandb
    except ImportError:
        raise UserError("logging.wandb=true needs the wandb package, which is not installed here; "
                        "pip install wandb, or set logging.wandb=false") from None
    return wandb


def check_run_dir(run_dir: Path, writing: bool = True) -> Path:
    """`run_dir` if jaxgpt can write its files there (before anything is compiled or written); with
    writing=False only that nothing there is the wrong kind (a reader's check)."""
    return files.writable_dir(run_dir, "run dir", files=RUN_DIR_FILES, dirs=RUN_DIR_DIRS, access=writing)


def flat_config(cfg: Config) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, body in cfg.to_dict().items() for k, v in body.items()}


# The events.jsonl keys that readers rely on, with their types (every event has `event` and `time`).
EVENT_SHAPE = {"event": str, "time": files.NUMBER}
EVENT_FIELDS = {"step": int, "mesh": dict, "devices": int, "process_count": int, "params": int, "fp8": bool,
                "device_kind": str, "platform": str, "compute_dtype": str, "attention": str, "attention_reason": str,
                "interconnect": str, "checkpoint": str, "wandb_id": str, "data_sources": list}


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        return []
    return files.read_jsonl(path, "event log", required=EVENT_SHAPE, optional=EVENT_FIELDS)


def interconnect(devices: list[jax.Device]) -> str:
    """What links the devices, where it can be found out; 'unknown' otherwise (never a guess)."""
    platform = devices[0].platform
    if platform == "tpu":
        slices = {getattr(d, "slice_index", 0) for d in devices}
        return "ICI" + (f" within each of {len(slices)} slices, DCN between them" if len(slices) > 1 else "")
    if platform != "gpu" or "NVIDIA" not in getattr(devices[0], "device_kind", "") or not shutil.which("nvidia-smi"):
        return "unknown"
    try:  # "Link 0: 26.562 GB/s" per active link, "Link 0: <inactive>" otherwise
        out = subprocess.run(["nvidia-smi", "nvlink", "--status", "-i", "0"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    links = re.findall(r"Link \d+: ([\d.]+) GB/s", out)
    if not out.strip():
        return "unknown"
    within = (f"NVLink ({len(links)} active links of {links[0]} GB/s on GPU 0)" if links
              else "no active NVLink on GPU 0 (PCIe or none)")
    return within + ("; between hosts: unknown" if jax.process_count() > 1 else "")


class Events:
    """Appends {event, time, ...} lines to RUN_DIR/events.jsonl."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path, self.enabled = Path(run_dir) / "events.jsonl", enabled

    def write(self, event: str, when: float | None = None, **fields: Any) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event, "time": round(when or time.time(), 3), **fields}) + "\n")


class _TensorBoard:
    def __init__(self, run_dir: Path, cfg: Config, start: int):
        from tensorboardX import SummaryWriter
        from tensorboardX.summary import hparams

        self.writer = SummaryWriter(logdir=str(run_dir / "tb"), purge_step=start + 1 if start else None,
                                    flush_secs=30)
        flat = {k: v for k, v in flat_config(cfg).items() if isinstance(v, (bool, int, float, str))}
        experiment, session_start, self.session_end = hparams(flat, {"train/loss": None, "val/loss": None})
        for summary in (experiment, session_start):
            self.writer._get_file_writer().add_summary(summary)
        config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        self.writer.add_text("config", "\n".join("    " + line for line in config_yaml.splitlines()), start)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in tags(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self, completed: bool) -> None:
        if completed:
            self.writer._get_file_writer().add_summary(self.session_end)
        self.writer.close()


class _WandB:
    def __init__(self, wandb, run_dir: Path, cfg: Config, run_id: str):
        self.wandb = wandb
        self.run = wandb.init(project=cfg.logging.wandb_project, name=run_dir.name, dir=str(run_dir),
                              config=cfg.to_dict(), id=run_id, resume="allow")

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(tags(record), step=record["step"])

    def close(self, completed: bool) -> None:
        self.run.finish(exit_code=0 if completed else 1)


class _Bar:
    """A tqdm bar on stdout, opened at the first record or step (so start-up messages print plainly)."""

    def __init__(self, start: int, total: int):
        self.start, self.total, self.bar = start, total, None

    def _open(self):
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, initial=self.start, unit="step", file=sys.stdout,
                            dynamic_ncols=True, smoothing=0.1)
        return self.bar

    def advance(self, step: int) -> None:
        bar = self._open()
        bar.update(step - bar.n)

    def write(self, record: dict[str, Any]) -> None:
        bar = self._open()
        if "val_loss" in record:
            bar.write(format_record(record), file=sys.stdout)
            return
        rate, loss = record.get("tokens_per_sec"), record.get("loss")
        bar.set_postfix_str(f"loss {'nan' if loss is None else format(loss, '.4f')}"
                            + (f", {rate:,.0f} tok/s" if rate is not None else ""))

    def say(self, message: str) -> None:
        if self.bar is None:
            print(message, flush=True)
        else:
            self.bar.write(message, file=sys.stdout)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Tracker:
    """Fans one run's metric records out to every sink, writes events, and runs the profiler."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, started: float | None = None):
        self.t0 = started or time.time()
        self.cfg, self.run_dir, self.enabled = cfg, Path(run_dir), enabled
        self.wandb_module = require_wandb(cfg.logging)
        mode = cfg.logging.progress
        self.use_bar = enabled and (mode == "bar" or (mode == "auto" and sys.stdout.isatty()))
        self.log = MetricsLog(run_dir, enabled, echo=not self.use_bar)
        self.events = Events(run_dir, enabled)
        self.sinks: list[Any] = []
        self.bar: _Bar | None = None
        self.profile, self.tracing = cfg.logging.profile_range if enabled else None, False

    def begin(self, start: int, info: dict[str, Any], resumed_from: Path | None) -> None:
        """Called once the starting step is known: writes start (and resume) events, opens the sinks."""
        if not self.enabled:
            return
        run_id = None
        if self.wandb_module is not None:
            earlier = [e["wandb_id"] for e in read_events(self.run_dir) if e.get("wandb_id")]
            run_id = earlier[-1] if earlier else self.wandb_module.util.generate_id()
        self.events.write("start", self.t0, step=start, **info, **({"wandb_id": run_id} if run_id else {}))
        if resumed_from is not None:
            self.events.write("resume", step=start, checkpoint=str(resumed_from))
        if self.cfg.logging.tensorboard:
            self.sinks.append(_TensorBoard(self.run_dir, self.cfg, start))
        if run_id is not None:
            self.sinks.append(_WandB(self.wandb_module, self.run_dir, self.cfg, run_id))
        if self.use_bar:
            self.bar = _Bar(start, self.cfg.train.steps)
        if self.profile is not None and not start < self.profile[0] <= self.cfg.train.steps:
            self.say(f"logging.profile_steps={self.cfg.logging.profile_steps}: step {self.profile[0]} is not "
                     f"among this session's steps ({start + 1}..{self.cfg.train.steps}); no profile is taken")

    def write(self, record: dict[str, Any]) -> None:
        logged = self.log.write(record)
        if logged is None:
            return
        for sink in self.sinks:
            sink.write(logged)
        if self.bar is not None:
            self.bar.write(logged)

    def advance(self, step: int) -> None:
        """Step `step` has finished (its metrics are on the host); moves the bar, never syncs."""
        if self.bar is not None:
            self.bar.advance(step)

    def event(self, name: str, **fields: Any) -> None:
        self.events.write(name, **fields)

    def say(self, message: str) -> None:
        if self.bar is not None:
            self.bar.say(message)
        elif self.enabled:
            print(message, flush=True)

    def step_annotation(self, step: int):
        """Context for dispatching `step`: starts the trace at START, names the step while tracing."""
        if self.profile is not None and step == self.profile[0]:
            jax.profiler.start_trace(str(self.run_dir / "profile"))
            self.tracing = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step) if self.tracing else contextlib.nullcontext()

    def step_done(self, step: int, metrics: Any) -> None:
        """After `step` was dispatched: at STOP, waits for its results and stops the trace."""
        if self.tracing and step == self.profile[1]:
            jax.block_until_ready(metrics)
            self._stop_trace()

    def _stop_trace(self) -> None:
        jax.profiler.stop_trace()
        self.tracing = False
        first, last = self.profile
        self.say(f"profile of steps {first}..{last} written to {self.run_dir / 'profile'}")

    def close(self, completed: bool = False) -> None:
        """Stops a trace still running and closes every sink (idempotent)."""
        if self.tracing:
            self._stop_trace()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(completed)


def run_info(cfg: Config, run_dir: Path, sizes: dict[str, int], devices: list[jax.Device], *, dtype: str,
             kernel: str, kernel_reason: str, params: int, peak: float | None) -> dict[str, Any]:
    """The start event's description of this session (called on process 0 only)."""
    return {"mesh": sizes, "devices": len(devices), "device_kind": getattr(devices[0], "device_kind", "unknown"),
            "platform": devices[0].platform, "process_count": jax.process_count(),
            "interconnect": interconnect(devices), "compute_dtype": dtype, "fp8": bool(cfg.model.fp8_linears()),
            "attention": kernel, "attention_reason": kernel_reason, "params": params,
            "peak_flops_per_device": peak, "config": str((Path(run_dir) / "config.yaml").absolute()),
            "command": sys.argv, "host": socket.gethostname(), "jax": jax.__version__,
            "data": cfg.data.chat or cfg.data.mix or cfg.data.path,
            "data_sources": describe_sources(cfg.data.path, cfg.data.mix, cfg.data.chat, cfg.data.tokenizer)}

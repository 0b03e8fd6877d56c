"""`python -m jaxgpt.report RUN_DIR`: RUN_DIR/report.md and RUN_DIR/loss.png from what a run left.

`train()` writes the report itself at the end of a run (completed, preempted or diverged); this
command regenerates it, for example for a run that was killed, and prints the run's goodput. It
reads three files and a directory:

    metrics.jsonl  train lines (loss, tokens_per_sec, mfu; with model.document_mask docs_per_window and
                   masked_pairs, summarised in a row) and eval lines (val_loss, val_bpb, and
                   task/NAME/acc, task/NAME/acc_norm with eval.tasks: a table and tasks.png, the
                   accuracies against training tokens = step x batch_size x seq_len)
    events.jsonl   one `start` per session with the hardware and layout it ran on, `resume`,
                   `preempted`, `diverged` and `end` (see jaxgpt.tracking), and `restart` when
                   `launch_multihost.sh --max-restarts` started the group again after a failure
    config.yaml    the latest session's resolved config: batch, sequence length, checkpoint
                   cadence, logging.every
    goodput/       one record per session of where its time went (jaxgpt/resilience/goodput.py):
                   the Goodput section, the parts of the wall clock since the run's first start
                   and goodput.png, a bar of them per session and for the run

Processes. With several processes each train line holds every process's seconds per step and
input-wait seconds per step (`step_time`, `data_wait`); the report lists their medians per process
and names a straggler: a process whose median input wait is over twice the others' and over a
tenth of a step.

Throughput. Each train line's tokens_per_sec is measured on the host over the log interval that
ends at that line: `logging.every` steps, fewer where an evaluation or a (re)start reset the timer.
The first line after each start or resume is null (it includes compilation) and is skipped, as are
MFU's nulls (no known peak FLOP/s, e.g. on CPU). Medians and p10/p90 are over those intervals. A
slow interval is one whose tokens/s is below half the median, i.e. it took more than twice as long
as a median interval: checkpoint saves, evaluations, input stalls or other jobs show up there.

Wall time is the sum over sessions of the time from a `start` to the session's `end`, `preempted`
or `diverged` event. A session with no such event (killed by SIGKILL or OOM, or still running) has
no known end: it is left out and the report says so. If no session has an end, the wall time is
the span from the first to the last event.

Nothing is guessed: what the run did not record (an older run dir without events.jsonl, the
interconnect on a CPU) reads "unknown", and so does a config.yaml value of the wrong type. A
metrics or events line that is not a JSON object with the expected types is an error naming the
file and line (`jaxgpt.files`), except a last line cut short by a kill, which is skipped. A run that
diverged before logging anything still gets a report from its events.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt import files
from jaxgpt.cli import ArgumentParser, path_arg, run_main
from jaxgpt.errors import UserError
from jaxgpt.resilience import goodput
from jaxgpt.tracking import check_run_dir, read_events

END_EVENTS = ("end", "preempted", "diverged")
MAX_SLOW_LISTED = 20


# metrics.jsonl: every line has an int step; the values, where present, are numbers or null (non-finite).
METRIC_FIELDS = {key: (*files.NUMBER, type(None)) for key in
                 ("loss", "val_loss", "val_bpb", "lr", "grad_norm", "tokens_per_sec", "mfu", "goodput")}
METRIC_FIELDS.update({"step_time": list, "data_wait": list})


def _load(run_dir: Path) -> tuple[list[dict], list[dict], dict[str, Any]]:
    files.require_dir(run_dir, "run dir")
    check_run_dir(run_dir, writing=False)  # wrong kinds only: report writes report.md and the plots alone
    path = run_dir / "metrics.jsonl"
    metrics = (files.read_jsonl(path, "metrics file", required={"step": int}, optional=METRIC_FIELDS)
               if path.exists() else [])
    for row in metrics:  # task/NAME/acc and task/NAME/acc_norm: numbers too
        files.check_shape(row, f"metrics file {path}: step {row['step']}",
                          optional={k: (*files.NUMBER, type(None)) for k in row if k.startswith("task/")})
    events = read_events(run_dir)
    if not metrics and not any(e["event"] == "start" for e in events):
        raise UserError(f"{run_dir} has no metrics in metrics.jsonl; is it a jaxgpt run dir that has trained?")
    config_path = run_dir / "config.yaml"
    cfg = files.read_yaml_mapping(config_path, "run config") if config_path.exists() else {}
    return metrics, events, cfg


def _sessions(events: list[dict]) -> list[tuple[dict, dict | None]]:
    """(start event, the event that ended it or None) for each session."""
    out: list[tuple[dict, dict | None]] = []
    for e in events:
        if e["event"] == "start":
            out.append((e, None))
        elif e["event"] in END_EVENTS and out and out[-1][1] is None:
            out[-1] = (out[-1][0], e)
    return out


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):  # a hand-edited events.jsonl ("time": NaN): JSON allows it, int() does not
        return "unknown"
    s = int(round(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m {s % 60:02d}s"


def _wall_time(events: list[dict]) -> str:
    sessions = _sessions(events)
    ended = [(s, e) for s, e in sessions if e is not None]
    if ended:
        total = sum(e["time"] - s["time"] for s, e in ended)
        open_ = len(sessions) - len(ended)
        note = (f"; {open_} session{'s' if open_ > 1 else ''} without an end event (killed, or still running) "
                f"not counted" if open_ else "")
        return f"{_duration(total)} over {len(ended)} session{'s' if len(ended) > 1 else ''}{note}"
    if len(events) > 1:
        return f"{_duration(events[-1]['time'] - events[0]['time'])} (first to last event; no session recorded its end)"
    return "unknown"


def _spread(values: list[float], fmt) -> str:
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return f"{fmt(p50)} | {fmt(p10)} | {fmt(p90)}"


def _get(cfg: dict, section: str, key: str, default: Any = None, kind: type = int) -> Any:
    """cfg[section][key] if it is a `kind` (never a bool for int), else `default`: a hand-edited
    config.yaml makes a line of the report "unknown", not a traceback."""
    body = cfg.get(section)
    value = body.get(key, default) if isinstance(body, dict) else default
    return value if type(value) is kind else default


def _setup_rows(start: dict | None, starts: list[dict], cfg: dict) -> list[tuple[str, str]]:
    s = start or {}
    unknown = "unknown"
    kind, platform, n = s.get("device_kind"), s.get("platform"), s.get("devices")
    accelerator = unknown if kind is None else (
        f"{n} × {kind}" + (f" ({platform})" if platform and platform.lower() not in kind.lower() else ""))
    mesh = ", ".join(f"{a}={v}" for a, v in s["mesh"].items()) if "mesh" in s else unknown
    earlier = {", ".join(f"{a}={v}" for a, v in e["mesh"].items()) for e in starts[:-1] if "mesh" in e} - {mesh}
    if earlier:
        mesh += f" (earlier sessions: {'; '.join(sorted(earlier))})"
    batch, seq = _get(cfg, "train", "batch_size"), _get(cfg, "model", "seq_len")
    accum = _get(cfg, "train", "grad_accum", 1)
    effective = (f"{batch * seq:,} tokens per step ({batch} sequences × {seq} tokens; grad_accum {accum})"
                 if batch and seq else unknown)
    fp8 = s.get("fp8", _get(cfg, "model", "fp8", kind=bool))
    precision = (f"{s.get('compute_dtype', unknown)} compute, fp8 {'on' if fp8 else 'off' if fp8 is not None else unknown}"
                 f" (parameters fp32)")
    attention = f"{s['attention']} ({s.get('attention_reason', '')})" if "attention" in s else unknown
    every, keep = _get(cfg, "checkpoint", "every"), _get(cfg, "checkpoint", "keep")
    saves = _get(cfg, "checkpoint", "async_save", kind=bool)
    cadence = unknown if every is None else (
        (f"every {every} steps" if every else "only at the end and on a stop request")
        + f", keep {keep}, {'async' if saves else 'sync'} saves")
    procs = s.get("process_count")
    return [("accelerator", accelerator),
            ("hosts", unknown if procs is None else f"{procs} process{'es' if procs > 1 else ''}"),
            ("mesh", mesh), ("interconnect", s.get("interconnect", unknown)),
            ("effective batch", effective), ("sequence length", str(seq) if seq else unknown),
            ("precision", precision), ("attention kernel", attention), ("checkpoints", cadence),
            ("parameters", f"{s['params'] / 1e6:.1f}M" if "params" in s else unknown),
            ("data", _data(s, cfg))]


def _data(start: dict, cfg: dict) -> str:
    """The data row: each directory with its tokenizer and token counts (and weight, in a mixture),
    as the start event recorded them; older runs' events lack them and show the config's names."""
    sources = start.get("data_sources")
    if not isinstance(sources, list) or not sources:
        mix, path = _get(cfg, "data", "mix", kind=str), _get(cfg, "data", "path", kind=str)
        return f"mixture {mix}" if mix else path or start.get("data") or "unknown"

    def one(d: dict) -> str:
        name = "the bundled shakespeare" if d.get("name") == "shakespeare" else None
        where = f"{name} (`{d.get('dir')}`)" if name else f"`{d.get('dir')}`"
        counts = [f"{d[k]:,} {k.split('_')[0]}" for k in ("train_tokens", "val_tokens") if isinstance(d.get(k), int)]
        docs = f", {d['documents']:,} documents" if isinstance(d.get("documents"), int) else ""
        return f"{where}: {d.get('tokenizer', 'unknown')} tokens, {' + '.join(counts)}{docs}"

    if not any("weight" in d for d in sources):
        return one(sources[0])
    return "mixture of " + "; ".join(f"{one(d)}, weight {d.get('weight', 0):.3g}" for d in sources)


def _throughput(train: list[dict], every: Any) -> list[str]:
    rates = [r["tokens_per_sec"] for r in train if r.get("tokens_per_sec") is not None]
    if not rates:
        return ["No timed log intervals yet (the first one after each start includes compilation)."]
    mfus = [r["mfu"] for r in train if r.get("mfu") is not None]
    out = ["| | median | p10 | p90 |", "|---|---|---|---|",
           f"| tokens/s | {_spread(rates, lambda v: f'{v:,.0f}')} |",
           f"| MFU | {_spread(mfus, lambda v: f'{100 * v:.1f}%')} |" if mfus else
           "| MFU | n/a: the accelerator's peak FLOP/s is not known | | |",
           "", f"Over {len(rates)} log intervals of up to `logging.every` = {every} steps each."]
    median = float(np.median(rates))
    slow = [r for r in train if r.get("tokens_per_sec") is not None and r["tokens_per_sec"] < median / 2]
    out += ["", "### Slow intervals", ""]
    if not slow:
        out.append(f"None: no log interval (of up to {every} steps) ran slower than twice the median time.")
        return out
    out.append(f"{len(slow)} log interval{'s' if len(slow) > 1 else ''} (of up to {every} steps) took more than "
               f"twice the median time, i.e. ran below half the median {median:,.0f} tokens/s:")
    out.append("")
    for r in slow[:MAX_SLOW_LISTED]:
        rate = r["tokens_per_sec"]
        out.append(f"- interval ending at step {r['step']}: {rate:,.0f} tokens/s ({rate / median:.2f} × median)")
    if len(slow) > MAX_SLOW_LISTED:
        out.append(f"- and {len(slow) - MAX_SLOW_LISTED} more")
    return out


def _history(events: list[dict]) -> list[str]:
    lines = []
    for e in events:
        if e["event"] == "restart":
            lines.append(f"- automatic restart {e['restart']} of {e.get('max_restarts', '?')} by the launcher "
                         f"(resuming at step {e['step']}): {e.get('reason') or 'reason unknown'}")
        elif e["event"] == "resume":
            lines.append(f"- restart: resumed at step {e['step']} from `{e.get('checkpoint', 'unknown')}`")
        elif e["event"] == "preempted":
            lines.append(f"- preempted at step {e['step']} (checkpoint committed)")
        elif e["event"] == "diverged":
            what = {"grad_norm": "gradient norm", "val_loss": "val loss"}.get(e.get("metric"), "loss")
            lines.append(f"- the {what} became non-finite at step {e['step']}; the run stopped")
    return lines or ["- none"]


def _goodput(sessions: list[dict]) -> list[str]:
    """The Goodput section: the parts of the wall clock since the first start, and one row per session."""
    if not sessions:
        return ["Not recorded (a run dir from before goodput was recorded)."]
    total = goodput.summarize(sessions)
    wall = total["wall"] or 1.0
    out = [f"**{100 * total['goodput']:.1f}%** of the {_duration(total['wall'])} since the run's first start trained "
           f"the model (productive steps whose results the run kept).", "",
           "| part | time | share |", "|---|---|---|"]
    out += [f"| {goodput.LABELS[p]} | {_duration(total[p])} | {100 * total[p] / wall:.1f}% |" for p in goodput.PARTS]
    out += ["", "| session | steps | wall | productive | then, until the next start |", "|---|---|---|---|---|"]
    for i, s in enumerate(sessions):
        gap = ("(the last)" if i + 1 == len(sessions) else "(the run was complete: not counted)" if s.get("completed")
               else _duration(sessions[i + 1]["start"] - s["time"]))
        out.append(f"| {i + 1} | {s['start_step']} → {s['step']} | {_duration(s['time'] - s['start'])} | "
                   f"{_duration(s['seconds'].get('step', 0.0))} | {gap} |")
    return out + ["", "![where the wall clock went](goodput.png)"]


def _processes(train: list[dict]) -> list[str]:
    """Per process medians of step time and input wait, and the straggler if one stands out."""
    rows = [r for r in train if isinstance(r.get("data_wait"), list) and isinstance(r.get("step_time"), list)
            and None not in r["data_wait"] and None not in r["step_time"]]
    count = max((len(r["data_wait"]) for r in rows), default=0)
    rows = [r for r in rows if len(r["data_wait"]) == count and len(r["step_time"]) == count]
    if count < 2 or not rows:
        return []
    steps = [float(np.median([r["step_time"][p] for r in rows])) for p in range(count)]
    waits = [float(np.median([r["data_wait"][p] for r in rows])) for p in range(count)]
    out = ["", "### Processes", "", "| process | step time (median) | input wait per step (median) |", "|---|---|---|"]
    out += [f"| {p} | {1000 * steps[p]:,.1f} ms | {1000 * waits[p]:,.2f} ms |" for p in range(count)]
    stragglers = [p for p in range(count) if waits[p] > 0.1 * steps[p]
                  and waits[p] > 2 * float(np.median([w for q, w in enumerate(waits) if q != p]))]
    out.append("")
    out.append(f"Straggler{'s' if len(stragglers) > 1 else ''}: process{'es' if len(stragglers) > 1 else ''} "
               f"{', '.join(map(str, stragglers))} wait{'' if len(stragglers) > 1 else 's'} for input longer than the "
               f"others: every process waits for it in the step's collectives." if stragglers else
               f"No straggler by input wait over {len(rows)} log intervals (a slow device slows every process alike).")
    return out


def render(run_dir: Path, metrics: list[dict], events: list[dict], cfg: dict,
           sessions: list[dict] | None = None) -> str:
    train = [r for r in metrics if r.get("loss") is not None]  # null: non-finite (older runs logged those)
    sessions = sessions or []
    evals = [r for r in metrics if r.get("val_loss") is not None]
    starts = [e for e in events if e["event"] == "start"]
    restarts = sum(e["event"] == "resume" for e in events)
    automatic = sum(e["event"] == "restart" for e in events)
    preemptions = sum(e["event"] == "preempted" for e in events)
    steps = _get(cfg, "train", "steps")
    last_step = max([r["step"] for r in metrics] + [e["step"] for e in events if "step" in e])
    rows = _setup_rows(starts[-1] if starts else None, starts, cfg)
    rows += [("steps", f"{last_step:,} of {steps:,}" if steps else f"{last_step:,}"),
             ("restarts", str(restarts)), ("automatic restarts", str(automatic)), ("preemptions", str(preemptions)),
             ("wall time", _wall_time(events)),
             ("goodput", f"{100 * goodput.summarize(sessions)['goodput']:.1f}% (see Goodput)" if sessions else "not recorded"),
             ("final train loss", f"{train[-1]['loss']:.4f} (step {train[-1]['step']})" if train else "none logged"),
             ("final val loss", f"{evals[-1]['val_loss']:.4f} (step {evals[-1]['step']})" if evals else "none logged")]
    bpb = [r for r in evals if r.get("val_bpb") is not None]
    if bpb:
        rows.append(("final val bits per byte", f"{bpb[-1]['val_bpb']:.4f} (step {bpb[-1]['step']})"))
    docs = [r for r in train if r.get("docs_per_window") is not None and r.get("masked_pairs") is not None]
    if docs:  # model.document_mask (jaxgpt/model/documents.py)
        rows.append(("document masking", f"{np.mean([r['docs_per_window'] for r in docs]):.2f} documents per window, "
                     f"{100 * np.mean([r['masked_pairs'] for r in docs]):.1f}% of causal attention pairs masked "
                     f"(mean of {len(docs)} logged steps)"))
    out = [f"# Run report: {run_dir.resolve().name}", "", f"`{run_dir.resolve()}`", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    out += ["", "## Throughput", ""] + _throughput(train, _get(cfg, "logging", "every", "unknown")) + _processes(train)
    out += ["", "## Restarts, preemptions, divergence", ""] + _history(events)
    out += ["", "## Goodput", ""] + _goodput(sessions)
    out += ["", "## Loss", "", "![train and val loss against step](loss.png)", ""]
    out += _tasks(metrics)
    return "\n".join(out)


def _task_points(metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """task/NAME/acc and task/NAME/acc_norm -> [(step, value)] in order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in metrics:
        for key, value in r.items():
            if key.startswith("task/") and value is not None:
                out.setdefault(key.removeprefix("task/"), []).append((r["step"], value))
    return out


def _tasks(metrics: list[dict]) -> list[str]:
    """The task section: each metric's latest value, and the plot of all of them."""
    points = _task_points(metrics)
    if not points:
        return []
    out = ["## Tasks", "", "| task metric | latest | step | best |", "|---|---|---|---|"]
    for name, values in points.items():
        step, last = values[-1]
        out.append(f"| {name} | {last:.4f} | {step:,} | {max(v for _, v in values):.4f} |")
    out += ["", "acc: the choice with the highest log-likelihood; acc_norm: per character of the choice "
            "(lm-evaluation-harness's definitions).", "", "![task accuracy against training tokens](tasks.png)", ""]
    return out


def plot_tasks(metrics: list[dict], tokens_per_step: int | None, path: Path, title: str) -> bool:
    """Task accuracy against training tokens (steps where the token count is unknown); False when
    the run has no task scores (no plot is written)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = _task_points(metrics)
    if not points:
        return False
    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    scale = tokens_per_step or 1
    for name, values in points.items():
        ax.plot([s * scale for s, _ in values], [v for _, v in values], "o-" if "norm" in name else "s--",
                label=name, markersize=3)
    ax.set(xlabel="training tokens" if tokens_per_step else "step", ylabel="accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    return True


def plot_loss(metrics: list[dict], path: Path, title: str) -> None:
    """Train and val loss against step, drawn with Agg (no display, no global pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    train = [(r["step"], r["loss"]) for r in metrics if r.get("loss") is not None]
    evals = [(r["step"], r["val_loss"]) for r in metrics if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="val", markersize=3)
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if train or evals:  # a run that diverged at its first step has nothing to draw
        ax.legend()
    fig.savefig(path, dpi=120)


def plot_goodput(sessions: list[dict], path: Path, title: str) -> bool:
    """Where the wall clock went: one stacked bar for the run and one per session (its own time, then
    the gap before the next start, as restarts); False when nothing was recorded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not sessions:
        return False
    bars = [("run", goodput.summarize(sessions))]
    for i, s in enumerate(sessions):
        part = goodput.summarize([s])
        if i + 1 < len(sessions) and not s.get("completed"):
            part["restarts"] += max(0.0, sessions[i + 1]["start"] - s["time"])
        bars.append((f"session {i + 1}", part))
    fig = Figure(figsize=(9, 2.2 + 0.35 * len(bars)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = dict(zip(goodput.PARTS, ("tab:green", "tab:orange", "tab:blue", "tab:purple", "tab:cyan", "tab:gray",
                                      "tab:red", "tab:brown")))
    for y, (_, parts) in enumerate(bars):
        left = 0.0
        for p in goodput.PARTS:
            ax.barh(y, parts[p], left=left, color=colors[p], label=goodput.LABELS[p] if y == 0 else None)
            left += parts[p]
    ax.set_yticks(range(len(bars)), [name for name, _ in bars])
    ax.invert_yaxis()
    ax.set(xlabel="seconds", title=f"{title}: goodput {100 * bars[0][1]['goodput']:.1f}%")
    fig.legend(loc="outside lower center", ncols=3, fontsize="small")
    fig.savefig(path, dpi=120)
    return True


def write_report(run_dir: Path) -> Path:
    """Writes RUN_DIR/report.md, RUN_DIR/loss.png and (where recorded) goodput.png; returns the report's path."""
    run_dir = Path(run_dir)
    metrics, events, cfg = _load(run_dir)
    sessions = goodput.read(run_dir)
    path = run_dir / "report.md"
    files.write_text_atomically(path, render(run_dir, metrics, events, cfg, sessions))
    plot_loss(metrics, run_dir / "loss.png", run_dir.resolve().name)
    plot_goodput(sessions, run_dir / "goodput.png", run_dir.resolve().name)
    batch, seq = _get(cfg, "train", "batch_size"), _get(cfg, "model", "seq_len")
    plot_tasks(metrics, batch * seq if batch and seq else None, run_dir / "tasks.png", run_dir.resolve().name)
    return path


def _main(argv: Sequence[str] | None) -> None:
    parser = ArgumentParser(prog="python -m jaxgpt.report", description="Write RUN_DIR/report.md and loss.png.",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=path_arg, help="a run dir written by python -m jaxgpt.train")
    run_dir = files.require_dir(parser.parse_args(argv).run_dir, "run dir")
    files.writable_dir(run_dir, "run dir", files=("report.md", "loss.png", "tasks.png", "goodput.png"))  # before reading it all
    path = write_report(run_dir)
    print(f"wrote {path} and {path.with_name('loss.png')}")
    if sessions := goodput.read(run_dir):
        print(goodput.line(goodput.summarize(sessions)))


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

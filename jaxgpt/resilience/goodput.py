"""Goodput: how much of the wall clock since a run's first start trained the model, and where the rest went.

Each session (one start of `train()`, on process 0) records its own time in
RUN_DIR/goodput/session-<start ms>.json, rewritten (atomically) at most once a second as steps
complete, at every checkpoint and at its end:

    start, start_step   when train() was entered (the `start` event's time) and the step it resumed at
    time, step          the last moment recorded and the last step completed by then
    seconds             the session's seconds per phase up to `time` (jaxgpt/resilience/clock.py),
                        which add up to time - start
    saves               [step, productive seconds so far] at each checkpoint it saved (the newest 64)
    completed           whether it trained the run's last step

`summarize` splits the wall clock, from the first session's start to the last one's `time`, into

    productive  a step's time (dispatch, the device's work, the metrics row), for steps whose
                result the run kept
    compile     the first step of each session, compiled then
    data        the host blocked on input (the device may overlap part of it: clock.py)
    checkpoint  saving, where it blocks the loop
    eval        evaluations
    startup     each session's start-up before its first step (validation, set-up, restore)
    restarts    the gaps between sessions: a failure's detection (a heartbeat or hang timeout), the
                launcher's restart, a requeue's wait, Python and JAX starting up again, and whatever
                a killed session did after its last record (under a second). Not the gap after a
                session that completed the run: a later one (more train.steps) continues a finished
                run, and the wall clock leaves that gap out
    lost        steps computed again after a failure: a session's productive time for the steps
                after the step the next session resumed from (the productive seconds at that step are
                in `saves`; between two records, interpolated by step)

so the parts add up to the wall clock exactly (up to clock differences between hosts, when process 0
moved to another host: a gap is never negative). goodput = productive / wall. train.py writes a
`goodput` row into metrics.jsonl at every persistent checkpoint and at the end (the values so far:
`goodput`, and `goodput/<part>_s`, `goodput/wall_s`), prints one line at the end, and the run report
(`python -m jaxgpt.report`) shows the parts with a plot. Only process 0's clock counts: the steps are
synchronous, so its phases are the group's, except input waits of other processes, which show as
their own `data_wait` in the train rows (watchdog.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from jaxgpt import files
from jaxgpt.resilience.clock import PhaseClock

DIR = "goodput"
PARTS = ("productive", "compile", "data", "checkpoint", "eval", "startup", "restarts", "lost")
LABELS = {"productive": "productive steps", "compile": "compile (first step of a session)", "data": "input wait",
          "checkpoint": "checkpoint saves", "eval": "evaluation", "startup": "start-up (set-up, restore)",
          "restarts": "restarts (detection, relaunch)", "lost": "lost work (steps computed again)"}
PHASE_PART = {"step": "productive", "compile": "compile", "data": "data", "checkpoint": "checkpoint",
              "eval": "eval", "startup": "startup"}
WRITE_EVERY_S = 1.0
KEEP_SAVES = 64


class Session:
    """Process 0's record of this session (module docstring); does nothing on the other processes."""

    def __init__(self, run_dir: Path, clock: PhaseClock, start_step: int, enabled: bool):
        self.clock, self.enabled = clock, enabled
        self.path = Path(run_dir) / DIR / f"session-{int(clock.started * 1000)}.json"
        self.start_step = self.step = start_step
        self.saves: list[list[float]] = []
        self.completed = False  # set when the session trained the run's last step
        self._written = 0.0
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, when: float | None = None) -> dict[str, Any]:
        seconds = self.clock.seconds()
        return {"start": round(self.clock.started, 3), "start_step": self.start_step,
                "time": round(self.clock.started + sum(seconds.values()) if when is None else when, 3),
                "step": self.step, "seconds": {k: round(v, 4) for k, v in seconds.items()}, "saves": self.saves,
                "completed": self.completed}

    def write(self) -> dict[str, Any]:
        record = self.record()
        if self.enabled:
            files.write_text_atomically(self.path, json.dumps(record))
            self._written = time.monotonic()
        return record

    def step_done(self, step: int) -> None:
        self.step = step
        if self.enabled and time.monotonic() - self._written >= WRITE_EVERY_S:
            self.write()

    def saved(self, step: int) -> None:
        """A checkpoint of `step` (either tier) is being saved: its productive seconds so far."""
        self.saves = [*self.saves, [step, round(self.clock.seconds()["step"], 4)]][-KEEP_SAVES:]
        self.write()

    def summary(self, run_dir: Path) -> dict[str, float]:
        """The run's parts so far, this session's record included as of now."""
        others = [s for s in read(run_dir) if s["start"] != round(self.clock.started, 3)]
        return summarize([*others, self.record()])


SESSION_SHAPE = {"start": files.NUMBER, "start_step": int, "time": files.NUMBER, "step": int, "seconds": dict,
                 "saves": list}


def read(run_dir: Path) -> list[dict[str, Any]]:
    """Every session record of a run, oldest first (none for a run from before goodput was recorded)."""
    out = []
    for path in sorted((Path(run_dir) / DIR).glob("session-*.json")):
        record = files.read_json_object(path, "goodput session record", required=SESSION_SHAPE)
        out.append(record)
    return sorted(out, key=lambda s: s["start"])


def _productive_at(session: dict[str, Any], step: float) -> float:
    """A session's productive seconds up to the end of `step`: its saves' figures, linear in between."""
    total = session["seconds"].get("step", 0.0)
    points = [(session["start_step"], 0.0), *((s, p) for s, p in session["saves"]), (session["step"], total)]
    points = sorted({int(s): p for s, p in points}.items())
    if step <= points[0][0]:
        return 0.0
    for (s0, p0), (s1, p1) in zip(points, points[1:]):
        if step <= s1:
            return p0 + (p1 - p0) * (step - s0) / (s1 - s0)
    return total


def summarize(sessions: list[dict[str, Any]]) -> dict[str, float]:
    """{part: seconds for each of PARTS, "wall": seconds, "goodput": productive / wall} (module docstring)."""
    parts = dict.fromkeys(PARTS, 0.0)
    if not sessions:
        return {**parts, "wall": 0.0, "goodput": 0.0}
    kept = [s["step"] for s in sessions]  # the last step of each session whose result the run kept
    for i, later in enumerate(sessions[1:], start=1):
        for j in range(i):
            kept[j] = min(kept[j], later["start_step"])
    for session, upto in zip(sessions, kept):
        for phase, seconds in session["seconds"].items():
            parts[PHASE_PART.get(phase, "productive")] += seconds
        lost = session["seconds"].get("step", 0.0) - _productive_at(session, upto)
        parts["productive"] -= lost
        parts["lost"] += lost
    wall = sessions[-1]["time"] - sessions[0]["start"]
    for before, after in zip(sessions, sessions[1:]):
        if before.get("completed"):  # the run was done: a continuation (more train.steps) is a new job
            wall -= after["start"] - before["time"]
        else:
            parts["restarts"] += max(0.0, after["start"] - before["time"])
    return {**parts, "wall": wall, "goodput": parts["productive"] / wall if wall > 0 else 0.0}


def row(step: int, summary: dict[str, float]) -> dict[str, Any]:
    """The metrics.jsonl `goodput` row of a summary."""
    return {"step": step, "goodput": round(summary["goodput"], 6), "goodput/wall_s": round(summary["wall"], 3),
            **{f"goodput/{part}_s": round(summary[part], 3) for part in PARTS}}


def line(summary: dict[str, float]) -> str:
    """One line: goodput and the parts that took time."""
    wall = summary["wall"] or 1.0
    shares = ", ".join(f"{part} {summary[part]:.1f} s ({100 * summary[part] / wall:.1f}%)" for part in PARTS
                       if summary[part] >= 0.05)
    return f"goodput {100 * summary['goodput']:.1f}% of {summary['wall']:.1f} s wall since the first start: {shares}"

"""The training loop's phases: which one is running, since when, at which step, and the seconds each took.

At every moment of a session the loop is in exactly one phase, so the seconds per phase add up to
the session's wall time (goodput.py relies on it):

    startup     from train() being entered (after imports) to the first step's dispatch: validation,
                data, set-up, the checkpoint restore, an ahead-of-time compile
    compile     the first step of a session: its dispatch (XLA compiles it there unless start-up
                did) until its results are ready
    data        the host blocked on the input pipeline (Grain's next batch, its transfer)
    step        everything else of a step: dispatching it, waiting for the device's results, the
                metrics row. The host dispatches step N+1 before it waits for step N (train.py), so
                input for N+1 is fetched while the device still runs N: `data` counts the host's
                wait, which the device may partly overlap
    eval        an evaluation (its first one compiles the eval step)
    checkpoint  saving (the part that blocks the loop: copying off the device, a wait for Orbax)

`enter` is a few attribute writes from the main thread; the watchdog's thread reads `current`, one
tuple, so it never sees a phase with another phase's start.
"""

from __future__ import annotations

import time
from collections import deque

PHASES = ("startup", "compile", "data", "step", "eval", "checkpoint")
# What a process in each phase is doing, for one-line messages ("... in step 57, waiting for input")
DOING = {"startup": "starting up (restore, set-up)", "compile": "compiling and running its first step",
         "data": "waiting for input", "step": "waiting for the device", "eval": "evaluating",
         "checkpoint": "saving a checkpoint"}
WARMUP_STEPS = 10  # steps of a session whose times the median of step times leaves out


class PhaseClock:
    """One session's phases (module docstring). `started`: the wall time train() was entered."""

    def __init__(self, started: float | None = None):
        wall, mono = time.time(), time.monotonic()
        self.started = wall if started is None else started
        self.mono0 = mono - (wall - self.started)  # the monotonic time of `started`
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.current: tuple[str, int, float] = ("startup", 0, self.mono0)  # (phase, step, since)
        self.step_times: deque[float] = deque(maxlen=200)  # seconds between step completions, after warm-up
        self._done = 0  # steps completed this session
        self._last: float | None = None  # monotonic time of the last completion
        self._mark = (0, self.mono0, 0.0)  # (steps completed, time, data seconds) at the last `interval`

    def enter(self, phase: str, step: int | None = None) -> None:
        """The loop starts `phase` (at `step`; default: the step it was at)."""
        now = time.monotonic()
        old, old_step, since = self.current
        self.totals[old] += now - since
        self.current = (phase, old_step if step is None else step, now)

    def wall(self, mono: float | None = None) -> float:
        """Wall-clock time (Unix seconds) of a monotonic time (default now), on this session's clock."""
        return self.started + ((time.monotonic() if mono is None else mono) - self.mono0)

    def seconds(self) -> dict[str, float]:
        """Seconds per phase so far, the running phase included; they add up to `elapsed()`."""
        out = dict(self.totals)
        phase, _, since = self.current
        out[phase] += time.monotonic() - since
        return out

    def elapsed(self) -> float:
        return time.monotonic() - self.mono0

    def step_done(self) -> None:
        """A step's results reached the host; its time since the previous one counts after warm-up."""
        now = time.monotonic()
        self._done += 1
        if self._last is not None and self._done > WARMUP_STEPS:
            self.step_times.append(now - self._last)
        self._last = now

    def median_step(self) -> float | None:
        if len(self.step_times) < 5:
            return None
        ordered = sorted(self.step_times)
        return ordered[len(ordered) // 2]

    def interval(self) -> tuple[float, float] | None:
        """(seconds per step, input-wait seconds per step) since the previous call; None if no step
        completed in between."""
        steps, then, data = self._mark
        now, data_now = time.monotonic(), self.seconds()["data"]
        self._mark = (self._done, now, data_now)
        if self._done == steps:
            return None
        n = self._done - steps
        return (now - then) / n, (data_now - data) / n

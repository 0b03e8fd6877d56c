"""Hang detection: a thread in every process that ends a phase outliving its bound, and says who hung.

At scale the common failure is not a crash but a hang: a process stuck in a collective because a
peer's GPU hung, a peer was stopped, or a filesystem stalled. Every process then waits until a
scheduler's wall clock ends the job, and nothing says which process or where. Here each process
runs two daemon threads beside training:

    heartbeat   (several processes only) every HEARTBEAT_S writes RUN_DIR/heartbeats/process-I.json:
                its step, phase (jaxgpt/resilience/clock.py), since when, the launcher's restart
                count, host and pid. The run dir is shared by every process already (checkpoints).
    check       every POLL_S compares the time the loop has spent in its current phase with that
                phase's bound: `train.hang_timeout` for a step and an input wait (0 = auto: HANG_FACTOR
                x the median step time once WARMUP_STEPS + 5 steps have run, at least HANG_FLOOR_S;
                `train.compile_timeout` until then), `train.compile_timeout` for start-up and the
                first step, an evaluation and a checkpoint wait.

When a phase outlives its bound the process reads every heartbeat and judges (`judge`): a process
whose heartbeat stopped (stopped, dead, its host gone) is *missing*; otherwise the process furthest
behind (the lowest step, then the earliest phase of it) is the one the others wait for; if none is
behind, all wait in one step's device work (a device, the interconnect or XLA hung) and the stacks
are the evidence. It then prints one `error: hang: ...` line naming its step, phase, bound and that
process, writes its Python stacks (every thread) and the verdict to
RUN_DIR/hangs/step-N.attempt-R/process-I.txt, tells the launcher which process it suspects
(JAXGPT_LAUNCH_DIR/hang.I, launch_multihost.sh), and exits 76 (`cli.EXIT_HUNG`), which the launcher
restarts. A process that is itself stopped writes nothing; the others name it. File writes happen
in a helper thread given FILE_WAIT_S: a stalled filesystem, itself a cause of hangs, must not keep
the process from exiting.

The processes stuck in a collective exit within about one bound of the stall (the waiting phase
began at most one step before it); launch_multihost.sh kills whatever is left a few seconds later
and restarts the group: detection and restart within 2 x `train.hang_timeout`.

Per-process times for stragglers come from the same clock: `exchange_timings` gathers each
process's seconds per step and input-wait seconds per step over a log interval through JAX's
coordination service (host to host, no device work), and process 0 writes them into the train row
(`step_time`, `data_wait`: one value per process; null for one that has not said within
TIMING_WAIT_S). Every process of a synchronous step finishes it
together, so step times agree and a process whose input is slow stands out by its data_wait; a
process whose device is slow makes everyone slower alike (host timers cannot tell which: the
profile can, `logging.profile_steps`), and one that stops makes the others hang, named above.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import jax

from jaxgpt import _quiet, files
from jaxgpt.cli import EXIT_HUNG
from jaxgpt.config import TrainConfig
from jaxgpt.resilience.clock import DOING, PHASES, WARMUP_STEPS, PhaseClock

HEARTBEAT_S = 2.0
POLL_S = 0.5
STALE_S = 10.0  # a heartbeat older than this is a missing process (5 beats)
HANG_FACTOR, HANG_FLOOR_S = 20, 60.0
FILE_WAIT_S = 10.0
TIMING_WAIT_S = 5.0
STEP_PHASES = ("data", "step")  # bounded by train.hang_timeout; the others by train.compile_timeout


def attempt() -> int:
    """The launcher's restart count (0: the first attempt, or no launcher): the same on every process."""
    try:
        return max(0, int(os.environ.get("JAXGPT_RESTART_COUNT", "0") or 0))
    except ValueError:
        return 0


def judge(me: int, count: int, beats: dict[int, dict[str, Any]], now: float, session: int) -> tuple[int, str]:
    """(the process the others wait for or -1, a clause saying why) from every process's heartbeat."""
    if count == 1:
        return -1, "it is the only process"
    missing = {p: beats.get(p) for p in range(count) if p != me and (
        p not in beats or beats[p].get("attempt") != session or now - beats[p]["time"] > STALE_S)}
    if missing:
        first, beat = min(missing.items())

        def last(b):
            if b is None or b.get("attempt") != session:
                return "none in this attempt"
            return f"{now - b['time']:.0f} s ago, at step {b['step']} {DOING.get(b['phase'], b['phase'])}"

        others = f" (and process{'es' if len(missing) > 2 else ''} {', '.join(map(str, sorted(missing)[1:]))})" \
            if len(missing) > 1 else ""
        return first, f"process {first} is missing{others}: its last heartbeat {last(beat)}"
    rank = {phase: i for i, phase in enumerate(PHASES)}
    progress = {p: (b["step"], rank.get(b["phase"], 0)) for p, b in beats.items() if p < count}
    slowest = min(progress, key=lambda p: (progress[p], p))
    if progress[slowest] == max(progress.values()):
        b = beats[slowest]
        return -1, (f"no process is behind: all are at step {b['step']} {DOING.get(b['phase'], b['phase'])} "
                    f"(a device, the interconnect or XLA hung: compare the stacks)")
    b = beats[slowest]
    ahead = max(progress.values())[0]
    return slowest, (f"process {slowest} is behind, {now - b['since']:.0f} s at step {b['step']} "
                     f"{DOING.get(b['phase'], b['phase'])} while the others reached step {ahead}")


def _bounded(fn, seconds: float = FILE_WAIT_S):
    """fn() in a daemon thread, waited for at most `seconds`: its result, or None if it did not return
    or raised (a full disk, a missing directory: the hang line is out already)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception:  # noqa: BLE001 - see the docstring
            out.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return out[0] if out else None


class Watchdog:
    """The two threads of the module docstring, for one session's `PhaseClock`."""

    def __init__(self, clock: PhaseClock, run_dir: Path, cfg: TrainConfig, exit=os._exit):
        self.clock, self.run_dir, self.exit = clock, Path(run_dir), exit  # exit(EXIT_HUNG) ends the process
        self.hang_timeout, self.compile_timeout = cfg.hang_timeout, cfg.compile_timeout
        self.me, self.count, self.session = jax.process_index(), jax.process_count(), attempt()
        self.beats = self.run_dir / "heartbeats"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def enabled(self) -> bool:
        return self.hang_timeout != -1

    def start(self) -> None:
        if not self.enabled:
            return
        targets = [self._check] + ([self._heartbeat] if self.count > 1 else [])
        if self.count > 1:
            self.beats.mkdir(parents=True, exist_ok=True)
            self._beat()  # before the first check could read it
        for target in targets:
            thread = threading.Thread(target=target, name=f"jaxgpt-{target.__name__.strip('_')}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2 * POLL_S + HEARTBEAT_S)
        self._threads = []

    def bound(self, phase: str) -> tuple[float, str]:
        """(seconds `phase` may last, where that bound comes from)."""
        if phase in STEP_PHASES:
            if self.hang_timeout > 0:
                return self.hang_timeout, "train.hang_timeout"
            median = self.clock.median_step()
            if median is not None:
                return (max(HANG_FLOOR_S, HANG_FACTOR * median),
                        f"auto: {HANG_FACTOR} x the median step of {median:.3g} s, at least {HANG_FLOOR_S:.0f} s")
            return self.compile_timeout, f"train.compile_timeout, no median step time yet (first {WARMUP_STEPS + 5} steps)"
        return self.compile_timeout, "train.compile_timeout"

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except OSError:  # a full or stalled disk: the next beat tries again; the check thread goes on
                pass

    def _beat(self) -> None:
        phase, step, since = self.clock.current
        files.write_text_atomically(self.beats / f"process-{self.me}.json", json.dumps({
            "process": self.me, "attempt": self.session, "step": step, "phase": phase,
            "since": round(self.clock.wall(since), 3), "time": round(time.time(), 3),
            "host": socket.gethostname(), "pid": os.getpid()}))

    def _check(self) -> None:
        while not self._stop.wait(POLL_S):
            phase, step, since = self.clock.current
            waited = time.monotonic() - since
            limit, source = self.bound(phase)
            if waited > limit and not self._stop.is_set():
                self._fire(phase, step, waited, limit, source)

    def _read_beats(self) -> dict[int, dict[str, Any]]:
        out = {}
        for path in self.beats.glob("process-*.json"):
            try:
                beat = json.loads(path.read_text())
                out[int(beat["process"])] = beat
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def _fire(self, phase: str, step: int, waited: float, limit: float, source: str) -> None:
        beats = _bounded(self._read_beats) if self.count > 1 else {}
        if beats is None:
            suspect, verdict = -1, f"the heartbeats in {self.beats} could not be read within {FILE_WAIT_S:.0f} s " \
                                   f"(a stalled filesystem?)"
        else:
            suspect, verdict = judge(self.me, self.count, beats, time.time(), self.session)
        where = self.run_dir / "hangs" / f"step-{step}.attempt-{self.session}"
        line = (f"error: hang: process {self.me} has been {DOING[phase]} at step {step} for {waited:.0f} s "
                f"(bound {limit:.0f} s, {source}); {verdict}; Python stacks in {where}/; launch_multihost.sh "
                f"--max-restarts restarts the group, resuming from the newest checkpoint")
        sys.stdout.flush()
        os.write(_quiet.stderr_fd(), (line + "\n").encode())
        report = (f"{line}\n\nprocess {self.me} of {self.count} on {socket.gethostname()}, pid {os.getpid()}, "
                  f"attempt {self.session}\nheartbeats: {json.dumps(beats, indent=1)}\n\n{_stacks()}")
        _bounded(lambda: self._write_report(where, report))
        launch = os.environ.get("JAXGPT_LAUNCH_DIR")
        if launch:  # local to the launcher's host: where it learns whom to blame
            _bounded(lambda: Path(launch, f"hang.{self.me}").write_text(f"{suspect}\n{verdict}\n"), 2.0)
        self._stop.set()
        self.exit(EXIT_HUNG)

    def _write_report(self, where: Path, report: str) -> None:
        where.mkdir(parents=True, exist_ok=True)
        files.write_text_atomically(where / f"process-{self.me}.txt", report)


def _stacks() -> str:
    """Every thread's Python stack, named (the main thread's shows the line it is blocked in)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: item[0] != main):
        out.append(f"--- thread {names.get(ident, ident)} ---\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(out)


def exchange_timings(step: int, mine: tuple[float, float], previous: int | None = None
                     ) -> list[tuple[float | None, float | None]] | None:
    """Every process's (seconds per step, input-wait seconds per step) over the log interval ending at
    `step`, on process 0 (None elsewhere), through the coordination service's key-value store: each
    process sets its pair; process 0 waits for the others' (they finish the same step within moments
    of each other: its collectives end together) for at most TIMING_WAIT_S in all, and deletes them
    (and any left of the `previous` row's). A process that has not said by then is null in the row:
    it is dead (its peers' next collective fails at once; waiting for its key, process 0 would only
    learn it at the hang bound) or its input is more than TIMING_WAIT_S late (the watchdog's concern)."""
    count = jax.process_count()
    if count == 1:
        return [mine]
    from jax._src import distributed as jax_distributed  # its client (no public accessor)

    client = jax_distributed.global_state.client
    prefix = f"jaxgpt/timing/{step}"
    if jax.process_index() != 0:
        client.key_value_set(f"{prefix}/{jax.process_index()}", f"{mine[0]!r},{mine[1]!r}")
        return None
    out: list[tuple[float | None, float | None]] = [mine]
    deadline = time.monotonic() + TIMING_WAIT_S
    for p in range(1, count):
        try:
            wait_ms = max(1, int(1000 * (deadline - time.monotonic())))
            a, b = client.blocking_key_value_get(f"{prefix}/{p}", wait_ms).split(",")
            out.append((float(a), float(b)))
        except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED (or the service gone): null, as the docstring says
            out.append((None, None))
    for done in (prefix, *([f"jaxgpt/timing/{previous}"] if previous is not None else [])):
        try:
            client.key_value_delete(done)
        except Exception:  # noqa: BLE001 - the service gone: the next collective says so
            pass
    return out

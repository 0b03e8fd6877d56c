"""The step loop: dispatch, deferred metrics, evaluation, checkpoints (both tiers), stop requests.

train.py sets a run up and hands its pieces to `Loop.run`. The host stays off the critical path:
step N+1 is dispatched before step N's metrics are pulled to the host, so reading them never
leaves the device idle (every step's loss is still checked for NaN/inf, one step late).

What a step leaves behind, in order (train.py's docstring says why resuming keeps metrics.jsonl
exact): its train row (every `logging.every` steps and the last), its eval row, at a
`checkpoint.every` step and the last a `goodput` row (jaxgpt/resilience/goodput.py; not at a stop
request's save, which an uninterrupted run does not make), then the checkpoint itself, persistent
(`checkpoint.every`, the last step, a stop request) or else local (`checkpoint.local_every`,
jaxgpt/resilience/local_tier.py). A checkpoint at step S thus implies every row of steps <= S.
Both tiers save asynchronously; a local save at step S is waited for right after step S+1 is
dispatched (it commits while S+1 runs), so that a failure loses at most local_every + 1 steps
(docs/fault-tolerance.md); a persistent one, to slow shared storage, is not.

Every moment is in one phase of `PhaseClock` (data, step, compile, eval, checkpoint): what the
hang watchdog bounds and goodput adds up (jaxgpt/resilience/). A train row also carries each
process's seconds per step and input-wait seconds per step over its log interval (`step_time`,
`data_wait`, one value per process; null over an interval that began with a compile).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from jaxgpt.checkpoint import Checkpointer
from jaxgpt.cli import Diverged, Preempted, StepFailed, environment_failure
from jaxgpt.config import Config
from jaxgpt.evaluate.score import Scorer
from jaxgpt.evaluate.tasks import Task
from jaxgpt.metrics import Throughput, mfu
from jaxgpt.preemption import StopRequest
from jaxgpt.resilience import goodput
from jaxgpt.resilience.clock import PhaseClock
from jaxgpt.resilience.local_tier import LocalTier
from jaxgpt.resilience.watchdog import exchange_timings
from jaxgpt.step import Setup, TrainState, make_eval_step
from jaxgpt.tracking import Tracker


def say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


class Loop:
    """The step loop of one session (module docstring)."""

    def __init__(self, cfg: Config, setup: Setup, mesh, train_step, track: Tracker, n_devices: int, peak: float | None,
                 tasks: Sequence[Task] = (), phases: PhaseClock | None = None, session: goodput.Session | None = None,
                 local: LocalTier | None = None):
        self.cfg, self.track, self.n_devices, self.peak = cfg, track, n_devices, peak
        self.train_step = train_step  # make_train_step's, compiled ahead where check_memory knows a limit
        self.eval_step = make_eval_step(cfg, mesh, setup)
        self.tasks = tasks  # scored with the micro-batch's rows, which training already fits in memory
        self.scorer = Scorer(setup.graphdef, cfg.model, mesh, cfg.train.batch_size // cfg.train.grad_accum)
        self.clock = Throughput()
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        self.phases = phases or PhaseClock()
        self.session, self.local = session, local
        self._logged: int | None = None  # the step of the last row whose timings were exchanged
        self._committing = False  # a local save was started at the previous step

    def evaluate(self, state: TrainState, step: int, val_batches, to_global) -> None:
        """The eval row: val_loss, val_bpb and, when due, every task's acc and acc_norm."""
        self.phases.enter("eval", step)
        sums = jax.device_get([self.eval_step(state.params, to_global(b)) for b in val_batches])
        val_loss = float(np.mean([s["loss"] for s in sums]))
        if not math.isfinite(val_loss):
            self.track.event("diverged", step=step, metric="val_loss")
            raise Diverged(f"the val loss became {val_loss} at step {step}; lower optimizer.lr or check the data")
        text_bytes = sum(int(s["text_bytes"]) for s in sums)
        bpb = sum(float(s["text_nats"]) for s in sums) / math.log(2) / text_bytes if text_bytes else None
        record = {"step": step, "val_loss": val_loss, "val_bpb": bpb}
        every, last = self.cfg.eval.task_every, self.cfg.train.steps
        if self.tasks and (not every or step % every == 0 or step in (0, last)):
            for task in self.tasks:
                record.update(self.scorer.score(state.params, task).fields())
        self.track.write(record)
        self.phases.enter("step")

    def finish(self, step: int, metrics: dict) -> None:
        """Pulls one step's metrics to the host, stops on a non-finite loss, logs every N steps."""
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.phases.step_done()
        if self.session is not None:
            self.session.step_done(step)
        # The grad norm can overflow while the loss is still finite; clipping by an inf norm then zeroes
        # the update and the run would go on silently, so either one ends the run.
        for key, what in (("loss", "the loss"), ("grad_norm", "the gradient norm")):
            if not math.isfinite(values[key]):
                self.track.event("diverged", step=step, metric=key)
                finite = f" (the loss was still {values['loss']:.4g})" if key != "loss" else ""
                raise Diverged(f"{what} became {values[key]} at step {step}{finite}; lower optimizer.lr or "
                               f"check the data (nothing was saved from this step)")
        self.track.advance(step)
        if step % self.cfg.logging.every and step != self.cfg.train.steps:
            return
        rate = self.clock.tokens_per_sec(step, self.tokens_per_step)
        interval = self.phases.interval()
        if interval is None:  # the same on every process: the interval began with this session's compile
            timings = [(None, None)] * jax.process_count()
        else:
            timings = exchange_timings(step, interval, self._logged)
            self._logged = step
        self.track.write({"step": step, **values, "tokens_per_sec": rate,
                          "mfu": mfu(rate, self.cfg.model, self.n_devices, self.peak),
                          **({"step_time": [_r(a) for a, _ in timings], "data_wait": [_r(b) for _, b in timings]}
                             if timings is not None else {})})

    def run(self, state, start, batches, to_global, val_batches, ckpt: Checkpointer, stop: StopRequest):
        """The steps after `start`; an error XLA raises running them is one line (`StepFailed`),
        except those the command line names itself (out of memory, a lost peer process). The
        caller's `ckpt.close()` still commits a save in flight."""
        self.step = start
        try:
            return self._run(state, start, batches, to_global, val_batches, ckpt, stop)
        except jax.errors.JaxRuntimeError as e:
            if environment_failure(e) is not None:
                raise
            first = str(e).strip().split("\n", 1)[0][:300]
            # Dispatch runs ahead: the failure may be the step before the one it surfaced in.
            raise StepFailed(f"XLA failed running the train step (surfaced at step {self.step}): {first}; "
                             f"this is not bad input: report it with the command. Committed checkpoints are "
                             f"kept: the same command resumes from the newest") from None

    def _goodput_row(self, step: int) -> None:
        if self.session is not None and self.track.enabled:
            self.track.write(goodput.row(step, self.session.summary(self.track.run_dir)))

    def _save(self, step, state, batches, ckpt: Checkpointer, persistent: bool) -> None:
        self.phases.enter("checkpoint", step)
        if self.session is not None:
            self.session.saved(step)
        if persistent:
            ckpt.save(step, state, batches.get_state(), self.cfg)
        else:
            self.local.save(step, state, batches.get_state(), self.cfg)
            self._committing = True
        self.phases.enter("step")

    def _run(self, state, start, batches, to_global, val_batches, ckpt: Checkpointer, stop: StopRequest):
        t, every, phases = self.cfg.train, self.cfg.checkpoint.every, self.phases
        if start >= t.steps:
            say(f"already trained to step {start} (train.steps={t.steps}); nothing to do")
            return state
        if t.eval_every and start == 0:
            self.evaluate(state, 0, val_batches, to_global)
        self.clock.reset(start)
        stop.begin(start)
        pending = None  # (step, metrics still on device) of the previous step
        for step in range(start + 1, t.steps + 1):
            self.step = step
            phases.enter("data", step)
            batch = to_global(next(batches))
            # The clock's step is the newest dispatched: the host then waits for the one before it
            phases.enter("compile" if step == start + 1 else "step", step)
            with self.track.step_annotation(step):  # starts a logging.profile_steps trace at its first step
                state, metrics = self.train_step(state, batch)
            if self._committing:  # the previous step's local save, committed while this step runs
                phases.enter("checkpoint", step)
                self.local.wait()
                self._committing = False
                phases.enter("step", step)
            if pending is not None:
                self.finish(*pending)  # the host waits here for the previous step, this one queued
            pending = (step, metrics)
            if step == start + 1:  # the first step compiled: keep it out of tokens/s
                jax.block_until_ready(metrics)
                self.clock.reset(step)
                phases.enter("step", step)
                phases.interval()  # nor in the per-process step times
            self.track.step_done(step, metrics)  # ends a profile trace at its last step
            evaluate = t.eval_every and (step % t.eval_every == 0 or step == t.steps)
            save = (every and step % every == 0) or step == t.steps
            local = not save and self.local is not None and self.local.due(step)
            if evaluate or save or local:
                self.finish(*pending)  # never save a non-finite state
                pending = None
            if evaluate:  # before the save: a checkpoint implies its step's rows (module docstring)
                self.evaluate(state, step, val_batches, to_global)
                self.clock.reset(step)
                phases.interval()
            if save:
                self._goodput_row(step)
                self._save(step, state, batches, ckpt, persistent=True)
            elif local:
                self._save(step, state, batches, ckpt, persistent=False)
            # Last, right before the next step starts: a stop request stops after the newest step
            # started, the step its line names (jaxgpt/preemption.py). After the last step there is
            # none to start: the run ends as finished (exit 0), not preempted (a scheduler would
            # requeue exit 75 for nothing).
            if step < t.steps and stop.requested(step):
                if pending is not None:
                    self.finish(*pending)
                if not save:  # no goodput row here: rows stay where an uninterrupted run writes them
                    self._save(step, state, batches, ckpt, persistent=True)
                phases.enter("checkpoint", step)
                ckpt.wait()
                self.track.event("preempted", step=step, checkpoint=str(ckpt.step_path(step)))
                raise Preempted(f"stopped at step {step}; checkpoint committed to {ckpt.step_path(step)}; "
                                f"run the same command to resume")
        return state


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)

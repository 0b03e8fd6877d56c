"""Stopping on request: SIGTERM or a first Ctrl-C finish the steps already started, save, exit 75.

Schedulers (SLURM, Kubernetes, spot VMs) send SIGTERM some seconds before they kill a job. The
handler only records the request; the training loop checks it once per step, after everything
that step does and right before it starts the next one, then writes a checkpoint at that step,
waits until Orbax has committed it, and raises `cli.Preempted`, which the command line turns into
exit code 75 (EX_TEMPFAIL: "temporary failure, retry"), distinct from success (0), bad input (2)
and divergence (3). A scheduler can requeue on 75. A second Ctrl-C aborts at once (exit 130) for
a user who does not want to wait for the save.

Which step that is: the loop starts (dispatches) step N+1 before it reads step N's metrics, so
that the device never waits for the host (train.py). The host spends the step waiting for step N
while N+1 is already queued behind it; a queued step cannot be taken back (it consumes step N's
state, donated to it), so a signal that arrives then stops after N+1, the newest step started,
two after the last row logged (N-1). The handler's line names that step: it is the step after the
last one checked, and the check records its step before it reads the flag, so the line and the
step the run stops at always agree, wherever between two bytecodes the signal lands.

Several processes must stop at the same step, or they would save different steps. With one
process the local flag is enough. With several, JAX's coordination service delivers the
preemption notice to every process and `multihost_utils.reached_preemption_sync_point(step)`
returns True on all of them at the same step, the one after the highest step any process had
checked: the same rule as one process's. That notice starts from SIGTERM only (JAX's handler, in
C++), so a Ctrl-C, which a terminal sends to every process of a `launch_multihost.sh --local` job,
is turned into a SIGTERM to this process: the group stops as on a scheduler's notice instead of
each process dying alone with nothing saved. A second Ctrl-C aborts, as with one process.
"""

from __future__ import annotations

import os
import signal
import sys

import jax
from jax._src import distributed as jax_distributed  # its preemption service (no public accessor)
from jax.experimental import multihost_utils


class StopRequest:
    """Records SIGTERM / SIGINT while training; `requested(step)` says whether to stop now."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.checked: int | None = None  # the last step checked (the loop sets its start first)
        self.stop_at: int | None = None  # with one process: the step a signal stops after
        self.multi_process = jax.process_count() > 1
        self._previous = {}
        signals = [signal.SIGTERM, signal.SIGINT]
        if self.multi_process:  # SIGINT only, and only where JAX's preemption service handles SIGTERM
            notice = getattr(jax_distributed.global_state, "preemption_sync_manager", None) is not None
            signals = [signal.SIGINT] if notice else []
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            print("\nsecond interrupt: aborting without saving", file=sys.stderr, flush=True)
            os._exit(130)
        self.signal = signum
        lead = "\n" if sys.stderr.isatty() else ""  # off the line of a ^C or a progress bar
        if self.multi_process:  # JAX's SIGTERM handler tells every process (module docstring)
            print(f"{lead}received SIGINT: every process finishes the step they agree on, saves a checkpoint "
                  f"there and exits (Ctrl-C again to abort)", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.stop_at is None:
            self.stop_at = 0 if self.checked is None else self.checked + 1  # 0: the first step checked
        step = f"step {self.stop_at}" if self.stop_at else "the first step"
        print(f"{lead}received {signal.Signals(signum).name}: finishing {step}, saving a checkpoint there and "
              f"exiting (Ctrl-C again to abort)", file=sys.stderr, flush=True)

    def begin(self, start: int) -> None:
        """The loop starts after step `start`: a signal from now on names step start + 1."""
        self.checked = start

    def requested(self, step: int) -> bool:
        """Whether to stop after `step`; call once per step, before the next step is started."""
        if self.multi_process:
            return multihost_utils.reached_preemption_sync_point(step)
        self.checked = step  # first: a signal from here on names step + 1 (module docstring)
        return self.stop_at is not None and self.stop_at <= step

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

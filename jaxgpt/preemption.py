"""Stopping on request: SIGTERM or a first Ctrl-C finish the step, save, and exit 75.

Schedulers (SLURM, Kubernetes, spot VMs) send SIGTERM some seconds before they kill a job. The
handler only records the request; the training loop checks it after each step, writes a
checkpoint at that step, waits until Orbax has committed it, and raises `cli.Preempted`, which the
command line turns into exit code 75 (EX_TEMPFAIL: "temporary failure, retry"), distinct from
success (0), bad input (2) and divergence (3). A scheduler can requeue on 75. A second Ctrl-C
aborts at once (exit 130) for a user who does not want to wait for the save.

Several processes must stop at the same step, or they would save different steps. With one
process the local flag is enough. With several, JAX's coordination service delivers the
preemption notice to every process and `multihost_utils.reached_preemption_sync_point(step)`
returns True on all of them at the same step; jaxgpt then installs no handlers of its own.
"""

from __future__ import annotations

import os
import signal
import sys

import jax
from jax.experimental import multihost_utils


class StopRequest:
    """Records SIGTERM / SIGINT while training; `requested(step)` says whether to stop now."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.multi_process = jax.process_count() > 1
        self._previous = {}
        for sig in [] if self.multi_process else [signal.SIGTERM, signal.SIGINT]:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            print("\nsecond interrupt: aborting without saving", file=sys.stderr, flush=True)
            os._exit(130)
        self.signal = signum
        print(f"\nreceived {signal.Signals(signum).name}: finishing this step and saving a checkpoint "
              f"(Ctrl-C again to abort)", file=sys.stderr, flush=True)

    def requested(self, step: int) -> bool:
        if self.multi_process:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signal is not None

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

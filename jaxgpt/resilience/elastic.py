"""A restart on fewer processes: the data-parallel axis shrunk, the global batch and data order kept.

`launch_multihost.sh --min-processes K` restarts the group on the processes that remain when one
fails beyond `--max-restarts` or its host is gone (at least K of them), and on all of them again
once the host is back. It tells the processes how many the run was started for through
JAXGPT_ELASTIC_PROCESSES=N; the command line, and so `--mesh`, stays the full group's. With P < N
processes `resize` turns the config into the one P processes can run:

    - the mesh: dp -> dp x P / N (every other axis keeps its size, so what each process holds of a
      layer is unchanged: fsdp, tp, ep and cp stay inside the groups they were in); dp=-1 is
      resolved for N processes first
    - train.grad_accum: the smallest value, at least the configured one, that splits the global
      batch into micro-batches divisible by the new dp x fsdp x ep with at most as many rows per
      device as the full group had: memory per device does not grow

train.batch_size does not change, and the data order is a function of the global batch index alone
(jaxgpt/data/loader.py: global batch s is the same for any process count), so the run continues the
same trajectory: the same sum over the same rows, in another order (fp32 on a CPU: within the
layout tolerance, tests/test_parallel.py). A restored checkpoint reshards onto the new mesh
(jaxgpt/checkpoint.py); the local tier of another process count is not used (local_tier.py).

When no grad_accum keeps the global batch (16 sequences cannot split over 3 data shards), or dp
does not scale to P (dp=2 on 4 processes, 3 left), the processes stop before compiling with one
line and exit 77 (`cli.TooFewProcesses`); the launcher does not restart that, and the checkpoints
are intact for a run with more processes.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from jaxgpt.cli import TooFewProcesses
from jaxgpt.config import Config, mesh_shape, validate
from jaxgpt.errors import UserError

ENV = "JAXGPT_ELASTIC_PROCESSES"


def full_processes() -> int | None:
    """The process count the run was started for (the launcher's N), or None outside an elastic launch."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"environment variable {ENV}={text[:40]!r} must be a process count >= 1")
    return int(text)


def resize(cfg: Config, n_devices: int, processes: int | None = None,
           full: int | None = None) -> tuple[Config, str | None]:
    """(the config for `processes` (default: this job's) out of `full` (default: $JAXGPT_ELASTIC_PROCESSES),
    a line saying what changed, or None when nothing had to)."""
    processes = jax.process_count() if processes is None else processes
    full = full_processes() if full is None else full
    if full is None or processes >= full:
        return cfg, None
    if n_devices % processes:
        raise UserError(f"{n_devices} devices do not split evenly over {processes} processes")
    per_process = n_devices // processes
    t = cfg.train
    try:
        sizes = mesh_shape(cfg.mesh, per_process * full)  # the full group's layout, as the command line says
    except UserError as e:
        raise UserError(f"{e} (the mesh is for the {full} processes the run was started on)") from None
    dp = sizes["dp"] * processes / full
    lead = f"{processes} of the {full} processes this run was started on"
    if dp != int(dp):
        raise TooFewProcesses(f"{lead} cannot run its mesh: dp={sizes['dp']} x {processes}/{full} is not a whole "
                              f"number, and only the dp axis shrinks; the checkpoints are intact: resume with more "
                              f"processes, or with a --mesh whose dp shrinks")
    dp = int(dp)
    ways_full = sizes["dp"] * sizes["fsdp"] * sizes["ep"]
    ways = dp * sizes["fsdp"] * sizes["ep"]
    rows = t.batch_size // t.grad_accum // ways_full  # per device and micro-batch in the full group
    accum = next((a for a in range(t.grad_accum, t.batch_size + 1)
                  if t.batch_size % a == 0 and (t.batch_size // a) % ways == 0 and t.batch_size // a // ways <= rows),
                 None)
    if accum is None:
        raise TooFewProcesses(f"{lead} cannot keep the global batch of {t.batch_size} sequences: no train.grad_accum "
                              f"splits it into micro-batches over dp x fsdp x ep = {ways} devices with at most {rows} "
                              f"sequences each; the checkpoints are intact: resume with more processes")
    mesh = dataclasses.replace(cfg.mesh, **{**sizes, "dp": dp})
    resized = dataclasses.replace(cfg, mesh=mesh, train=dataclasses.replace(t, grad_accum=accum))
    try:
        validate(resized, n_devices)
    except UserError as e:
        raise TooFewProcesses(f"{lead} cannot run this config: {e}; the checkpoints are intact: resume with more "
                              f"processes") from None
    return resized, (f"elastic: {lead}: mesh dp={dp} (was {sizes['dp']}), train.grad_accum={accum} (was "
                     f"{t.grad_accum}); the global batch of {t.batch_size} sequences and the data order are unchanged")

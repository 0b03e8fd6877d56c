"""Surviving the failures of real clusters (docs/fault-tolerance.md walks through each).

    clock.py       which phase the training loop is in (start-up, compile, input, step, evaluation,
                   checkpoint), since when and at which step; seconds per phase. What the watchdog
                   and goodput read.
    watchdog.py    hang and straggler detection: a thread per process that ends a step, an input
                   wait, an evaluation or a checkpoint wait that outlives its bound, with every
                   process's Python stacks in RUN_DIR/hangs/, one line naming the process the
                   others wait for, and exit 76; per-process step and input-wait times.
    local_tier.py  checkpoint.local_every: each process's shards on host-local storage beside the
                   persistent checkpoints; which tier a restart resumes from.
    elastic.py     a restart on fewer processes (launch_multihost.sh --min-processes): the data-
                   parallel axis shrunk, train.grad_accum raised, the global batch kept.
    goodput.py     the wall clock since the run's first start, across restarts, split into
                   productive steps, compile, input wait, checkpoints, evaluation, start-up,
                   restarts and lost work.

The training loop (jaxgpt/train.py) marks its phases on the clock; everything else here hangs off
that clock or off the checkpoints.
"""

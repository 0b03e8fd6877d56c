"""Command-line plumbing shared by the jaxgpt commands: one-line errors and exit codes.

Exit codes (documented in docs/errors.md, whose table tests/test_docs.py checks against these):
    0  success
    1  a failure while running: a traceback, or one `error: ...` line for XLA's out-of-memory (not
       necessarily the same on a second try: launch_multihost.sh restarts) and for any other error
       XLA raises running a train step (`StepFailed`)
    2  bad input the user can fix (config, mesh, data, a run too big for its devices' memory, ...):
       one `error: ...` line on stderr
    3  training stopped because the loss became non-finite
    75 preempted (SIGTERM or Ctrl-C): a checkpoint was committed, re-run the same command to resume
    130 Ctrl-C where there was nothing to save (starting up, a second Ctrl-C): one `interrupted` line
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from jaxgpt import _quiet
from jaxgpt.errors import UserError

EXIT_OK, EXIT_FAILED, EXIT_USER_ERROR, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 1, 2, 3, 75, 130


class Diverged(UserError):
    """The loss became NaN or inf; the run stops without saving the broken state."""


class Preempted(Exception):
    """Training stopped on request after committing a resumable checkpoint."""


class StepFailed(Exception):
    """XLA raised an error running a train step that is not one of `environment_failure`'s (an
    operation its backend cannot run, a device fault): one line, exit 1, the committed checkpoints
    kept."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with an error as one line instead of argparse's usage block, and an option given
    twice refused (argparse keeps the last silently: `--config a.yaml --config b.yaml` trained b)."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        given = [a.split("=", 1)[0] for a in (sys.argv[1:] if args is None else args) if a.startswith("--")]
        for action in self._actions:
            if isinstance(action, argparse._StoreAction) and action.option_strings:
                if sum(given.count(o) for o in action.option_strings) > 1:
                    self.error(f"{'/'.join(action.option_strings)} is given twice")
        return super().parse_known_args(args, namespace)


def path_arg(text: str) -> Path:
    """argparse type for a path: an empty one would be the current directory, silently."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (use . for the current directory)")
    return Path(text)


def run_main(fn: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> int:
    """Runs a command, turning a UserError into one stderr line and its exit code."""
    try:
        fn(argv)
    except Preempted as e:
        print(f"preempted: {e}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except StepFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except KeyboardInterrupt as e:  # Ctrl-C outside a command's own handling (or with its own line: plan --search)
        _say_interrupted(*e.args[:1])
        return EXIT_INTERRUPTED
    except (RuntimeError, OSError, ValueError, AssertionError, MemoryError) as e:  # TensorStore: a full disk as a ValueError
        if (said := environment_failure(e)) is None:
            raise
        code, line = said
        print(f"error: {line}", file=sys.stderr, flush=True)
        if line.startswith(PEER_LOST):  # skip jax.distributed's shutdown: its barrier waits for the
            sys.stdout.flush()          # lost process, then aborts the process with a C++ trace
            os._exit(code)
        return code
    return EXIT_OK


def environment_failure(e: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) for what the machine rather than the code got wrong: an unknown
    JAX_PLATFORMS backend, XLA's out-of-memory, a full disk, a path this process may not access;
    None for anything else, which keeps its traceback."""
    first = str(e).strip().split("\n", 1)[0]
    if isinstance(e, AssertionError) and _raised_in(e, os.path.join("jax", "_src", "xla_bridge.py")):
        # JAX asserts when a backend's plugin failed to start (its error is logged above): a GPU,
        # driver or CUDA library missing, which a restart on another machine may not meet
        platforms = os.environ.get("JAX_PLATFORMS", "")
        return EXIT_FAILED, (f"JAX could not start a backend{f' for JAX_PLATFORMS={platforms}' if platforms else ''} "
                             f"(the plugin's error is above); check the GPU, its driver and CUDA libraries, "
                             f"or set JAX_PLATFORMS=cpu")
    if isinstance(e, RuntimeError) and first.startswith("Unable to initialize backend") and \
            "not in the list of known backends" in first:
        return EXIT_USER_ERROR, f"{first[:300]} (check JAX_PLATFORMS)"
    if (line := out_of_memory(e)) is not None:
        return EXIT_FAILED, f"a device ran out of memory ({line}); {OUT_OF_MEMORY_HINT}"
    if isinstance(e, RuntimeError) and any(s in first for s in _PEER_FAILURES) and _in_multi_process_job():
        return EXIT_FAILED, (f"{PEER_LOST} ({first[:240]}): it stopped or cannot be reached (see its log); re-run "
                             f"the same command to resume from the last committed checkpoint (launch_multihost.sh "
                             f"--max-restarts N restarts the group by itself)")
    if isinstance(e, MemoryError):  # a host allocation (NumPy's says how much); eval's --batch-size among the fixes
        return EXIT_FAILED, f"the host ran out of memory ({first[:200] or type(e).__name__}); {OUT_OF_MEMORY_HINT}"
    if (line := disk_full(e)) is not None:
        return EXIT_FAILED, line
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and e.filename:
        return EXIT_USER_ERROR, (f"cannot access {e.filename}: {e.strerror} (a read-only mount, an immutable file or "
                                 f"another user's); fix its permissions or choose another path")
    return None


PEER_LOST = "lost contact with another process of this job"
# What a collective or the coordination service says when a peer process died mid-step.
_PEER_FAILURES = ("Gloo", "Connection reset by peer", "Connection closed by peer", "Connection refused",
                  "heartbeat", "coordination service", "Barrier failed", "another task")


def _in_multi_process_job() -> bool:
    """Whether this process joined a job of several (jax.distributed started, no backend started here)."""
    distributed = sys.modules.get("jaxgpt.parallel.distributed")
    return bool(distributed and distributed.joined)


def _raised_in(e: BaseException, path_end: str) -> bool:
    """Whether the innermost frame of e's traceback is in a file whose path ends with path_end."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith(path_end)


def disk_full(e: BaseException) -> str | None:
    """One line for a full disk or quota (an OSError's ENOSPC/EDQUOT, or TensorStore's message
    saying so while Orbax writes a checkpoint); None for anything else."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" writing {e.filename}" if e.filename else ""
    elif "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
        where = ""
    else:
        return None
    return (f"the disk is full{where} ({str(e).strip().splitlines()[0][:200]}); free space or choose another "
            f"run dir, then re-run the same command to resume from the last committed checkpoint")


OUT_OF_MEMORY_HINT = ("a smaller batch or model, or more devices, need less (training: train.grad_accum, "
                      "model.remat=full; sampling: --num-samples; eval: --batch-size); `python -m jaxgpt.plan` shows a train step's "
                      "memory per device without running it")


def out_of_memory(e: BaseException) -> str | None:
    """The first line of XLA's allocation failure: a JaxRuntimeError whose status is RESOURCE_EXHAUSTED
    and whose message says out of memory; None for anything else (other RESOURCE_EXHAUSTED errors, a
    coordination service's say, keep their traceback). By name: this module is imported before JAX."""
    first = str(e).strip().split("\n", 1)[0]
    oom = (type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and first.startswith("RESOURCE_EXHAUSTED")
           and "out of memory" in first.lower())
    return first if oom else None


INTERRUPTED = "interrupted; run the same command to start again (training resumes from its newest checkpoint, if any)"


def _say_interrupted(line: str = INTERRUPTED) -> None:
    fd = _quiet.stderr_fd()  # not the capture of fd 2 that importing JAX may have in place
    lead = "\n" if os.isatty(fd) else ""  # off the line of the ^C
    sys.stderr.flush()
    os.write(fd, f"{lead}{line}\n".encode())


def exit_interrupted(*_) -> NoReturn:
    """The line, then exit 130 at once (nothing to save, nothing to clean up)."""
    _say_interrupted()
    os._exit(EXIT_INTERRUPTED)


def exit_on_ctrl_c() -> None:
    """Until the command installs handlers of its own (training: jaxgpt/preemption.py), a Ctrl-C
    ends the process at once with one line and exit 130. Set first thing, before JAX is imported:
    a KeyboardInterrupt raised inside one of JAX's gc callbacks would be swallowed by Python
    ("Exception ignored") and the command would go on."""
    signal.signal(signal.SIGINT, exit_interrupted)

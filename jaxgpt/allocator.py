"""A faster host allocator for the commands that train: re-execute once with it.

Why. XLA:CPU allocates each step's temporaries afresh and frees them at the end of the step. glibc
serves every allocation over 32 MiB with a new `mmap` and returns it with `munmap`, so each step
faults in (and the kernel zeroes) every page of its temporaries again: measured on the default run
before the chunked loss, 14 million minor page faults in 40 steps and more system time than user
time. An allocator that keeps freed memory for the next step removes that cost.

What. `python -m jaxgpt.train` (and `scripts/benchmark.py`) call `reexec()` first thing. On Linux,
unless it was done already (`JAXGPT_ALLOCATOR` is set) or turned off (`JAXGPT_ALLOCATOR=system`), the
process replaces itself (`os.execve`: same PID, same arguments, so launchers and signals are
unaffected) with:

  - tcmalloc preloaded (`LD_PRELOAD`) where `libtcmalloc_minimal.so.4` is installed (Debian/Ubuntu:
    `apt install libtcmalloc-minimal4`; RHEL: `gperftools-libs`): it caches freed spans, so after the
    first step no page is faulted in again; or else
  - glibc with transparent huge pages for its allocations (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`,
    glibc >= 2.35): the same faults at 2 MiB instead of 4 KiB, 512x fewer (the pages are still
    zeroed each step), and one line says how to get tcmalloc.

`JAXGPT_ALLOCATOR` records the choice (`tcmalloc`, `glibc-thp`, or `system`) for the start-up line.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

ENV = "JAXGPT_ALLOCATOR"
CHOICES = ("tcmalloc", "glibc-thp", "system")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")
HINT = "install tcmalloc for faster CPU steps (Debian/Ubuntu: apt install libtcmalloc-minimal4)"


def find_tcmalloc() -> str | None:
    for directory in TCMALLOC_DIRS:
        for name in TCMALLOC_NAMES:
            if (Path(directory) / name).is_file():
                return str(Path(directory) / name)
    found = ctypes.util.find_library("tcmalloc_minimal")
    return found if found and Path(found).is_absolute() else None


def _glibc_has_thp_tunable() -> bool:
    version = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None  # 'glibc 2.36'
    try:
        major, minor = (int(x) for x in (version or "").split()[-1].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 35)


def reexec() -> None:
    """Re-executes this command once with a faster allocator (module docstring); returns if it does not."""
    if os.environ.get(ENV) and os.environ[ENV] not in CHOICES:
        print(f"warning: {ENV}={os.environ[ENV]!r} is not one of {', '.join(CHOICES)}; taken as system (the "
              f"allocator this process started with)", file=sys.stderr, flush=True)
        os.environ[ENV] = "system"
    if not sys.platform.startswith("linux") or os.environ.get(ENV) or not getattr(sys, "orig_argv", None):
        return
    env = dict(os.environ)
    tcmalloc = find_tcmalloc()
    if tcmalloc:
        env["LD_PRELOAD"] = ":".join(filter(None, [tcmalloc, env.get("LD_PRELOAD")]))
        env[ENV] = "tcmalloc"
    elif _glibc_has_thp_tunable():
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=1"]))
        env[ENV] = "glibc-thp"
    else:
        env[ENV] = "system"
        os.environ[ENV] = "system"
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe() -> str:
    """For the start-up line: the allocator in use, and how to get a faster one where it helps."""
    name = os.environ.get(ENV, "system")
    return name if name == "tcmalloc" else f"{name}; {HINT}"

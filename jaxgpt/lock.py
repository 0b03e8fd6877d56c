"""One writer per directory: the lock a training run holds on its run dir, a preparation on its output.

Two commands writing one directory at once corrupt it without a word: two runs in one run dir
append each other's rows to metrics.jsonl and save over each other's checkpoints; two preparations
of one output dir append to the same shards, and the later one "resumes" from the other's state.
`DirLock` holds an exclusive advisory lock (flock(2), never waiting) on a file in the directory
for as long as the command writes there. A second command gets one `UserError` sentence naming
the holder (its pid, host and start time, written into the lock file) before it writes anything.

Why flock. The kernel drops a flock when the last descriptor of its open file goes, however the
process ends (SIGKILL, the OOM killer), so a killed command leaves no stale lock: at most the file,
which the next command takes. The descriptor is close-on-exec; a process forked without exec
would keep the lock as long as it lives (jaxgpt forks none while holding one: the prepare workers
are spawned). Releasing removes the file while still holding its lock (and the directory, if this
command created it and wrote nothing else there: a run refused before its first write). A command
that opened the file just before the removal finds, once it holds the lock, that the path no
longer names its file, and starts again; without that check two commands could each hold a lock
on a different file of one name.

A multi-process job writes one run dir from every process, so each process locks its own file
(`.jaxgpt.lock.<process index>`): the processes of one job never exclude each other, and a second
job's process 0 finds the first job's process 0 holding the same file. On a filesystem without
flock (some network mounts) the command goes on unlocked, after saying so once.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
import sys
from pathlib import Path

from jaxgpt.errors import UserError

FILE = ".jaxgpt.lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class DirLock:
    """`with DirLock(dir, "run dir", "wait for it ...")`: the directory (created if missing) is this
    process's to write until the block ends; another holder is a UserError:
    "{what} {dir} is in use by another jaxgpt process ({holder}); {advice}"."""

    def __init__(self, directory: Path, what: str, advice: str, suffix: str = ""):
        self.dir, self.what, self.advice = Path(directory), what, advice
        self.path = self.dir / (FILE + suffix)
        self.fd: int | None = None
        self.created = False

    def __enter__(self) -> DirLock:
        while self.fd is None:
            self.created = self.created or not self.dir.exists()
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise UserError(f"{self.what} {self.dir} is in use by another jaxgpt process"
                                f"{f' ({holder})' if holder else ''}; {self.advice}") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in _NO_LOCKS:
                    raise UserError(f"Cannot lock {self.what} {self.dir}: {e.strerror}.") from None
                self.path.unlink(missing_ok=True)
                print(f"jaxgpt: {self.dir}'s filesystem cannot lock files ({e.strerror}); make sure no other "
                      f"jaxgpt process writes to it", file=sys.stderr, flush=True)
                return self
            if _names(self.path, fd):
                self.fd = fd
            else:  # removed by a holder that released it after we opened it: again
                os.close(fd)
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # still held: see the module docstring
        if self.created:
            try:
                self.dir.rmdir()  # only if empty: a command refused before it wrote anything
            except OSError:
                pass
        os.close(self.fd)  # releases the lock
        self.fd = None

    def _open(self) -> int:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"Cannot write to {self.what} {self.dir}: {e.strerror}.") from None


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except FileNotFoundError:
        return False


def _read(fd: int) -> str:
    """The holder's line (empty if it has not written it yet)."""
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""

"""One writer per directory (jaxgpt/lock.py): a second run or preparation of a directory in use is
refused with one line before it writes anything, and a killed holder leaves no stale lock."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from helpers import REPO, TINY, run_cli
from jaxgpt.errors import UserError
from jaxgpt.lock import FILE, DirLock

HOLD = """
import sys, time
from jaxgpt.lock import DirLock
with DirLock(sys.argv[1], "dir", "wait", suffix=sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""


def hold(directory, suffix: str = "") -> subprocess.Popen:
    """A peer process holding the lock on `directory` until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), suffix], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def kill_9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def one_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def test_a_second_run_in_a_run_dir_in_use_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    peer = hold(run_dir, ".0")  # what a running job's process 0 holds
    try:
        proc = run_cli("--run-dir", str(run_dir), "--mesh", "dp=8", *TINY, "train.steps=2")
        one_line(proc, f"run dir {run_dir} is in use by another jaxgpt process (pid {peer.pid} on ",
                 "pass another --run-dir")
        assert sorted(p.name for p in run_dir.iterdir()) == [f"{FILE}.0"]  # nothing written
    finally:
        kill_9(peer)
    with DirLock(run_dir, "run dir", "", suffix=".0"):  # the kernel dropped the killed peer's lock
        pass
    assert not any(run_dir.iterdir())  # its file went with the next holder's lock


def test_a_second_preparation_of_an_output_in_use_is_refused(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200)
    out = tmp_path / "out"
    peer = hold(out)
    try:
        proc = subprocess.run([sys.executable, "-m", "jaxgpt.prepare", str(text), "--out", str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        one_line(proc, f"--out {out} is in use by another jaxgpt process (pid {peer.pid} on ",
                 "run the same command again")
        assert sorted(p.name for p in out.iterdir()) == [FILE]
    finally:
        kill_9(peer)
    proc = subprocess.run([sys.executable, "-m", "jaxgpt.prepare", str(text), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # the lock file left by the killed peer is no obstacle
    assert (out / "meta.json").is_file() and not (out / FILE).exists()


def test_lock_files_per_process_and_what_a_refused_command_leaves(tmp_path):
    run_dir = tmp_path / "run"
    with DirLock(run_dir, "run dir", "pass another --run-dir", suffix=".0"):
        with DirLock(run_dir, "run dir", "", suffix=".1"):  # the same job's process 1
            with pytest.raises(UserError, match=r"in use by another jaxgpt process \(pid \d+ on .*, since "):
                with DirLock(run_dir, "run dir", "pass another --run-dir", suffix=".0"):
                    pass
    fresh = tmp_path / "a" / "fresh"
    with DirLock(fresh, "run dir", "", suffix=".0"):
        assert fresh.is_dir()
    # A directory the command created and wrote nothing else to goes with its lock file.
    assert not fresh.exists() and (tmp_path / "a").is_dir()
    fresh.mkdir()
    with DirLock(fresh, "run dir", "", suffix=".0"):
        (fresh / "metrics.jsonl").write_text("")
    assert [p.name for p in fresh.iterdir()] == ["metrics.jsonl"]  # the lock file goes with the lock

"""Issue 60's parts one by one: the hang watchdog and its verdict, elastic resizing, goodput's sums, the
report's goodput and straggler sections, and launch_multihost.sh's restart bookkeeping (--min-processes,
hangs, --slurm) with stand-in processes. The real multi-process chaos run is in test_multihost.py; the
local checkpoint tier's resume in test_checkpoint.py."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, tiny_config

from jaxgpt.cli import EXIT_HUNG, TooFewProcesses
from jaxgpt.errors import UserError
from jaxgpt.report import plot_goodput, render
from jaxgpt.resilience import goodput
from jaxgpt.resilience.clock import PhaseClock
from jaxgpt.resilience.elastic import resize
from jaxgpt.resilience.watchdog import Watchdog, judge


def _beat(step: int, phase: str, age: float, now: float, attempt: int = 0, since: float = 30.0) -> dict:
    return {"step": step, "phase": phase, "time": now - age, "since": now - since, "attempt": attempt}


def test_the_verdict_names_the_missing_or_the_slowest_process():
    now = 1000.0
    beats = {0: _beat(9, "step", 1, now), 1: _beat(8, "step", 25, now), 2: _beat(9, "step", 1, now)}
    assert judge(0, 3, beats, now, 0) == (1, "process 1 is missing: its last heartbeat 25 s ago, at step 8 waiting "
                                             "for the device")
    beats[1] = _beat(9, "step", 5, now, attempt=1)  # a heartbeat of another attempt is no heartbeat
    assert judge(0, 3, beats, now, 0)[0] == 1
    beats = {0: _beat(10, "step", 1, now), 1: _beat(9, "checkpoint", 1, now, since=40), 2: _beat(10, "step", 1, now)}
    assert judge(2, 3, beats, now, 0) == (1, "process 1 is behind, 40 s at step 9 saving a checkpoint while the "
                                             "others reached step 10")
    beats = {0: _beat(10, "data", 1, now), 1: _beat(10, "step", 1, now)}  # its input, before its dispatch
    assert judge(1, 2, beats, now, 0)[0] == 0
    beats = {p: _beat(10, "step", 1, now) for p in range(2)}
    assert judge(0, 2, beats, now, 0) == (-1, "no process is behind: all are at step 10 waiting for the device (a "
                                              "device, the interconnect or XLA hung: compare the stacks)")


def test_the_watchdog_ends_a_phase_that_outlives_its_bound(tmp_path, capfd):
    """A real clock and watchdog thread (hang_timeout 0.3 s): a step phase left running ends the
    process (here: the exit it was handed) with one line, and its stacks in RUN_DIR/hangs/; an
    evaluation or a compile under the same bound does not (train.compile_timeout is theirs)."""
    exits: list[int] = []
    clock = PhaseClock()
    dog = Watchdog(clock, tmp_path, tiny_config("train.hang_timeout=0.3", "train.compile_timeout=60").train,
                   exit=exits.append)
    dog.start()
    try:
        clock.enter("eval", 4)
        time.sleep(1.2)
        assert exits == []
        clock.enter("step", 5)
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog.close()
    assert exits == [EXIT_HUNG]
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: hang: process 0 has been waiting for the device at step 5 for "), err
    assert "(bound 0 s, train.hang_timeout); it is the only process; Python stacks in " in err[0]
    report = (tmp_path / "hangs" / "step-5.attempt-0" / "process-0.txt").read_text()
    assert report.split("\n\n")[2].startswith("--- thread MainThread ---")  # the main thread's stack first
    assert "test_the_watchdog_ends_a_phase" in report


def test_an_auto_bound_waits_for_a_median_step():
    dog = Watchdog(PhaseClock(), Path("."), tiny_config("train.compile_timeout=900").train)
    assert dog.bound("step") == (900.0, "train.compile_timeout, no median step time yet (first 15 steps)")
    dog.clock.step_times.extend([0.5, 0.2, 0.3, 9.0, 0.4])
    assert dog.bound("data")[0] == 60.0  # 20 x 0.4 s is below the floor
    dog.clock.step_times.extend([5.0] * 10)
    assert dog.bound("step")[0] == 100.0 and dog.bound("checkpoint")[0] == 900.0


@pytest.mark.parametrize("mesh, batch, left, says", [
    ("dp=4,fsdp=2", 24, 3, (3, 2, 2)),  # 3 rows per device: 24 / 2 / 6 = 2
    ("dp=-1,fsdp=2", 24, 3, (3, 2, 2)),  # -1 is the full group's: 4
    ("dp=2,fsdp=4", 16, 1, (1, 4, 2)),
    ("dp=4,fsdp=2", 16, 3, "cannot keep the global batch of 16 sequences: no train.grad_accum splits it"),
    ("dp=2,fsdp=4", 24, 3, "cannot run its mesh: dp=2 x 3/4 is not a whole number"),
])
def test_elastic_resize_shrinks_dp_and_keeps_the_global_batch(mesh, batch, left, says):
    cfg = tiny_config(f"train.batch_size={batch}", mesh=mesh)
    devices = 2 * left if mesh != "dp=2,fsdp=4" or left != 1 else 4
    per = devices // left
    full = 8 // per
    if isinstance(says, str):
        with pytest.raises(TooFewProcesses, match=says):
            resize(cfg, devices, left, full)
        return
    resized, line = resize(cfg, devices, left, full)
    assert (resized.mesh.dp, resized.mesh.fsdp, resized.train.grad_accum) == says
    assert resized.train.batch_size == batch and f"the global batch of {batch} sequences" in line
    assert resize(cfg, 8, full, full) == (cfg, None)  # the full group: nothing changes


def test_a_bad_elastic_environment_is_one_line(monkeypatch):
    monkeypatch.setenv("JAXGPT_ELASTIC_PROCESSES", "four")
    with pytest.raises(UserError, match="JAXGPT_ELASTIC_PROCESSES='four' must be a process count"):
        resize(tiny_config(), 8)


def _session(start, start_step, step, seconds, saves=()) -> dict:
    return {"start": start, "start_step": start_step, "step": step, "time": start + sum(seconds.values()),
            "seconds": seconds, "saves": [list(s) for s in saves]}


def test_goodput_parts_add_up_and_count_recomputed_steps_as_lost():
    """Session 1 trains steps 1-30 (local saves at 10 and 20) and is killed; session 2 resumes at 20,
    so its steps 21-30 were lost: 30 - 20 = 10 s of session 1's productive time. The gap between them
    is restarts. Session 3 resumed at 20 as well after session 2 was killed at step 25 with nothing
    saved past 20: both sessions' steps past 20 are lost."""
    s1 = _session(0, 0, 30, {"startup": 5, "compile": 3, "step": 30, "data": 1, "checkpoint": 1}, [(10, 10), (20, 20)])
    s2 = _session(50, 20, 25, {"startup": 4, "compile": 2, "step": 5, "data": 0.5, "checkpoint": 0})
    s3 = _session(70, 20, 40, {"startup": 4, "compile": 2, "step": 20, "eval": 2})
    total = goodput.summarize([s1, s2, s3])
    assert total["lost"] == pytest.approx(10 + 5)
    assert total["productive"] == pytest.approx(20 + 0 + 20)
    assert total["restarts"] == pytest.approx((50 - 40) + (70 - 61.5))
    assert total["wall"] == pytest.approx(s3["time"])
    assert sum(total[p] for p in goodput.PARTS) == pytest.approx(total["wall"])
    assert total["goodput"] == pytest.approx(40 / total["wall"])
    s4 = {**_session(200, 40, 60, {"startup": 3, "compile": 1, "step": 20}), "completed": True}
    later = goodput.summarize([s1, s2, {**s3, "completed": True}, s4])  # more train.steps, long after
    assert later["restarts"] == total["restarts"] and later["wall"] == pytest.approx(total["wall"] + 24)
    row = goodput.row(40, total)
    assert row["step"] == 40 and row["goodput/lost_s"] == 15.0 and set(row) >= {f"goodput/{p}_s" for p in goodput.PARTS}


def test_the_report_shows_goodput_and_names_a_straggler(tmp_path):
    sessions = [_session(0, 0, 10, {"startup": 2, "compile": 1, "step": 10}, [(10, 10)]),
                _session(20, 10, 20, {"startup": 2, "compile": 1, "step": 10})]
    rows = [{"step": s, "loss": 5.0, "tokens_per_sec": 100.0, "mfu": None, "step_time": [0.5, 0.5, 0.5],
             "data_wait": [0.01, 0.2, 0.012]} for s in range(1, 21)]
    text = render(tmp_path, rows, [], {}, sessions)
    assert "**60.6%** of the 33.0s since the run's first start" in text  # 20 s of 33
    assert "| restarts (detection, relaunch) | 7.0s | 21.2% |" in text
    assert "| 2 | 10 → 20 | 13.0s | 10.0s | (the last) |" in text
    assert "Straggler: process 1 waits for input longer than the others" in text
    assert plot_goodput(sessions, tmp_path / "goodput.png", "run") and (tmp_path / "goodput.png").stat().st_size > 0


# A stand-in for `python -m jaxgpt.train` (the launcher's $PYTHON): it logs what it was started as and
# does what PLAN says for (attempt, process): exit with a code, write a hang verdict first, or hang.
FAKE_TRAIN = """#!/usr/bin/env bash
[[ "$1" == -c ]] && exec "$REAL_PYTHON" "$@"  # the launcher's own use of Python (a free port)
log="$FAKE_DIR/log"
echo "attempt=$JAXGPT_RESTART_COUNT process=$PROCESS_ID of=$NUM_PROCESSES full=${JAXGPT_ELASTIC_PROCESSES:-} reason=$JAXGPT_RESTART_REASON" >> "$log"
action=$(awk -v a="$JAXGPT_RESTART_COUNT" -v p="$PROCESS_ID" '$1 == a && $2 == p {print $3}' "$FAKE_DIR/plan")
case "$action" in
  "") exit 0 ;;
  hang) exec sleep 600 ;;
  suspect*) sleep 0.5; printf '%s\\nprocess %s is missing: its last heartbeat 12 s ago\\n' "${action#suspect}" \\
              "${action#suspect}" > "$JAXGPT_LAUNCH_DIR/hang.$PROCESS_ID"; exit 76 ;;
  down*) touch "$JAXGPT_LAUNCH_DIR/down/${action#down}"; exit 137 ;;
  up*) rm "$JAXGPT_LAUNCH_DIR/down/${action#up}"; sleep 0.3; exit 9 ;;
  *) sleep 0.3; exit "$action" ;;
esac
"""


def _launch(tmp_path, args: list[str], plan: str, extra_env: dict | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_TRAIN)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "plan").write_text(plan)
    (tmp_path / "launch" / "down").mkdir(parents=True)
    env = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "FAKE_DIR": str(tmp_path),
           "JAXGPT_LAUNCH_DIR": str(tmp_path / "launch"),
           "JAXGPT_HEARTBEAT_TIMEOUT": "1", **(extra_env or {})}
    proc = subprocess.run(["bash", "launch_multihost.sh", *args, "--", "--run-dir", "unused"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    log = (tmp_path / "log").read_text().splitlines() if (tmp_path / "log").exists() else []
    return proc, log


def _said(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "restarting" in line or "stopping" in line or "leaving" in line]


def test_elastic_launcher_leaves_out_a_failing_host_then_stops_on_77(tmp_path):
    """--max-restarts counts each host's failures with --min-processes: host 2 fails twice, is left
    out, the group restarts on hosts 0 and 1 as processes 0 and 1 of 2 (told the full count, 3);
    exit 77 (too few for the global batch) is not restarted."""
    plan = "0 2 1\n1 2 1\n2 1 77\n"
    proc, log = _launch(tmp_path, ["--local", "3", "--max-restarts", "1", "--min-processes", "2"], plan)
    assert proc.returncode == 77, proc.stderr
    assert _said(proc) == [
        "launch_multihost: process 2 exited with code 1; restarting the group on 3 of 3 processes (hosts 0 1 2; restart 1)",
        "launch_multihost: host 2 failed more than --max-restarts 1 times: leaving it out",
        "launch_multihost: process 2 exited with code 1; restarting the group on 2 of 3 processes (hosts 0 1; restart 2); was 3"]
    assert sorted(line.split(" reason=")[0] for line in log if line.startswith("attempt=2")) == [
        "attempt=2 process=0 of=2 full=3", "attempt=2 process=1 of=2 full=3"]


def test_elastic_launcher_shrinks_grows_back_and_stops_below_the_minimum(tmp_path):
    """Host 1 goes (its down file, as scripts/chaos.py simulates a lost host): the group restarts on
    hosts 0 and 2, host 2 running as process 1. Host 1 comes back: the next failure's restart grows
    the group to 3. Hosts go until fewer than --min-processes are left: the launcher stops there,
    with the failure's code."""
    plan = "0 1 down1\n1 1 up1\n2 0 down0\n3 0 down1\n"
    proc, log = _launch(tmp_path, ["--local", "3", "--max-restarts", "5", "--min-processes", "2"], plan)
    assert proc.returncode == 137, proc.stderr
    killed = "exited with code 137 (killed by SIGKILL)"
    assert _said(proc) == [
        f"launch_multihost: process 1 {killed}; restarting the group on 2 of 3 processes (hosts 0 2; restart 1); was 3",
        "launch_multihost: process 1 exited with code 9; restarting the group on 3 of 3 processes (hosts 0 1 2; "
        "restart 2); was 2",
        f"launch_multihost: process 0 {killed}; restarting the group on 2 of 3 processes (hosts 1 2; restart 3); was 3",
        f"launch_multihost: process 0 {killed}; 1 processes left, fewer than --min-processes 2: stopping (the run dir "
        f"keeps its checkpoints; the same command resumes once hosts are back)"]
    assert "launch_multihost: process 1 is pid" in proc.stderr and " (host 2)" in proc.stderr
    assert sorted(line.split(" reason=")[0] for line in log if line.startswith("attempt=1")) == [
        "attempt=1 process=0 of=2 full=3", "attempt=1 process=1 of=2 full=3"]


def test_a_hang_kills_the_rest_soon_and_blames_the_process_named(tmp_path):
    """Process 0 exits 76 naming process 1, which hangs: the launcher kills it within its grace (5 s,
    not the heartbeat's), blames host 1 and says the verdict in its restart line."""
    plan = "0 0 suspect1\n0 1 hang\n"
    started = time.monotonic()
    proc, log = _launch(tmp_path, ["--local", "2", "--max-restarts", "1", "--min-processes", "1"], plan,
                        {"JAXGPT_HEARTBEAT_TIMEOUT": "600"})
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 60
    assert _said(proc) == [
        "launch_multihost: process 0 exited with code 76: hang: process 1 is missing: its last heartbeat 12 s ago; "
        "restarting the group on 2 of 2 processes (hosts 0 1; restart 1)"]
    assert "process 1 exited with code 137 (killed by SIGKILL)" in proc.stderr


@pytest.mark.parametrize("args, says", [
    (["--local", "2", "--min-processes", "3"], "--min-processes 3 is more than --local 2"),
    (["--k8s", "--nodes", "2", "--pvc", "x", "--min-processes", "1", "--dry-run"], "--min-processes is for --local and --slurm"),
    (["--min-processes", "1"], "--min-processes is for --local and --slurm"),
    (["--local", "2", "--min-processes", "x"], "--min-processes needs a process count"),
])
def test_min_processes_arguments_are_checked_in_one_line(args, says):
    proc = subprocess.run(["bash", "launch_multihost.sh", *args, "--"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "2",
                                           "PROCESS_ID": "0"})
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and says in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1


FAKE_SLURM = {
    "srun": """#!/usr/bin/env bash
n=$(cat "$FAKE_DIR/calls" 2>/dev/null || echo 0); echo $((n + 1)) > "$FAKE_DIR/calls"
echo "srun $* full=$JAXGPT_ELASTIC_PROCESSES" >> "$FAKE_DIR/log"
if (( n == 0 )); then touch "$FAKE_DIR/node2.down"; exit 1; fi
exit 0
""",
    "sinfo": """#!/usr/bin/env bash
node=${@: -3:1}
[[ -e "$FAKE_DIR/$node.down" ]] && echo "down*" || echo "alloc"
""",
    "scontrol": """#!/usr/bin/env bash
printf 'node1\\nnode2\\nnode3\\n'
""",
}


def test_slurm_elastic_restart_runs_srun_on_the_nodes_still_up(tmp_path):
    """--slurm --min-processes: after a failure, node2 is down in sinfo; srun runs again on node1 and
    node3 only, the processes told that the run was started on 3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKE_SLURM.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
           "SLURM_JOB_NODELIST": "node[1-3]", "JAXGPT_NO_GPU_FLAGS": "1"}
    proc = subprocess.run(["bash", "launch_multihost.sh", "--slurm", "--max-restarts", "1", "--min-processes", "2", "--",
                           "--run-dir", "r"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "log").read_text().splitlines()
    assert [c.split(" --ntasks-per-node")[0] for c in calls] == [
        "srun --nodes=3 --nodelist=node1,node2,node3", "srun --nodes=2 --nodelist=node1,node3"]
    assert all(c.endswith("full=3") for c in calls)
    assert _said(proc) == ["launch_multihost: srun exited with code 1; restarting the group on 2 of 3 processes "
                           "(hosts node1 node3; restart 1); was 3"]



def test_a_local_tier_needs_a_writable_local_dir(tmp_path):
    from jaxgpt.config import validate
    from jaxgpt.resilience.local_tier import check_dir

    with pytest.raises(UserError, match=r"checkpoint.local_every=5 needs checkpoint.local_dir, a host-local directory"):
        validate(tiny_config("checkpoint.local_every=5"), 8)
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="checkpoint.local_dir"):
        check_dir(tiny_config("checkpoint.local_every=5", f"checkpoint.local_dir={tmp_path / 'file'}"))
    check_dir(tiny_config("checkpoint.local_every=5", f"checkpoint.local_dir={tmp_path / 'new'}"))

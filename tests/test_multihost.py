"""Real multi-process runs on 127.0.0.1: 2 processes x 4 CPU devices, gloo collectives.

The 1-process x 8-device runs they are compared with happen in this pytest process (8 fake devices)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml
from helpers import REPO, TINY, read_metrics, restore_run, tiny_config, train_losses, xla_flags

from jaxgpt.cli import EXIT_PREEMPTED, PEER_LOST
from jaxgpt.metrics import timing_key
from jaxgpt.resilience import goodput
from jaxgpt.train import train

# Constant learning rate, so a run stopped at step 4 and resumed to 8 follows the same schedule as
# a run straight to 8 (the schedule depends on train.steps).
RUN = [*TINY, "optimizer.warmup_steps=0", "optimizer.min_lr_ratio=1.0", "checkpoint.every=4"]
MESH = "dp=2,fsdp=4"
LOSS_ATOL = 1e-4  # same bound and reason as test_parallel.py: only the order of fp32 sums differs
HEARTBEAT_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(run_dir, *args: str, restarts: int = 0, mesh: str = MESH) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "XLA_FLAGS": xla_flags(None)}  # the launcher adds --devices-per-process
    env.update(PYTHON=sys.executable, JAXGPT_PORT=str(_free_port()), JAXGPT_HEARTBEAT_TIMEOUT=str(HEARTBEAT_S))
    return (["bash", "launch_multihost.sh", "--local", "2", "--devices-per-process", "4", "--max-restarts",
             str(restarts), "--", "--run-dir", str(run_dir), "--mesh", mesh, *RUN, *args], env)


def _launch_local(run_dir, *args: str, mesh: str = MESH) -> subprocess.CompletedProcess:
    command, env = _launcher(run_dir, *args, mesh=mesh)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory, shakespeare_dir):
    run_dir = tmp_path_factory.mktemp("one-process")
    train(tiny_config(*RUN, "train.steps=8", mesh=MESH), run_dir)
    return train_losses(run_dir)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, shakespeare_dir):
    """An uninterrupted 2-process run to step 8: (its run dir, the launcher's result)."""
    run_dir = tmp_path_factory.mktemp("two-processes")
    return run_dir, _launch_local(run_dir, "train.steps=8")


def test_two_processes_train_like_one(one_process_reference, two_process_run):
    tmp_path, proc = two_process_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(tmp_path)
    assert len(losses) == 8
    np.testing.assert_allclose(losses, one_process_reference, rtol=0, atol=LOSS_ATOL)
    assert proc.stdout.count("step      8 | loss") == 1  # only process 0 logs


def _final_state(run_dir):
    """The newest checkpoint of a 2-process run, restored here on the same 8-device mesh."""
    return restore_run(run_dir, tiny_config(*RUN, mesh=MESH))[0]


def test_launcher_restarts_the_group_after_a_process_dies(two_process_run, tmp_path):
    """torchrun's --max-restarts: process 1 is SIGKILLed after checkpoint 4; process 0 stops within
    the heartbeat, the launcher starts both again, they resume from step 4 and end bit for bit where
    an uninterrupted 2-process run ends, with the same metrics rows; the restart is on record."""
    reference, _ = two_process_run
    command, env = _launcher(tmp_path, "train.steps=8", restarts=1)
    log = tmp_path / "launcher.err"
    with log.open("w") as err:
        launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        deadline = time.monotonic() + 240
        while not ((tmp_path / "checkpoints" / "4" / "commit_success.txt").exists()
                   and any(r.get("step") == 5 for r in _metrics(tmp_path))):
            assert time.monotonic() < deadline and launcher.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        pid = int(log.read_text().split("process 1 is pid ")[1].split()[0])
        os.kill(pid, signal.SIGKILL)
        assert launcher.wait(timeout=300) == 0, log.read_text()[-3000:]
    stderr = log.read_text()
    assert "process 1 exited with code 137 (killed by SIGKILL); restarting the group (restart 1 of 1)" in stderr
    assert stderr.count("process 1 is pid") == 2
    ours, theirs = _final_state(tmp_path), _final_state(reference)
    assert ours.step == theirs.step == 8
    for a, b in zip(jax.tree.leaves(ours.state), jax.tree.leaves(theirs.state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert ([{k: v for k, v in r.items() if not timing_key(k)} for r in read_metrics(tmp_path)]
            == [{k: v for k, v in r.items() if not timing_key(k)} for r in read_metrics(reference)])
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    restart = [e for e in events if e["event"] == "restart"]
    assert len(restart) == 1 and restart[0]["step"] == 4 and restart[0]["restart"] == 1
    assert restart[0]["reason"] == "process 1 exited with code 137 (killed by SIGKILL)"
    report = (tmp_path / "report.md").read_text()
    assert "| automatic restarts | 1 |" in report
    assert "automatic restart 1 of 1 by the launcher (resuming at step 4): process 1 exited with code 137" in report


def _metrics(run_dir) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except (FileNotFoundError, ValueError):  # not written yet, or a line being written
        return []


def _start_two(run_dir) -> list[subprocess.Popen]:
    """Two processes started by hand (COORDINATOR_ADDRESS, NUM_PROCESSES, PROCESS_ID), training until step 3."""
    env = dict(os.environ)
    env.update(COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", NUM_PROCESSES="2", JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(4), JAXGPT_HEARTBEAT_TIMEOUT=str(HEARTBEAT_S))
    args = [sys.executable, "-m", "jaxgpt.train", "--run-dir", str(run_dir), "--mesh", MESH, *RUN,
            "train.steps=100000", "checkpoint.every=0"]
    procs = [subprocess.Popen(args, cwd=REPO, env={**env, "PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 120
    while len(train_losses(run_dir) if (run_dir / "metrics.jsonl").exists() else []) < 3:
        assert time.monotonic() < deadline and procs[0].poll() is None, "training did not start"
        time.sleep(0.2)
    return procs


def _jobset_pods(run_root, *args: str) -> list[subprocess.CompletedProcess]:
    """The JobSet that `launch_multihost.sh --k8s` renders, run as Kubernetes would run its 2 pods:
    each process gets the container's command, args and env, with the downward-API fields resolved
    (JobSet's coordinator annotation, here this machine's address standing in for pod 0's DNS name;
    restart attempt 0), the Job controller's JOB_COMPLETION_INDEX and a pod's KUBERNETES_SERVICE_HOST,
    and the volume at /runs (run_root; the run dir is its jaxgpt/). Nothing else is set."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    rendered = subprocess.run(["bash", "launch_multihost.sh", "--k8s", "--dry-run", "--nodes", "2", "--gpus-per-node", "4",
                               "--pvc", "runs", "--", "--mesh", MESH, *RUN, *args],
                              cwd=REPO, env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    [rjob] = yaml.safe_load(rendered.stdout)["spec"]["replicatedJobs"]
    [container] = rjob["template"]["spec"]["template"]["spec"]["containers"]
    annotations = {"jobset.sigs.k8s.io/coordinator": "127.0.0.1", "jobset.sigs.k8s.io/restart-attempt": "0"}
    pod_env = {}
    for e in container["env"]:
        path = e["valueFrom"]["fieldRef"]["fieldPath"] if "valueFrom" in e else None
        pod_env[e["name"]] = annotations[path.split("'")[1]] if path else e["value"]
    pod_env["XLA_FLAGS"] += " " + xla_flags(4)  # 4 CPU devices stand in for a pod's GPUs
    pod_env.update(KUBERNETES_SERVICE_HOST="10.96.0.1", JAX_PLATFORMS="cpu", JAX_COORDINATOR_PORT=str(_free_port()))
    assert container["command"][0] == "python"
    argv = [sys.executable, *container["command"][1:], *[a.replace("/runs", str(run_root)) for a in container["args"]]]
    procs = [subprocess.Popen(argv, cwd=REPO, env={**env, **pod_env, "JOB_COMPLETION_INDEX": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs)]


def test_a_run_moves_between_two_processes_one_and_jobset_pods_and_trains_like_one(one_process_reference, tmp_path,
                                                                                   capsys):
    """One run, three ways of running it, each resuming the one before from its checkpoint:
    steps 1-4 on 2 processes launched by launch_multihost.sh with pp=2 the outermost mesh axis, so
    each process holds one stage (the activations cross between the processes over gloo, and both
    processes load the same rows); steps 5-6 on one process (this one, dp x fsdp); steps 7-8 as the
    2 pods of the JobSet that `launch_multihost.sh --k8s` renders, which find each other without
    JAX's own Kubernetes detection (it would ask the Kubernetes API). Checkpoints move from 2
    processes to 1 and back, and from a pipeline mesh to a flat one; every loss is the one-process
    dp x fsdp run's."""
    run_dir = tmp_path / "jaxgpt"  # where the JobSet's volume (/runs) puts its run
    run_dir.mkdir()
    proc = _launch_local(run_dir, "train.steps=4", mesh="pp=2,dp=2,fsdp=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("step      4 | loss") == 1  # only process 0 logs
    train(tiny_config(*RUN, "train.steps=6", "checkpoint.every=2", mesh=MESH), run_dir)
    assert "resuming from step 4" in capsys.readouterr().out
    pods = _jobset_pods(tmp_path, "train.steps=8", "checkpoint.every=2")
    assert [p.returncode for p in pods] == [0, 0], pods[0].stderr[-3000:] + pods[1].stderr[-3000:]
    assert not any("Kubernetes environment detected" in p.stderr for p in pods)
    assert "resuming from step 6" in pods[0].stdout
    np.testing.assert_allclose(train_losses(run_dir), one_process_reference, rtol=0, atol=LOSS_ATOL)


def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    procs = _start_two(tmp_path)
    procs[1].send_signal(signal.SIGTERM)
    stderrs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [EXIT_PREEMPTED, EXIT_PREEMPTED], stderrs[0][-2000:]
    steps = {int(e.split("stopped at step ")[1].split(";")[0]) for e in stderrs}
    assert len(steps) == 1, steps  # both processes agreed on one step
    assert (tmp_path / "checkpoints" / str(steps.pop()) / "commit_success.txt").exists()


def test_ctrl_c_to_a_local_job_saves_one_step_and_exits_75(tmp_path):
    """A terminal's Ctrl-C reaches the launcher and every process: all stop at one step, save it and
    exit 75, and so does the launcher (it used to die of an unset variable, and the processes with
    nothing saved). While it runs, a second job on its port is refused in one line."""
    command, env = _launcher(tmp_path, "train.steps=100000", "checkpoint.every=0")
    log = tmp_path / "launcher.err"
    with log.open("w") as err:
        launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
        deadline = time.monotonic() + 120
        while len(_metrics(tmp_path)) < 4:
            assert time.monotonic() < deadline and launcher.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        second = subprocess.run(["bash", "launch_multihost.sh", "--local", "2", "--", "--run-dir", str(tmp_path / "b")],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        os.killpg(launcher.pid, signal.SIGINT)
        assert launcher.wait(timeout=120) == EXIT_PREEMPTED, log.read_text()[-3000:]
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert f"error: port {env['JAXGPT_PORT']} (JAXGPT_PORT) is in use on this machine" in second.stderr
    stderr = log.read_text()
    steps = {int(line.split("stopped at step ")[1].split(";")[0]) for line in stderr.splitlines() if "stopped at step" in line}
    assert stderr.count("preempted: stopped at step") == 2 and len(steps) == 1, stderr[-3000:]
    assert (tmp_path / "checkpoints" / str(steps.pop()) / "commit_success.txt").exists()


def test_a_dead_process_stops_the_other_within_the_heartbeat_bound(tmp_path):
    procs = _start_two(tmp_path)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    _, stderr = procs[0].communicate(timeout=HEARTBEAT_S + 60)
    waited = time.monotonic() - killed_at
    procs[1].communicate()
    assert procs[0].returncode != 0
    if PEER_LOST in stderr:  # the step's collective failed first: one line, and no shutdown abort
        assert procs[0].returncode == 1 and "Traceback" not in stderr and "Terminating process" not in stderr, stderr[-3000:]
    else:  # the coordination service noticed first (its C++ abort)
        assert "another task died" in stderr or "heartbeat timeout" in stderr, stderr[-2000:]
    assert waited < HEARTBEAT_S + 60  # bounded by the heartbeat, not a hang


@pytest.mark.parametrize("env, says", [
    ({"NUM_PROCESSES": "abc", "PROCESS_ID": "0"}, "environment variable NUM_PROCESSES='abc' must be an integer >= 1"),
    ({"NUM_PROCESSES": "2", "PROCESS_ID": "5"}, "PROCESS_ID=5 must be below NUM_PROCESSES=2"),
    ({"NUM_PROCESSES": "2", "PROCESS_ID": "0", "JAXGPT_HEARTBEAT_TIMEOUT": "abc"}, "JAXGPT_HEARTBEAT_TIMEOUT='abc'"),
    ({"NUM_PROCESSES": "2", "PROCESS_ID": "0", "LOCAL_DEVICE_IDS": "0,x"}, "LOCAL_DEVICE_IDS='0,x' must be device numbers"),
])
def test_a_bad_multi_process_environment_is_one_line(monkeypatch, env, says):
    """Checked before jax.distributed starts (each was a ValueError traceback on every process)."""
    from jaxgpt.errors import UserError
    from jaxgpt.parallel import distributed

    monkeypatch.setenv("COORDINATOR_ADDRESS", "127.0.0.1:1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=says.replace("(", r"\(")):
        distributed.initialize()


@pytest.mark.parametrize("args, says", [
    (["--local"], "--local needs a value"),  # was bash's "$2: unbound variable"
    (["--local", "99999999999999999999", "--", "--help"], "from 1 to 64"),  # bash's arithmetic wrapped: 650+ processes
    (["--local", "1", "--devices-per-process", "abc", "--"], "--devices-per-process needs a count"),  # was XLA's fatal
    (["--local", "1", "--slurm", "--"], "are ways to launch; give one"),
    (["--local", "1", "--per-gpu", "--"], "--per-gpu is for GPU hosts"),
])
def test_launcher_arguments_are_checked_in_one_line(args, says):
    proc = subprocess.run(["bash", "launch_multihost.sh", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and says in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "launch_multihost: process" not in proc.stdout, proc.stderr


def test_tp_across_hosts_is_refused(tmp_path):
    proc = _launch_local(tmp_path, "train.steps=2", "model.n_head=8", mesh="dp=1,tp=8")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "would cross hosts" in proc.stderr and "Traceback" not in proc.stderr


def test_comm_bench_reports_bus_bandwidth(tmp_path):
    out = tmp_path / "comm.json"
    proc = subprocess.run([sys.executable, "scripts/comm_bench.py", "--min-bytes", "1K", "--max-bytes", "64K",
                           "--iters", "2", "--json", str(out)], cwd=REPO, env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {r["kind"] for r in rows} == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all"}
    assert len(rows) == 4 * 4  # 1K, 4K, 16K, 64K for each kind
    assert all(f"{r['kind']:>15}" in proc.stdout for r in rows)
    for r in rows:
        assert r["algbw_GBps"] > 0 and r["bytes"] >= 1024
        factor = 2 * 7 / 8 if r["kind"] == "all-reduce" else 7 / 8  # nccl-tests' factors for n = 8
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)


def _pid(log, process: int) -> int:
    """The newest pid the launcher started `process` as."""
    return int(log.read_text().split(f"process {process} is pid ")[-1].split()[0])


def _wait(predicate, launcher, log, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert launcher.poll() is None, f"the launcher ended before {what}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {log.read_text()[-3000:]}"
        time.sleep(0.05)


def test_chaos_a_hang_then_a_lost_host_and_the_run_ends_as_an_undisturbed_one(one_process_reference, two_process_run,
                                                                               tmp_path):
    """Issue 60's chaos run, short (scripts/chaos.py runs the long one): 2 processes with a local tier
    every step. Process 1 is stopped (SIGSTOP, a hang): process 0's watchdog names it and exits 76
    within train.hang_timeout, the launcher kills process 1 and restarts the group, which resumes
    from the local tier. Then host 1 is lost for good (its down file, SIGKILL): the group restarts
    on process 0 alone, dp 2 -> 1 and train.grad_accum 1 -> 2, from the persistent tier (the local one
    is of 2 processes). The run ends with the losses and parameters of an undisturbed run (fp32, the
    layout tolerance), every train row once, each fault named in one launcher line, goodput's parts
    adding up to its wall clock."""
    run, launch = tmp_path / "run", tmp_path / "launch"
    (launch / "down").mkdir(parents=True)
    env = {**os.environ, "XLA_FLAGS": xla_flags(None), "PYTHON": sys.executable, "JAXGPT_PORT": str(_free_port()),
           "JAXGPT_HEARTBEAT_TIMEOUT": "60", "JAXGPT_LAUNCH_DIR": str(launch)}
    command = ["bash", "launch_multihost.sh", "--local", "2", "--devices-per-process", "4", "--max-restarts", "1",
               "--min-processes", "1", "--", "--run-dir", str(run), "--mesh", MESH, *RUN, "train.steps=8",
               "checkpoint.local_every=1", f"checkpoint.local_dir={tmp_path / 'local'}", "train.hang_timeout=8"]
    log = tmp_path / "launcher.err"
    with log.open("w") as err, (tmp_path / "launcher.out").open("w") as out:
        launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        try:
            _wait(lambda: len(_metrics(run)) >= 3, launcher, log, "step 3")
            stalled = max(r["step"] for r in _metrics(run))
            os.kill(_pid(log, 1), signal.SIGSTOP)
            _wait(lambda: log.read_text().count("is pid") == 4 and any(r["step"] >= 6 for r in _metrics(run)),
                  launcher, log, "step 6 after the restart")
            (launch / "down" / "1").touch()
            os.kill(_pid(log, 1), signal.SIGKILL)
            assert launcher.wait(timeout=300) == 0, log.read_text()[-3000:]
        finally:
            if launcher.poll() is None:
                launcher.kill()
    said = [line for line in log.read_text().splitlines() if "restarting the group" in line]
    assert len(said) == 2, log.read_text()[-3000:]
    # process 1 named: "missing" once its heartbeat is older than the watchdog's STALE_S (10 s), else
    # "behind" (its last heartbeat, at the step before the others'): which one depends on how soon after
    # the stop process 0 began waiting, and on the machine's load
    assert re.match(r"launch_multihost: process 0 exited with code 76: hang: process 1 is (missing: its last heartbeat |"
                    r"behind, \d+ s at step \d+ )", said[0]), said[0]
    assert said[0].endswith("restarting the group on 2 of 2 processes (hosts 0 1; restart 1)"), said[0]
    assert said[1] == ("launch_multihost: process 1 exited with code 137 (killed by SIGKILL); restarting the group on "
                       "1 of 2 processes (hosts 0; restart 2); was 2")
    stdout = (tmp_path / "launcher.out").read_text()
    resumed = [int(line.split("resuming from step ")[1].split()[0]) for line in stdout.splitlines() if "resuming" in line]
    # a step or two lost at most: the newest local step (every step, asynchronous; the stopped process may
    # have finished one more than process 0 had logged when it was stopped)
    assert len(resumed) == 2 and stalled - 2 <= resumed[0] <= stalled + 1 and resumed[1] == 4, (stalled, resumed)
    assert f"resuming from step {resumed[0]} ({tmp_path / 'local'}" in stdout  # the local tier
    assert ("elastic: 1 of the 2 processes this run was started on: mesh dp=1 (was 2), train.grad_accum=2 (was 1); "
            "the global batch of 16 sequences and the data order are unchanged") in stdout
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 9))
    np.testing.assert_allclose(train_losses(run), one_process_reference, rtol=0, atol=LOSS_ATOL)
    ours, theirs = _final_state(run), _final_state(two_process_run[0])
    assert ours.step == theirs.step == 8
    for a, b in zip(jax.tree.leaves(ours.state), jax.tree.leaves(theirs.state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=LOSS_ATOL)
    assert list((run / "hangs").glob("step-*.attempt-0/process-0.txt"))
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] in ("restart", "elastic")] == ["restart", "restart", "elastic"]
    total = goodput.summarize(goodput.read(run))
    starts, ends = [e["time"] for e in events if e["event"] == "start"], [e["time"] for e in events if e["event"] == "end"]
    assert len(starts) == 3 and len(ends) == 1 and total["lost"] > 0 and total["restarts"] > 0
    assert sum(total[p] for p in goodput.PARTS) == pytest.approx(total["wall"], abs=0.01)  # records keep ms
    assert total["wall"] == pytest.approx(ends[0] - starts[0], rel=0.01)
    assert "## Goodput" in (run / "report.md").read_text() and (run / "goodput.png").exists()

"""Issue 60's chaos test, the long one: a 4-process CPU run with faults injected at random moments.

    python scripts/chaos.py [--runs 5] [--steps 200] [--seed 0] [--work DIR] [--json FILE]

One undisturbed run first (the reference: `launch_multihost.sh --local 4`, 4 processes x 2 CPU
devices, mesh dp=4,fsdp=2, a tiny GPT, 24 sequences a step), then RUNS chaos runs of the same
command with `--max-restarts 3 --min-processes 3`, local checkpoints every 5 steps beside the
persistent ones every 25, and train.hang_timeout=15. Each chaos run draws (from its seed) five steps
at least 20 apart and injects, at the first train row at or past each:

    kill   SIGKILL of a random process
    hang   SIGSTOP of a random process (its watchdog peers must name it and exit 76)
    wipe   a random process's local checkpoint tier deleted, then that process SIGKILLed (a host
           that rebooted: the restart must fall back to the persistent tier)
    lost   a random host marked gone ($JAXGPT_LAUNCH_DIR/down/H) and its process SIGKILLed: the
           group restarts on 3 processes, dp 4 -> 3, train.grad_accum 1 -> 2
    back   the host's mark removed and a random process SIGKILLed: the group grows back to 4

(kill, hang and wipe in a random order, then lost, then back). It then checks what issue 60 asks:
the launcher ends with 0; each fault is named by exactly one launcher restart line (and a wipe by
the processes' local-tier line); metrics.jsonl holds every train, eval and goodput row exactly once
and their values equal the reference's (losses within 1e-4: fp32, the layout tolerance of
tests/test_parallel.py); the persistent checkpoints are the reference's, none damaged or left
half-written, the local tier deleted; the final parameters equal the reference's within 1e-4; the
goodput parts add up to its wall clock within 1%, and that wall clock to the events' within 1%; a
hang is detected and the group restarted within 2 x train.hang_timeout; and the work lost to each
fault where the local tier survived (kill, hang) is at most checkpoint.local_every + 1 steps (the
steps after the newest local save, plus the one it takes to commit: jaxgpt/loop.py). It prints
one line per fault and run and a summary, and writes everything measured to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROCESSES, DEVICES, MESH = 4, 2, "dp=4,fsdp=2"
EVERY, LOCAL_EVERY, HANG_TIMEOUT, EVAL_EVERY = 25, 5, 15, 50
TOL = 1e-4  # tests/test_parallel.py's LOSS_ATOL; the same bound for the parameters
CONFIG = ["model.n_layer=2", "model.n_head=4", "model.n_embd=32", "model.seq_len=32", "model.loss_chunk=8",
          "train.batch_size=24", "logging.every=1", f"train.eval_every={EVAL_EVERY}", "train.eval_batches=1",
          f"checkpoint.every={EVERY}", "logging.tensorboard=false"]
CHAOS = [f"checkpoint.local_every={LOCAL_EVERY}", f"train.hang_timeout={HANG_TIMEOUT}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run: Path, steps: int, extra: list[str], launcher_args: list[str], launch_dir: Path):
    env = {**os.environ, "PYTHON": sys.executable, "JAXGPT_PORT": str(free_port()), "JAXGPT_HEARTBEAT_TIMEOUT": "60",
           "JAXGPT_LAUNCH_DIR": str(launch_dir), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    command = ["bash", "launch_multihost.sh", "--local", str(PROCESSES), "--devices-per-process", str(DEVICES),
               *launcher_args, "--", "--run-dir", str(run), "--mesh", MESH, *CONFIG, f"train.steps={steps}", *extra]
    out, err = (run.parent / f"{run.name}.out").open("w"), (run.parent / f"{run.name}.err").open("w")
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err, text=True), run.parent / f"{run.name}.err"


def rows(run: Path) -> list[dict]:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def last_step(run: Path) -> int:
    return max((r["step"] for r in rows(run) if "loss" in r), default=0)


def processes(err: Path) -> dict[int, tuple[int, int]]:
    """The current attempt's {process: (pid, host)} from the launcher's lines."""
    text = err.read_text().split("restarting the group")[-1]
    out = {}
    for line in text.splitlines():
        if " is pid " in line and line.startswith("launch_multihost: process "):
            words = line.split()
            process, pid = int(words[2]), int(words[5])
            host = int(line.split("(host ")[1].rstrip(")")) if "(host " in line else process
            out[process] = (pid, host)
    return out


def restarts(err: Path) -> list[str]:
    return [line for line in err.read_text().splitlines() if "restarting the group" in line]


def wait_for(predicate, proc, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"the launcher ended (code {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def schedule(rng: random.Random, steps: int) -> list[tuple[str, int]]:
    while True:
        at = sorted(rng.sample(range(15, steps - 15), 5))
        if all(b - a >= 20 for a, b in zip(at, at[1:])):
            break
    kinds = ["kill", "hang", "wipe"]
    rng.shuffle(kinds)
    return list(zip([*kinds, "lost", "back"], at))


def restore(run: Path):
    """The run's newest persistent checkpoint on this process's 8 CPU devices, mesh dp=4,fsdp=2."""
    import jax

    from jaxgpt.checkpoint import Checkpointer
    from jaxgpt.config import load_config, validate
    from jaxgpt.parallel.mesh import make_mesh
    from jaxgpt.step import abstract_state, make_setup

    cfg = load_config(None, CONFIG, MESH)
    mesh = make_mesh(validate(cfg, 8))
    with jax.set_mesh(mesh):
        ckpt = Checkpointer(run / "checkpoints", cfg.checkpoint)
        try:
            return ckpt.restore_latest(abstract_state(cfg, make_setup(cfg, mesh)))
        finally:
            ckpt.close()


def kind(row: dict) -> str:
    return "goodput" if "goodput" in row else "eval" if "val_loss" in row else "train" if "loss" in row else "?"


def compare_rows(ours: list[dict], theirs: list[dict]) -> tuple[list[str], float]:
    """(problems, the largest loss difference): every row once, the values the reference's."""
    from jaxgpt.metrics import timing_key

    problems, worst = [], 0.0
    keys = [(r["step"], kind(r)) for r in ours]
    if len(keys) != len(set(keys)):
        problems.append(f"{len(keys) - len(set(keys))} duplicated rows")
    reference = {(r["step"], kind(r)): r for r in theirs}
    if set(keys) != set(reference):
        problems.append(f"rows missing {sorted(set(reference) - set(keys))[:5]}, extra {sorted(set(keys) - set(reference))[:5]}")
    for r in ours:
        ref = reference.get((r["step"], kind(r)))
        if ref is None:
            continue
        for key, value in r.items():
            if timing_key(key) or key == "step":
                continue
            if key not in ref:
                problems.append(f"step {r['step']} {kind(r)}: {key} not in the reference")
            elif isinstance(value, float) and value is not None and ref[key] is not None:
                diff = abs(value - ref[key])
                if key in ("loss", "val_loss"):
                    worst = max(worst, diff)
                if diff > TOL * max(1.0, abs(ref[key])):
                    problems.append(f"step {r['step']} {key} {value} vs {ref[key]}")
            elif value != ref[key]:
                problems.append(f"step {r['step']} {key} {value!r} vs {ref[key]!r}")
    return problems, worst


def goodput_checks(run: Path) -> tuple[dict, list[str]]:
    from jaxgpt.resilience import goodput

    total = goodput.summarize(goodput.read(run))
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    first = min(e["time"] for e in events if e["event"] == "start")
    end = max(e["time"] for e in events if e["event"] == "end")
    parts = sum(total[p] for p in goodput.PARTS)
    problems = []
    if abs(parts - total["wall"]) > 0.01 * total["wall"]:
        problems.append(f"goodput parts {parts:.1f} s vs its wall {total['wall']:.1f} s")
    if abs(total["wall"] - (end - first)) > 0.01 * (end - first):
        problems.append(f"goodput wall {total['wall']:.1f} s vs the events' {end - first:.1f} s")
    return {**{k: round(v, 3) for k, v in total.items()}, "parts_sum": round(parts, 3),
            "events_wall": round(end - first, 3)}, problems


def chaos_run(work: Path, index: int, seed: int, steps: int, reference: Path) -> dict:
    rng = random.Random(seed)
    run, launch_dir, local = work / f"chaos{index}", work / f"launch{index}", work / f"local{index}"
    for path in (run, launch_dir, local):
        shutil.rmtree(path, ignore_errors=True)
    (launch_dir / "down").mkdir(parents=True)
    plan = schedule(rng, steps)
    started = time.time()
    proc, err = launch(run, steps, [*CHAOS, f"checkpoint.local_dir={local}"],
                       ["--max-restarts", "3", "--min-processes", "3"], launch_dir)
    faults, lost_host = [], None
    try:
        for fault, at in plan:
            wait_for(lambda: last_step(run) >= at and len(processes(err)) >= 3, proc, f"step {at}", 1200)
            before, seen = len(restarts(err)), last_step(run)
            current = processes(err)
            victim = rng.choice(sorted(current))
            pid, host = current[victim]
            if fault == "hang":
                os.kill(pid, signal.SIGSTOP)
            elif fault == "wipe":
                shutil.rmtree(next(local.glob(f"*/process-{victim}-of-{len(current)}"), local / "none"), ignore_errors=True)
                os.kill(pid, signal.SIGKILL)
            elif fault == "lost":
                lost_host = host
                (launch_dir / "down" / str(host)).touch()
                os.kill(pid, signal.SIGKILL)
            elif fault == "back":
                (launch_dir / "down" / str(lost_host)).unlink()
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            t0 = time.time()
            wait_for(lambda: len(restarts(err)) > before, proc, f"the restart after the {fault}", 600)
            faults.append({"fault": fault, "step": at, "seen": seen, "process": victim, "host": host,
                           "processes": len(current), "detected_s": round(time.time() - t0, 2),
                           "line": restarts(err)[before]})
        code = proc.wait(timeout=3600)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (work / f"chaos{index}.out").read_text()
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    resumed = [e["step"] for e in events if e["event"] == "start"][1:]  # where each session after a fault began
    said = restarts(err)
    problems = [] if code == 0 else [f"the launcher exited {code}"]
    if len(said) != len(plan):
        problems.append(f"{len(said)} restart lines for {len(plan)} faults")
    for f, n in zip(faults, resumed):
        f["resumed"] = n
        f["lost_steps"] = f["seen"] - n
        expect = {"kill": "exited with code 137 (killed by SIGKILL); restarting the group on 4 of 4",
                  "wipe": "exited with code 137 (killed by SIGKILL); restarting the group on 4 of 4",
                  "hang": f"exited with code 76: hang: process {f['process']} is missing",
                  "lost": f"process {f['process']} exited with code 137 (killed by SIGKILL); restarting the group on 3 of 4",
                  "back": "exited with code 137 (killed by SIGKILL); restarting the group on 4 of 4"}[f["fault"]]
        if expect not in f["line"]:
            problems.append(f"{f['fault']}: the launcher said {f['line']!r}")
        if f["fault"] == "hang" and f["detected_s"] > 2 * HANG_TIMEOUT:
            problems.append(f"hang detected and restarted after {f['detected_s']} s > 2 x {HANG_TIMEOUT}")
        # a local save commits while the next step runs (jaxgpt/loop.py): local_every + 1 steps at most
        if f["fault"] in ("kill", "hang") and f["lost_steps"] > LOCAL_EVERY + 1:
            problems.append(f"{f['fault']} at step {f['seen']} resumed from {n}: {f['lost_steps']} steps lost")
    wiped = [line for line in out.splitlines() + err.read_text().splitlines() if "is not on every process" in line]
    if sum(f["fault"] == "wipe" for f in faults) and not wiped:
        problems.append("no line said the wiped local tier")
    if "elastic: 3 of the 4 processes" not in out:
        problems.append("no elastic line")
    row_problems, loss_diff = compare_rows(rows(run), rows(reference))
    problems += row_problems
    ours, theirs = restore(run), restore(reference)
    import jax
    import numpy as np

    param_diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                     for a, b in zip(jax.tree.leaves(ours.state.params), jax.tree.leaves(theirs.state.params)))
    if ours.step != theirs.step or param_diff > TOL:
        problems.append(f"final parameters at step {ours.step}: {param_diff:.3g} from the reference's")
    ckpts = lambda r: sorted(p.name for p in (r / "checkpoints").iterdir() if p.name != "damaged")  # noqa: E731
    if ckpts(run) != ckpts(reference) or (run / "checkpoints" / "damaged").exists():
        problems.append(f"checkpoints {ckpts(run)} vs the reference's {ckpts(reference)}")
    if any(local.iterdir()):
        problems.append(f"the local tier is still there: {[p.name for p in local.iterdir()]}")
    good, good_problems = goodput_checks(run)
    problems += good_problems
    if "goodput " not in out or "## Goodput" not in (run / "report.md").read_text():
        problems.append("goodput was not printed or reported")
    return {"run": index, "seed": seed, "steps": steps, "wall_s": round(time.time() - started, 1), "faults": faults,
            "final_loss_diff": loss_diff, "final_param_diff": param_diff, "goodput": good, "problems": problems,
            "passed": not problems}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("runs/chaos"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 130:
        parser.error("--steps must be at least 130 (five faults 20 steps apart)")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # this process: 8 devices to restore on
    os.environ["JAX_PLATFORMS"] = "cpu"
    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    reference = work / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    started = time.time()
    proc, err = launch(reference, args.steps, [], [], work / "launch-reference")
    if proc.wait(timeout=3600) != 0:
        print(f"the reference run failed: {err.read_text()[-2000:]}", file=sys.stderr)
        return 1
    print(f"reference: {args.steps} steps undisturbed in {time.time() - started:.0f} s", flush=True)
    results = []
    for i in range(args.runs):
        result = chaos_run(work, i, args.seed + i, args.steps, reference)
        results.append(result)
        for f in result["faults"]:
            print(f"run {i} {f['fault']:>4} process {f['process']} (host {f['host']}) at step {f['seen']}: restarted "
                  f"{f['detected_s']:5.1f} s later from step {f.get('resumed', '?')} ({f.get('lost_steps', '?')} steps "
                  f"computed again)", flush=True)
        g = result["goodput"]
        print(f"run {i}: {'PASS' if result['passed'] else 'FAIL'} in {result['wall_s']:.0f} s; final loss "
              f"{result['final_loss_diff']:.2g} and parameters {result['final_param_diff']:.2g} from the reference; "
              f"goodput {100 * g['goodput']:.1f}% of {g['wall']:.0f} s (parts {g['parts_sum']:.1f} s, events "
              f"{g['events_wall']:.1f} s)" + "".join(f"\n  problem: {p}" for p in result["problems"]), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"reference_s": None, "results": results}, indent=1))
    passed = sum(r["passed"] for r in results)
    print(f"{passed} of {len(results)} chaos runs passed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

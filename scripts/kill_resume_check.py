"""Kill -9 `python -m jaxgpt.train` at random moments, resume it each time, and compare the result
with an uninterrupted run of the same command: the claim "kill the job and resume it exactly".

    python scripts/kill_resume_check.py --mesh dp=2,fsdp=2,tp=2
    python scripts/kill_resume_check.py --mesh pp=2,fsdp=2,tp=2 --max-seconds 25 model.n_layer=4 train.grad_accum=2

Runs on 8 fake CPU devices (as the tests do) a tiny model for --steps steps with a checkpoint every
--every steps and an evaluation every 10. The reference run goes first; then the same command is
started again and again in a second run dir, each time killed (SIGKILL to its process group) after
a random 0.5 s to --max-seconds, until one attempt finishes. A kill can land anywhere: start-up,
compiling, a step, an evaluation, an async save, the metrics trim of a resume. Exit 0 when every
metrics.jsonl row (step, loss, grad_norm, lr, val_loss) is identical to the reference's, 1 otherwise
(the first difference printed), with the number of kills, the half-written saves the resumes
removed, and what checkpoints/damaged/ holds (damaged committed steps set aside, if any).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TINY = ["model.n_layer=2", "model.n_head=4", "model.n_embd=32", "model.seq_len=32", "train.batch_size=16",
        "logging.every=1", "optimizer.warmup_steps=2", "train.eval_every=10"]
KEYS = ("step", "loss", "grad_norm", "lr", "val_loss")


def run(cmd: list[str], env: dict, kill_after: float | None) -> tuple[int, str]:
    """(the command's exit code, or -9 if it was killed after `kill_after` seconds; its stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return -9, proc.communicate()[1]
    if proc.returncode:
        print(err[-2000:], file=sys.stderr)
    return proc.returncode, err


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: r[k] for k in KEYS if k in r} for r in map(json.loads, lines)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="dp=2,fsdp=2,tp=2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5, help="checkpoint.every")
    parser.add_argument("--max-seconds", type=float, default=12.0, help="latest kill after a start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="keep the two run dirs here (default: a temporary directory)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="jaxgpt-kill-"))
    for name in ("reference", "killed"):
        shutil.rmtree(root / name, ignore_errors=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")

    def command(run_dir: Path) -> list[str]:
        return [sys.executable, "-m", "jaxgpt.train", "--mesh", args.mesh, "--run-dir", str(run_dir), *TINY,
                f"train.steps={args.steps}", f"checkpoint.every={args.every}", *args.overrides]

    if run(command(root / "reference"), env, None)[0] != 0:
        return 1
    rng, kills, removed = random.Random(args.seed), 0, 0
    while True:
        after = rng.uniform(0.5, args.max_seconds)
        code, err = run(command(root / "killed"), env, after)
        removed += err.count("a save that never finished")
        print(f"attempt {kills + 1}: " + (f"killed after {after:.2f} s" if code == -9 else
                                          f"exit {code} before the kill due at {after:.2f} s"), flush=True)
        if code != -9:
            break
        kills += 1
    damaged = sorted(p.name for p in (root / "killed" / "checkpoints" / "damaged").glob("*"))
    want, got = rows(root / "reference"), rows(root / "killed")
    print(f"{kills} kills; {removed} half-written saves removed on resume; damaged/ holds {damaged or 'nothing'}; "
          f"run dirs in {root}")
    if code == 0 and want == got:
        print(f"identical: {len(got)} metrics rows")
        return 0
    first = next(((a, b) for a, b in zip(want, got) if a != b), None)
    print(f"DIFFERENT: {len(want)} vs {len(got)} rows; first difference: {first}")
    return 1


if __name__ == "__main__":
    sys.exit(main())

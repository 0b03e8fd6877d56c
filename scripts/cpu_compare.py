"""jaxgpt against the PyTorch reference on this CPU, side by side: runs alternate, medians and spread.

    python scripts/cpu_compare.py --torch-python /path/to/torch-env/bin/python
    python scripts/cpu_compare.py --torch-python T --rounds 5 --steps 8
    python scripts/cpu_compare.py --torch none --jax "auto:" --jax "chunk8: model.loss_chunk=8" \
        --jax "system: JAXGPT_ALLOCATOR=system"

Each round runs every variant once, in a fresh process, in the same order: jaxgpt variants
(`scripts/benchmark.py --mesh dp=1`, the compiled train step; `--jax-python`, default this
interpreter) then the reference's modes (`scripts/torch_reference.py`, `--torch-python`). So on a
machine shared with other work the variants see the same load in turn, and the spread over rounds
says how much that load moved them. A jaxgpt variant is `NAME: [ENV=VALUE ...] [section.key=value ...]`:
upper-case `KEY=VALUE` words go to the environment (XLA_FLAGS, JAXGPT_ALLOCATOR, GLIBC_TUNABLES),
the rest are config overrides for both sides (common ones: trailing `overrides`).

Prints the CPU (model name, cores), the load average before each run, each variant's tokens/s per
round, their median and min-max, and the ratio of each jaxgpt variant's median to the reference's
best median (eager or compiled), the issue-23 figure (goal >= 1.5x). Stdlib only: any Python runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def parse_variant(text: str) -> tuple[str, dict[str, str], list[str]]:
    name, _, rest = text.partition(":")
    words = shlex.split(rest)
    env = dict(w.split("=", 1) for w in words if ENV_WORD.match(w))
    return name.strip(), env, [w for w in words if not ENV_WORD.match(w)]


def run_one(cmd: list[str], env: dict[str, str], out: Path) -> dict | None:
    out.unlink(missing_ok=True)
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    if proc.returncode or not out.exists():
        sys.stderr.write(f"cpu_compare: {' '.join(cmd)} failed ({proc.returncode}): "
                         f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}\n")
        return None
    text = out.read_text()  # benchmark.py writes one indented object, torch_reference.py one line per mode
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--jax-python", default=sys.executable, help="interpreter with jaxgpt (default: this one)")
    parser.add_argument("--torch-python", help="interpreter with torch and jaxgpt (required unless --torch none)")
    parser.add_argument("--jax", action="append", metavar="NAME: [ENV=V ...] [overrides]",
                        help="a jaxgpt variant (repeatable; default 'jaxgpt:', the product as it runs)")
    parser.add_argument("--torch", action="append", choices=("eager", "compiled", "none"),
                        help="reference modes (repeatable; default eager and compiled)")
    parser.add_argument("--torch-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment of the reference's runs (e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    jax_variants = [parse_variant(v) for v in (args.jax or ["jaxgpt:"])]
    torch_modes = [m for m in (args.torch or ["eager", "compiled"]) if m != "none"]
    if torch_modes and not args.torch_python:
        parser.error("--torch-python is required to run the reference (or pass --torch none)")
    steps = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    variants = [(name, env, [args.jax_python, "scripts/benchmark.py", "--mesh", "dp=1", *steps, "--input-batches", "5",
                             *args.overrides, *overrides]) for name, env, overrides in jax_variants]
    torch_env = dict(kv.split("=", 1) for kv in args.torch_env)
    variants += [(f"torch {m}", torch_env, [args.torch_python, "scripts/torch_reference.py", "--mode", m, *steps,
                                     *args.overrides]) for m in torch_modes]
    print(f"# {cpu_model()}, {os.cpu_count()} cores; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
          f"{args.rounds} rounds x {args.steps} steps", flush=True)
    rates: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    info: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        for r in range(args.rounds):
            for name, env, cmd in variants:
                before = load()
                result = run_one([*cmd, "--json", str(out)], env, out)
                if result is None:
                    continue
                rates[name].append(result["tokens_per_sec"])
                info[name] = (f"allocator {result['allocator']}" if "allocator" in result
                              else f"torch {result['torch']}, {result['threads']} threads, {result['optimizer']}")
                env_text = " ".join(f"{k}={v}" for k, v in env.items())
                print(f"round {r + 1} | {name} | {result['tokens_per_sec']:,.0f} tokens/s | "
                      f"{result['step_ms']['median']:,.1f} ms | cpu {result.get('cpu_ms_per_step', 0):,.0f} ms | load {before} | {info[name]} {env_text}".rstrip(),
                      flush=True)
    medians = {name: statistics.median(v) for name, v in rates.items() if v}
    best_torch = max((medians[f"torch {m}"] for m in torch_modes if f"torch {m}" in medians), default=None)
    print("\n| variant | tokens/s median | min-max | runs | vs reference's best | notes |\n| --- | --- | --- | --- | --- | --- |")
    for name, values in rates.items():
        if not values:
            continue
        ratio = f"{medians[name] / best_torch:.2f}x" if best_torch else "-"
        print(f"| {name} | {medians[name]:,.0f} | {min(values):,.0f}-{max(values):,.0f} | {len(values)} | {ratio} | "
              f"{info.get(name, '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared test helpers: a tiny config and a runner for the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jaxgpt.config import load_config

REPO = Path(__file__).resolve().parent.parent

# Small enough to compile and step in seconds on 2 cores; every axis still divides by 2 (and 8).
TINY = ["model.n_layer=2", "model.n_head=4", "model.n_embd=32", "model.seq_len=32",
        "train.batch_size=16", "train.eval_every=0", "logging.every=1", "optimizer.warmup_steps=2"]


def tiny_config(*overrides: str, mesh: str | None = None):
    return load_config(None, [*TINY, *overrides], mesh)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def run_cli(*args: str, module: str = "jaxgpt.train", timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `python -m module args` in a subprocess with the test's 8 fake devices."""
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------------------ reading compiled HLO

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def hlo_computations(hlo: str) -> dict[str, str]:
    """Compiled HLO text -> {computation name: its body text}."""
    comps, name, lines = {}, None, []
    for line in hlo.splitlines():
        if name is None and line.endswith("{") and not line.startswith(" "):
            name, lines = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%"), []
        elif name is not None and line == "}":
            comps[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return comps


def collectives(text: str) -> dict[str, int]:
    """How many instructions of each collective kind `text` holds (async -start forms included)."""
    import re
    found = re.findall(r" (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", text)
    return {kind: found.count(kind) for kind in COLLECTIVES}


def while_bodies(hlo: str) -> list[str]:
    """Bodies of the while loops (the scanned layers), with the computations they call."""
    import re
    comps = hlo_computations(hlo)
    out = []
    for body_name in set(re.findall(r"body=%?([\w.\-]+)", hlo)):
        text, seen, todo = "", set(), [body_name]
        while todo:
            c = todo.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            text += comps[c] + "\n"
            todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[c])
        out.append(text)
    return out

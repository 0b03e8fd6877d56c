"""Shared test helpers: a tiny config, a runner for the real CLI, and (from jaxgpt.hlo) HLO reading."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from jaxgpt.checkpoint import Checkpointer
from jaxgpt.config import load_config, validate
from jaxgpt.hlo import while_bodies
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.step import abstract_state, init_state, make_setup, make_train_step
from jaxgpt.tokenizer import EOT_ID

REPO = Path(__file__).resolve().parent.parent

# Small enough to compile and step in seconds on 2 cores; every axis still divides by 2 (and 8).
TINY = ["model.n_layer=2", "model.n_head=4", "model.n_embd=32", "model.seq_len=32",
        "train.batch_size=16", "train.eval_every=0", "logging.every=1", "optimizer.warmup_steps=2",
        "model.loss_chunk=8"]  # the fused loss over 4 chunks in every layout (auto would take 1 here)


def layer_loops(hlo: str, padded_vocab: int = 50304, vocab: int = 50257) -> list[str]:
    """The while-loop bodies of the scanned layers: every loop but the fused loss's chunks, which
    are the ones with a vocabulary-sized dimension (the [V, D] embedding gradient they carry, the
    padded V or, where the loss takes the table's real rows on a CPU, the real one;
    jaxgpt/model/loss.py)."""
    return [body for body in while_bodies(hlo) if not _has_vocab_dim(body, padded_vocab, vocab)]


def loss_loops(hlo: str, padded_vocab: int = 50304, vocab: int = 50257) -> list[str]:
    return [body for body in while_bodies(hlo) if _has_vocab_dim(body, padded_vocab, vocab)]


def _has_vocab_dim(body: str, *sizes: int) -> bool:
    return re.search(r"[\[,](%s)[\],]" % "|".join(map(str, sizes)), body) is not None


def tiny_config(*overrides: str, mesh: str | None = None):
    return load_config(None, [*TINY, *overrides], mesh)


def lowering(model_cfg, ops: str | None = None):
    """The lowering a one-device run of model_cfg takes (jaxgpt/lowering/), with model.ops=`ops` if given."""
    import dataclasses

    from jaxgpt.lowering import choose
    model_cfg = model_cfg if ops is None else dataclasses.replace(model_cfg, ops=ops)
    return choose(model_cfg, make_mesh({"dp": 1}, jax.devices()[:1]))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def xla_flags(devices: int | None) -> str:
    """The test session's XLA_FLAGS (tests/conftest.py) for a subprocess with `devices` CPU devices
    (None: no device count, for launch_multihost.sh, which adds its own)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return " ".join(kept + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))


def run_cli(*args: str, module: str = "jaxgpt.train", timeout: float = 300,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs `python -m module args` in a subprocess with the test's 8 fake devices (and `env` added)."""
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def restore_run(run_dir: Path, cfg, devices=None):
    """(the run's newest checkpoint restored under cfg's mesh over `devices` (default all 8), the Setup used)."""
    mesh = make_mesh(validate(cfg, len(devices) if devices else 8), devices)
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        ckpt = Checkpointer(Path(run_dir) / "checkpoints", cfg.checkpoint)
        restored = ckpt.restore_latest(abstract_state(cfg, setup))
        ckpt.close()
    return restored, setup


def packed_batch(seed: int = 0) -> np.ndarray:
    """16 windows of 33 tokens with documents of random lengths (some windows hold one)."""
    rng = np.random.default_rng(seed)
    batch = rng.integers(0, 50000, (16, 33)).astype(np.int32)
    batch[rng.random((16, 33)) < 0.1] = EOT_ID
    return batch


def step_metrics(cfg, devices, steps: int = 2) -> list[dict]:
    """The metrics of `steps` train steps of cfg on `devices`, from fresh init, on packed_batch(0), (1), ..."""
    mesh = make_mesh(validate(cfg, len(devices)), devices)
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        state, step = init_state(cfg, setup), make_train_step(cfg, mesh, setup)
        out = []
        for seed in range(steps):
            state, metrics = step(state, packed_batch(seed))
            out.append(jax.device_get(metrics))
    return out


def script_module(name: str):
    """scripts/NAME.py, imported from its file (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

"""`python -m jaxgpt.train [--config FILE] [--mesh dp=2,fsdp=2,tp=2] [--run-dir DIR] [section.key=value ...]`

The loop. Everything that can be wrong with the input is checked before anything compiles:
config keys and values, then the mesh against the device count, then the data and its
vocabulary. The host stays off the critical path: step N+1 is dispatched before step N's metrics
are pulled to the host, so reading them never leaves the device idle (every step's loss is still
checked for NaN/inf, one step late).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import yaml

from jaxgpt import data
from jaxgpt.cli import ArgumentParser, Diverged, run_main
from jaxgpt.config import Config, help_text, load_config, validate
from jaxgpt.mesh import make_mesh, named
from jaxgpt.metrics import MetricsLog, Throughput, flops_per_token, mfu, peak_flops
from jaxgpt.model import param_count
from jaxgpt.step import TrainState, compute_dtype, init_state, make_eval_step, make_setup, make_train_step


def parse_args(argv: Sequence[str] | None) -> tuple[Config, Path]:
    parser = ArgumentParser(
        prog="python -m jaxgpt.train", description="Train a GPT on the devices this process sees.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=help_text())
    parser.add_argument("--config", help="a YAML file, or the name of one in configs/ (default: shakespeare)")
    parser.add_argument("--mesh", help="device mesh, e.g. dp=8 or dp=2,fsdp=2,tp=2 (unnamed axes are 1; one may be -1)")
    parser.add_argument("--run-dir", type=Path, help="where metrics.jsonl (and checkpoints) go (default: runs/CONFIG)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides, args.mesh)
    run_dir = args.run_dir or Path("runs") / Path(args.config or "shakespeare").stem
    return cfg, run_dir


def _log_run_header(cfg: Config, sizes: dict[str, int], n_train_tokens: int) -> None:
    n = param_count(cfg.model)
    layout = ",".join(f"{a}={s}" for a, s in sizes.items())
    print(f"jaxgpt: {n / 1e6:.1f}M parameters | mesh {layout} on {jax.device_count()} "
          f"{jax.devices()[0].platform} devices | {cfg.train.batch_size} x {cfg.model.seq_len} tokens/step "
          f"| {n_train_tokens:,} train tokens | compute {np.dtype(compute_dtype(cfg.model.dtype)).name}", flush=True)


def train(cfg: Config, run_dir: Path, devices: Sequence[jax.Device] | None = None) -> TrainState:
    """Trains `cfg` on `devices` (default: all), logging to run_dir/metrics.jsonl; returns the final state."""
    devices = list(devices or jax.devices())
    sizes = validate(cfg, len(devices))
    data_dir = data.resolve_data_dir(cfg.data.path)
    validate(cfg, len(devices), data.load_meta(data_dir)["vocab_size"])
    train_tokens, val_tokens = data.load_split(data_dir, "train"), data.load_split(data_dir, "val")
    t, m = cfg.train, cfg.model
    pid, nproc = jax.process_index(), jax.process_count()
    batches = data.train_iterator(train_tokens, seq_len=m.seq_len, global_batch=t.batch_size, seed=t.seed,
                                  process_index=pid, process_count=nproc,
                                  prefetch=cfg.data.prefetch, num_threads=cfg.data.num_threads)
    val_batches = data.eval_batches(val_tokens, seq_len=m.seq_len, global_batch=t.batch_size,
                                    num_batches=t.eval_batches, process_index=pid, process_count=nproc)

    is_main = pid == 0
    log = MetricsLog(run_dir, enabled=is_main)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        _log_run_header(cfg, sizes, len(train_tokens))

    mesh = make_mesh(sizes, devices)
    batch_sharding = named(mesh, ("batch", None))
    global_shape = (t.batch_size, m.seq_len + 1)

    def to_global(local_BT1: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(batch_sharding, local_BT1, global_shape)

    tokens_per_step = t.batch_size * m.seq_len
    peak = peak_flops(devices[0], np.dtype(compute_dtype(m.dtype)).name)

    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        state = init_state(cfg, setup)
        train_step = make_train_step(cfg, mesh, setup)
        eval_step = make_eval_step(cfg, mesh, setup)

        def evaluate(step: int) -> None:
            losses = [eval_step(state.params, to_global(b)) for b in val_batches]
            log.write({"step": step, "val_loss": float(np.mean(jax.device_get(losses)))})

        start = int(state.step)
        if t.eval_every:
            evaluate(start)
        clock = Throughput()
        clock.reset(start)
        pending = None  # (step, metrics on device) of the step dispatched before this one
        for step in range(start + 1, t.steps + 1):
            state, metrics = train_step(state, to_global(next(batches)))
            if pending is not None:
                _finish_step(*pending, log=log, clock=clock, cfg=cfg, tokens_per_step=tokens_per_step,
                             n_devices=len(devices), peak=peak)
            pending = (step, metrics)
            if step == start + 1:  # the first step compiled: don't count it in tokens/s
                jax.block_until_ready(metrics)
                clock.reset(step)
            if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                _finish_step(*pending, log=log, clock=clock, cfg=cfg, tokens_per_step=tokens_per_step,
                             n_devices=len(devices), peak=peak)
                pending = None
                evaluate(step)
                clock.reset(step)
        if pending is not None:
            _finish_step(*pending, log=log, clock=clock, cfg=cfg, tokens_per_step=tokens_per_step,
                         n_devices=len(devices), peak=peak)
    return state


def _finish_step(step: int, metrics: dict, *, log: MetricsLog, clock: Throughput, cfg: Config,
                 tokens_per_step: int, n_devices: int, peak: float | None) -> None:
    """Pulls one step's metrics to the host, stops on a non-finite loss, logs every N steps."""
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not math.isfinite(values["loss"]):
        raise Diverged(f"the loss became {values['loss']} at step {step}; lower optimizer.lr or "
                       f"check the data (nothing was saved from this step)")
    if step % cfg.logging.every and step != cfg.train.steps:
        return
    rate = clock.tokens_per_sec(step, tokens_per_step)
    log.write({"step": step, **values, "tokens_per_sec": rate, "mfu": mfu(rate, cfg.model, n_devices, peak)})


def _main(argv: Sequence[str] | None) -> None:
    cfg, run_dir = parse_args(argv)
    train(cfg, run_dir)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

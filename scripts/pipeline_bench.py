"""The pipeline's bubble, measured on CPU next to the formula, and each stage's activation memory.

    python scripts/pipeline_bench.py [--stages 2] [--microbatches 2,4,8] [--repeats 1,2] [--steps 8]

Each fake CPU device runs single-threaded (XLA's Eigen threading off), so with --stages no more
than the machine's cores the S stages really run side by side, as S GPUs would. For each schedule
it times the train step of `--mesh pp=S` (median of --steps after 2 warm-ups) and compares it with
the same work on one device: the whole model over the whole batch, T_1. A pipeline without a bubble
would take T_1 / S, so the measured bubble is 1 - T_1 / (S x T_pp); the formula is
(S-1) / (R*M + S-1). The model is made of blocks (a 512-token vocabulary keeps the head, which is
not pipelined, small); data are random tokens. What is not pipelined (embedding, the head's share,
AdamW, the circular schedule's weight reorder) and the per-iteration overhead of small micro-batches
count as bubble here, so the measured figure is an upper bound of the schedule's own.

Memory: XLA's memory analysis of the compiled step, temporaries per device (activations kept for
the backward pass, gradients, work space), for the pipeline and for the one-device step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", default="2,4,8")
    ap.add_argument("--repeats", default="1,2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    S = args.stages
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={S} --xla_cpu_multi_thread_eigen=false "
                               f"{os.environ.get('XLA_FLAGS', '')}")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np

    from jaxgpt.config import load_config, validate
    from jaxgpt.mesh import make_mesh
    from jaxgpt.pipeline import bubble_fraction
    from jaxgpt.step import init_state, make_setup, make_train_step

    model = [f"model.n_layer={args.layers}", f"model.n_embd={args.width}", "model.n_head=4",
             f"model.seq_len={args.seq}", "model.vocab_size=512", "model.dtype=float32",
             f"train.batch_size={args.batch}", "optimizer.warmup_steps=1"]
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 512, (args.batch, args.seq + 1)).astype(np.int32) for _ in range(4)]

    def measure(mesh_spec: str, overrides: list[str], n: int) -> tuple[float, float]:
        """(median step seconds, temporaries MiB per device)."""
        cfg = load_config(None, [*model, *overrides], mesh_spec)
        mesh = make_mesh(validate(cfg, n), jax.devices()[:n])
        with jax.set_mesh(mesh):
            setup = make_setup(cfg, mesh)
            state = init_state(cfg, setup)
            step = make_train_step(cfg, mesh, setup)
            temp = step.lower(state, batches[0]).compile().memory_analysis().temp_size_in_bytes / 2**20
            times = []
            for i in range(args.steps + 2):
                t0 = time.perf_counter()
                state, metrics = step(state, batches[i % len(batches)])
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t0)
        return statistics.median(times[2:]), temp

    t1, temp1 = measure("dp=1", [], 1)
    print(f"one device (the whole model, {args.batch} x {args.seq} tokens): {1e3 * t1:,.1f} ms/step, "
          f"temporaries {temp1:,.1f} MiB", flush=True)
    print(f"\n| schedule | S | R | M | iterations | bubble (formula) | step ms | bubble (measured) | temporaries MiB/stage |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for R in map(int, args.repeats.split(",")):
        for M in map(int, args.microbatches.split(",")):
            t, temp = measure(f"pp={S}", [f"pipeline.repeats={R}", f"pipeline.microbatches={M}"], S)
            name = "GPipe" if R == 1 else "circular"
            print(f"| {name} | {S} | {R} | {M} | {R * M + S - 1} | {100 * bubble_fraction(S, R, M):.1f}% | "
                  f"{1e3 * t:,.1f} | {100 * (1 - t1 / (S * t)):.1f}% | {temp:,.1f} |", flush=True)


if __name__ == "__main__":
    main()

"""The pipeline's bubble, measured on CPU next to the formula, and each stage's activation memory.

    python scripts/pipeline_bench.py [--stages 2] [--microbatches 2,4,8] [--repeats 1,2] [--steps 6]

How a CPU can show a bubble. The S fake CPU devices of `--mesh pp=S` share this machine's cores,
so stages do not overlap in time as S GPUs would; instead the bubble shows up as work: in a
bubble slot a stage computes on zeros (jaxgpt/parallel/pipeline.py), so a step makes (R*M + S - 1) chunk
passes per stage where R*M carry micro-batches. Its time T_pp is compared with T_1, the same work
on one device with the same structure and no pipeline: the whole model over the same M
micro-batches, all forward passes and then all backward passes (the gradient of a scan over the
micro-batches, as GPipe runs them), then AdamW. Then T_pp = T_1 x (R*M + S - 1) / (R*M) plus the
schedule's own costs (permutes, the buffer, for R > 1 the weight reorder), and the measured bubble
1 - T_1 / T_pp compares with the formula (S-1) / (R*M + S - 1). On GPUs the same slots are idle time.

The table also gives T_acc, the usual one-device step with train.grad_accum=M (forward and backward
of one micro-batch at a time): on XLA:CPU the GPipe structure itself (every micro-batch's saved
activations stacked until the backward pass) costs more than accumulation, a cost of pipelining
that is not the bubble.

The model is mostly blocks (a 512-token vocabulary keeps the head, split over the stages, small) and
the data are random tokens. Step times are medians of --steps after 2 warm-ups. Memory is XLA's
memory analysis of the compiled step: temporaries per device (activations kept for the backward
pass, gradients, work space), for each stage and for the one-device GPipe-structured step.
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
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    S = args.stages
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={S} {os.environ.get('XLA_FLAGS', '')}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np

    import optax

    from jaxgpt.config import load_config, validate
    from jaxgpt.lowering import compute_dtype
    from jaxgpt.parallel.mesh import make_mesh
    from jaxgpt.parallel.pipeline import bubble_fraction
    from jaxgpt.step import TrainState, init_state, make_setup, make_train_step, objective_fn

    model = [f"model.n_layer={args.layers}", f"model.n_embd={args.width}", "model.n_head=4",
             f"model.seq_len={args.seq}", "model.vocab_size=512", "model.dtype=float32",
             f"train.batch_size={args.batch}", "optimizer.warmup_steps=1"]
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 512, (args.batch, args.seq + 1)).astype(np.int32) for _ in range(4)]

    def gpipe_on_one_device(cfg, setup, M: int):
        """The train step with the pipeline's structure on one device: grad of a scan over the M
        micro-batches (rows a, a+M, ... as the pipeline takes them), then AdamW."""
        dtype = compute_dtype(cfg.model.dtype, jax.devices()[0].platform)

        def train_step(state: TrainState, batch_BT1):
            B, T1 = batch_BT1.shape
            micro_MbT1 = batch_BT1.reshape(B // M, M, T1).swapaxes(0, 1)

            def mean_loss(params):
                def body(total, micro_bT1):
                    return total + objective_fn(params, setup.graphdef, micro_bT1, cfg.model, dtype)[0], None
                return jax.lax.scan(body, 0.0, micro_MbT1)[0] / M

            loss, grads = jax.value_and_grad(mean_loss)(state.params)
            updates, opt_state = setup.optimizer.update(grads, state.opt_state, state.params)
            return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state), loss

        return jax.jit(train_step, donate_argnums=0)

    def measure(mesh_spec: str, overrides: list[str], n: int, one_device_gpipe: int = 0) -> tuple[float, float]:
        """(median step seconds, temporaries MiB per device); one_device_gpipe=M: gpipe_on_one_device."""
        cfg = load_config(None, [*model, *overrides], mesh_spec)
        mesh = make_mesh(validate(cfg, n), jax.devices()[:n])
        with jax.set_mesh(mesh):
            setup = make_setup(cfg, mesh)
            state = init_state(cfg, setup)
            if one_device_gpipe:
                step = gpipe_on_one_device(cfg, setup, one_device_gpipe)
            else:
                step = make_train_step(cfg, mesh, setup)
            temp = step.lower(state, batches[0]).compile().memory_analysis().temp_size_in_bytes / 2**20
            times = []
            for i in range(args.steps + 2):
                t0 = time.perf_counter()
                state, metrics = step(state, batches[i % len(batches)])
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t0)
        return statistics.median(times[2:]), temp

    print(f"{args.layers} layers, width {args.width}, {args.batch} x {args.seq} tokens per step, {S} stages", flush=True)
    print("\n| schedule | S | R | M | iterations | bubble (formula) | T_acc ms | T_1 ms | T_pp ms | bubble (measured) "
          "| temporaries MiB: T_1 / per stage |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    reference = {}
    for R in map(int, args.repeats.split(",")):
        for M in map(int, args.microbatches.split(",")):
            if M not in reference:
                reference[M] = (measure("dp=1", [f"train.grad_accum={M}"], 1)[0],
                                *measure("dp=1", [], 1, one_device_gpipe=M))
            (t_acc, t1, temp1), (t, temp) = reference[M], measure(
                f"pp={S}", [f"pipeline.repeats={R}", f"pipeline.microbatches={M}"], S)
            name = "GPipe" if R == 1 else "circular"
            print(f"| {name} | {S} | {R} | {M} | {R * M + S - 1} | {100 * bubble_fraction(S, R, M):.1f}% | "
                  f"{1e3 * t_acc:,.0f} | {1e3 * t1:,.0f} | {1e3 * t:,.0f} | {100 * (1 - t1 / t):.1f}% | "
                  f"{temp1:,.0f} / {temp:,.0f} |", flush=True)


if __name__ == "__main__":
    main()

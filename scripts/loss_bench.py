"""The fused head + loss alone, forward and backward, timed on one device at a config's shapes.

    python scripts/loss_bench.py                                  # the default run's head
    python scripts/loss_bench.py --chunks 4,8,16,32               # one row per model.loss_chunk
    python scripts/loss_bench.py --config gpt2-124m train.batch_size=1 --reps 3
    PYTHONPATH=/path/to/other/checkout python scripts/loss_bench.py   # another version of the code

On a CPU the head is most of a small model's step (the default run: ~375 of ~520 ms on a 2-core
Intel Xeon), and its time is the passes over each chunk's [rows, V] logits, which depend on how
XLA fuses jaxgpt/lowering/loss.py: this times exactly that, `jax.value_and_grad` of
`chunked_cross_entropy` (x and the table as arguments, fixed random labels), so a change to the
loss is measured in seconds rather than through a whole training step. The features are random
normal [B, T, D] (batch = train.batch_size, T = model.seq_len); the table N(0, 0.02^2) of the padded
vocabulary. Prints per chunk: the loss, the gradients' norms (the same across chunks up to
summation order) and the median and min ms of --reps calls after one untimed call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jaxgpt import allocator
from jaxgpt.config import load_config
from jaxgpt.lowering import choose
from jaxgpt.lowering.loss import chunked_cross_entropy
from jaxgpt.parallel.mesh import make_mesh


def time_head(model, B: int, reps: int) -> tuple[float, float, float, list[float]]:
    """(loss, |dx|, |dwte|, seconds per call) of value_and_grad of the fused loss at model's shapes."""
    k = jax.random.split(jax.random.key(0), 3)
    x_BTD = jax.random.normal(k[0], (B, model.seq_len, model.n_embd))
    wte_VD = jax.random.normal(k[1], (model.padded_vocab, model.n_embd)) * 0.02
    labels_BT = jax.random.randint(k[2], (B, model.seq_len), 0, model.vocab_size)
    ops = choose(model, make_mesh({"dp": 1}, jax.devices()[:1]))
    f = jax.jit(jax.value_and_grad(lambda x, w: chunked_cross_entropy(x, w, labels_BT, ops, jnp.float32),
                                   argnums=(0, 1)))
    loss, (dx, dw) = jax.block_until_ready(f(x_BTD, wte_VD))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x_BTD, wte_VD))
        times.append(time.perf_counter() - t0)
    return float(loss), float(jnp.linalg.norm(dx)), float(jnp.linalg.norm(dw)), times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a YAML file, or the name of one in configs/ (default: shakespeare)")
    parser.add_argument("--chunks", default="0", help="model.loss_chunk values, comma-separated (0: auto)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args()
    allocator.reexec()  # the allocator training uses (jaxgpt/allocator.py)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, allocator {allocator.describe().split(';')[0]}, "
          f"jaxgpt from {sys.modules['jaxgpt'].__path__[0]}")
    for chunk in [int(c) for c in args.chunks.split(",")]:
        cfg = load_config(args.config, [*args.overrides, f"model.loss_chunk={chunk}"], None)
        loss, dx, dw, times = time_head(cfg.model, cfg.train.batch_size, args.reps)
        print(f"loss_chunk {chunk}: loss {loss:.6f} |dx| {dx:.6e} |dwte| {dw:.6e} | "
              f"median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

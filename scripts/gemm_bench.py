"""The output head's three GEMMs timed alone in XLA, NumPy and PyTorch, on this CPU's cores.

    python scripts/gemm_bench.py                              # every backend this Python has
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python scripts/gemm_bench.py --backends xla
    /path/to/torch-env/bin/python scripts/gemm_bench.py --backends numpy,torch --rows 128,512

Letters: R rows (sequences x positions of one loss chunk), D model width, V padded vocabulary.
The fused loss (jaxgpt/lowering/loss.py) runs, per chunk, in fp32:

    logits  x [R, D] @ wte[V, D]^T  -> [R, V]
    dx      dlogits [R, V] @ wte [V, D] -> [R, D]
    dwte    dlogits[R, V]^T @ x [R, D]  -> [V, D]

each 2·R·D·V FLOPs. The default run (16 x 128 tokens, D 128, V 50304) has R = 16 x loss chunk.
Each GEMM is timed --reps times after one untimed call (XLA: compiled alone, its output blocked
on); prints the median ms and GFLOP/s per backend, GEMM and R, one markdown row each:
| backend | R | logits ms (GFLOP/s) | dx ms (GFLOP/s) | dwte ms (GFLOP/s) |
XLA's dots honour XLA_FLAGS (e.g. YNNPACK off: --xla_cpu_experimental_ynn_fusion_type=), NumPy's
its BLAS's thread variables, torch its own threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def timed(fn, reps: int) -> float:
    """Median seconds of fn() over reps calls, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemms_xla(R: int, D: int, V: int):
    import jax
    import jax.numpy as jnp
    k = jax.random.split(jax.random.key(0), 3)
    x, w, g = (jax.random.normal(k[0], (R, D)), jax.random.normal(k[1], (V, D)), jax.random.normal(k[2], (R, V)))
    fs = {"logits": jax.jit(lambda x, w: jnp.einsum("rd,vd->rv", x, w)),
          "dx": jax.jit(lambda g, w: jnp.einsum("rv,vd->rd", g, w)),
          "dwte": jax.jit(lambda g, x: jnp.einsum("rv,rd->vd", g, x))}
    args = {"logits": (x, w), "dx": (g, w), "dwte": (g, x)}
    return {name: (lambda f=f, a=args[name]: f(*a).block_until_ready()) for name, f in fs.items()}


def gemms_numpy(R: int, D: int, V: int):
    import numpy as np
    rng = np.random.default_rng(0)
    x, w, g = (rng.standard_normal(s, dtype=np.float32) for s in ((R, D), (V, D), (R, V)))
    return {"logits": lambda: x @ w.T, "dx": lambda: g @ w, "dwte": lambda: g.T @ x}


def gemms_torch(R: int, D: int, V: int):
    import torch
    torch.manual_seed(0)
    x, w, g = torch.randn(R, D), torch.randn(V, D), torch.randn(R, V)
    return {"logits": lambda: x @ w.T, "dx": lambda: g @ w, "dwte": lambda: g.T @ x}


BACKENDS = {"xla": gemms_xla, "numpy": gemms_numpy, "torch": gemms_torch}


def version(backend: str) -> str:
    if backend == "xla":
        import jax
        return f"jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    if backend == "numpy":
        import numpy as np
        return f"numpy {np.__version__}"
    import torch
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="xla,numpy,torch", help="comma-separated (missing ones are skipped)")
    parser.add_argument("--rows", default="128,256,512,1024,2048", help="R values (16 x loss chunk 8..128)")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--v", type=int, default=50304)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    print(f"# {cpu_model()}, {os.cpu_count()} cores, D={args.d}, V={args.v}, median of {args.reps}", flush=True)
    print("| backend | R | logits ms (GFLOP/s) | dx ms (GFLOP/s) | dwte ms (GFLOP/s) |\n| --- | --- | --- | --- | --- |")
    for backend in args.backends.split(","):
        try:
            make = BACKENDS[backend]
            print(f"# {backend}: {version(backend)}", flush=True)
        except ImportError as e:
            print(f"# {backend}: skipped ({e})", flush=True)
            continue
        for R in map(int, args.rows.split(",")):
            flops = 2 * R * args.d * args.v
            cells = []
            for fn in make(R, args.d, args.v).values():
                s = timed(fn, args.reps)
                cells.append(f"{1e3 * s:.2f} ({flops / s / 1e9:.0f})")
            print(f"| {backend} | {R} | {' | '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

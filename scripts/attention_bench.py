"""Causal attention kernels timed alone on this GPU, forward and backward (issue 40 item 2).

    python scripts/attention_bench.py                 # on an NVIDIA GPU: every kernel, both shapes
    python scripts/attention_bench.py --kernels cudnn,mosaic --shapes 124m

Kernels, each causal, bf16 in and out, q, k and v [B, T, H, K] as the model's attention gives them:

    cudnn       jax.nn.dot_product_attention(implementation='cudnn'): what model.attention=auto
                runs on an NVIDIA GPU (jaxgpt/model/attention.py)
    cudnn-bnth  the same cuDNN call with qkv_layout='BNTH', its inputs given in [B, H, T, K] (the
                transposes into that layout are not timed: what the layout alone is worth)
    mosaic      tokamax's Pallas Mosaic GPU flash attention, what model.attention=mosaic runs
                (jaxgpt/lowering/flash.py), with tokamax's heuristic block sizes
    triton      tokamax's Pallas Triton flash attention (tokamax.dot_product_attention(implementation=
                'triton'); the successor of the deprecated jax.experimental.pallas.ops.gpu.attention)
    xla         implementation='xla': the [B, H, T, T] scores in HBM (the CPU's kernel)

Not here: jax.experimental.pallas.ops.gpu.attention_mgpu, the Mosaic GPU example in JAX 0.12 itself.
Its backward raises NotImplementedError for a causal mask ("Causal attention not supported in the
backwards pass yet"), and bf16 inputs fail in its trace (its shared-memory copies are typed fp16),
so it cannot train a GPT; tokamax's is the maintained one.

Shapes (--shapes): 124m = gpt2-124m's micro-batch as bundled (128 x 1,024, 12 heads of 64), 1.3b =
gpt2-1.3b's (8 x 2,048, 16 heads of 128).

Prints one markdown row per kernel and shape: forward ms, forward + backward ms (one jitted vjp),
their TFLOP/s with the FLOPs counted the same for every kernel, as jaxgpt/gpu/cost.py counts cuDNN's
(4 B H T^2 K forward, halved for the causal mask, 2.5x that backward), the largest |error| of the output and of
dq, dk, dv against the fp32 reference (on 2 rows of the batch; bf16's rounding is ~2e-2 on these
values, tests/test_kernels.py's bound), and for cudnn and mosaic the step-time model's prediction of
the same two calls (jaxgpt/gpu/perf.py's cuDNN efficiencies for both: mosaic's is the assumption to
check). Medians of --reps calls after 2 untimed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp

SHAPES = {"124m": (128, 1024, 12, 64), "1.3b": (8, 2048, 16, 128)}  # B, T, H, K
KERNELS = ("cudnn", "cudnn-bnth", "mosaic", "triton", "xla")
BOUND = 2e-2  # bf16 against the fp32 reference (tests/test_kernels.py KERNEL_CASES)


def attend_fn(kernel: str):
    """kernel -> f(q, k, v) on [B, T, H, K] arrays (cudnn-bnth: [B, H, T, K] in and out)."""
    if kernel in ("cudnn", "xla"):
        return partial(jax.nn.dot_product_attention, is_causal=True, implementation=kernel)
    if kernel == "cudnn-bnth":
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
        return lambda q, k, v: cudnn.dot_product_attention(
            q, k, v, scale=1 / math.sqrt(q.shape[-1]), mask_type=cudnn.MaskType.CAUSAL, qkv_layout="BNTH")
    if kernel == "mosaic":
        from jaxgpt.lowering import flash
        return flash.attend
    import tokamax
    return partial(tokamax.dot_product_attention, is_causal=True, implementation=kernel)


def flops(B: int, T: int, H: int, K: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one causal call, as jaxgpt/gpu/cost.py counts cuDNN's."""
    from jaxgpt.gpu.cost import CUDNN_BACKWARD
    forward = 4.0 * B * H * T * T * K / 2
    return forward, CUDNN_BACKWARD * forward


def predicted_ms(kernel: str, B: int, T: int, H: int, K: int, target: str = "h100") -> tuple[float, float] | None:
    """The step-time model's forward and forward + backward ms of `kernel` at this shape, compute
    only (jaxgpt/gpu/cost.py: cuDNN's backward one kernel, tokamax's two, all at cuDNN's measured
    efficiencies); None for a kernel the model does not cost."""
    from jaxgpt.gpu.cost import CUDNN_BACKWARD, TOKAMAX_BACKWARD, attention_seconds
    from jaxgpt.gpu.perf import perf
    backward = {"cudnn": (CUDNN_BACKWARD,), "cudnn-bnth": (CUDNN_BACKWARD,), "mosaic": tuple(TOKAMAX_BACKWARD.values())}
    if kernel not in backward:
        return None
    p, fwd = perf(target), flops(B, T, H, K)[0]
    f = attention_seconds(fwd, False, K, 0.0, p)
    return 1e3 * f, 1e3 * (f + sum(attention_seconds(x * fwd, True, K, 0.0, p) for x in backward[kernel]))


def inputs(shape: tuple[int, ...], bnth: bool, dtype=jnp.bfloat16):
    B, T, H, K = shape
    keys = jax.random.split(jax.random.key(0), 4)
    arrays = [jax.random.normal(key, (B, T, H, K), jnp.float32).astype(dtype) for key in keys]
    return [jnp.swapaxes(a, 1, 2) for a in arrays] if bnth else arrays


def max_errors(kernel: str, shape: tuple[int, ...]) -> list[float]:
    """Largest |error| of the output and of dq, dk, dv against the fp32 reference, on 2 rows."""
    from jaxgpt.lowering.attention import reference_attention
    bnth = kernel == "cudnn-bnth"
    q, k, v, d_out = inputs((2, *shape[1:]), bnth)
    out, vjp = jax.vjp(jax.jit(attend_fn(kernel)), q, k, v)
    got = [out, *vjp(d_out)]
    as_btnh = (lambda a: jnp.swapaxes(a, 1, 2)) if bnth else (lambda a: a)
    with jax.default_matmul_precision("highest"):
        q32, k32, v32, d32 = (as_btnh(a).astype(jnp.float32) for a in (q, k, v, d_out))
        ref, ref_vjp = jax.vjp(reference_attention, q32, k32, v32)
        want = [ref, *ref_vjp(d32)]
    return [float(jnp.max(jnp.abs(as_btnh(g).astype(jnp.float32) - w))) for g, w in zip(got, want)]


def timed_ms(fn, args, reps: int) -> float:
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bench(kernel: str, shape: tuple[int, ...], reps: int) -> tuple[float, float]:
    """(forward ms, forward + backward ms) at `shape`."""
    q, k, v, d_out = inputs(shape, kernel == "cudnn-bnth")
    attend = attend_fn(kernel)
    forward = jax.jit(attend)
    both = jax.jit(lambda q, k, v, d: jax.vjp(attend, q, k, v)[1](d))
    return timed_ms(forward, (q, k, v), reps), timed_ms(both, (q, k, v, d_out), reps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {', '.join(KERNELS)}")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    kernels, shapes = args.kernels.split(","), args.shapes.split(",")
    if bad := [k for k in kernels if k not in KERNELS] + [s for s in shapes if s not in SHAPES]:
        parser.error(f"unknown kernel or shape {bad[0]!r}")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    if jax.devices()[0].platform != "gpu":
        print("this needs an NVIDIA GPU (this is a CPU)", file=sys.stderr)
        return 2
    print("| kernel | B x T, H x K | forward ms (TFLOP/s) | fwd+bwd ms (TFLOP/s) | max error out/dq/dk/dv | model's ms fwd / fwd+bwd |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in shapes:
        shape = SHAPES[name]
        fwd_flops, bwd_flops = flops(*shape)
        for kernel in kernels:
            try:
                errors = max_errors(kernel, shape)
                f_ms, fb_ms = bench(kernel, shape, args.reps)
            except Exception as e:  # noqa: BLE001 (any kernel's failure to build or run this shape: say so, go on)
                print(f"| {kernel} | {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |")
                continue
            model = "{:.2f} / {:.2f}".format(*ms) if (ms := predicted_ms(kernel, *shape)) else ""
            B, T, H, K = shape
            print(f"| {kernel} | {B} x {T}, {H} x {K} | {f_ms:.2f} ({fwd_flops / f_ms / 1e9:.0f}) | "
                  f"{fb_ms:.2f} ({(fwd_flops + bwd_flops) / fb_ms / 1e9:.0f}) | "
                  f"{'/'.join(f'{e:.0e}' for e in errors)} | {model} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

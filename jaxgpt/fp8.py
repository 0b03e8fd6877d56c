"""fp8 matmuls for the transformer's linear layers (`model.fp8=true`).

Formats. Forward operands (activations and weights) are cast to float8_e4m3fn (3 mantissa bits,
max 448): precision matters more than range there. Gradients flowing back into a matmul are cast
to float8_e5m2 (2 mantissa bits, max 57344): gradients span a wider range. Accumulation is in
higher precision (fp32 inside the GEMM), and the result is in the compute dtype.

Scaling recipe: current (dynamic) per-tensor scaling. Each operand is divided by
scale = amax(|x|) / fp8_max just before the cast, so its largest element lands on the format's
largest value, and the product is multiplied back by both scales. The amax is computed from the
tensor itself on every step, which costs one reduction per operand but needs no state: nothing to
checkpoint, nothing for weight decay or clipping to skip, and no stale scale after a loss spike
(the weakness of delayed scaling with an amax history). Under a sharded mesh the amax is a global
max, which XLA turns into a small all-reduce; inside the train step's dp `shard_map` (jaxgpt/step.py)
the dp shards are split by hand, so an explicit `pmax` over the manual axes makes it global there too.

How XLA sees it. The code is written as quantize-dequantize ("qdq"): x -> fp8 -> back to the
compute dtype * scale, then an ordinary einsum. XLA:GPU's GEMM rewriter recognises
convert(fp8) * scale feeding a dot and emits a cuBLASLt fp8 GEMM (QGMMA on Hopper), so the fp8
cast is real on H100/H200. On CPU the same program runs numerically (the rounding to fp8 is
exact; the matmul is done in the wider type), which is what the CPU tests check.

Gradients. Rounding has zero derivative almost everywhere, so the forward qdq uses a
straight-through estimator (the gradient passes unchanged); `_grad_qdq` is the identity in the
forward pass and rounds the incoming gradient to e5m2 in the backward pass, so both backward
GEMMs (dx = dy w^T, dw = x^T dy) also get fp8 operands.

Which layers. QKV, attention-out, MLP-in and MLP-out: the matmuls that hold ~all of the FLOPs
of a transformer block. The embedding lookup and the tied output head stay in the compute dtype:
the head sets the logits' precision, and nanochat and MaxText keep it out of fp8 too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _qdq(x: jax.Array, fp8: jnp.dtype) -> jax.Array:
    """Round x to `fp8` with a per-tensor scale and return it in x's dtype (a value fp8 can hold)."""
    fmax = float(jnp.finfo(fp8).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    if manual := tuple(jax.sharding.get_abstract_mesh().manual_axes):
        amax = jax.lax.pmax(amax, manual)  # one scale for the whole tensor, as on any other layout
    # the scale is rounded to x's dtype once, so quantize and dequantize use the very same value;
    # dequantize is convert(fp8 -> dtype) * scale: the pattern XLA:GPU fuses into an fp8 GEMM
    scale = jnp.where(amax > 0, amax / fmax, 1.0).astype(x.dtype)
    q = jnp.clip(x / scale, -fmax, fmax).astype(fp8)
    return q.astype(x.dtype) * scale


@jax.custom_vjp
def _fwd_qdq(x: jax.Array) -> jax.Array:
    return _qdq(x, E4M3)


_fwd_qdq.defvjp(lambda x: (_qdq(x, E4M3), None), lambda _, g: (g,))  # straight-through


@jax.custom_vjp
def _grad_qdq(y: jax.Array) -> jax.Array:
    return y


_grad_qdq.defvjp(lambda y: (y, None), lambda _, g: (_qdq(g, E5M2),))


def fp8_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` with e4m3 operands forward and an e5m2 gradient backward."""
    return _grad_qdq(jnp.einsum(spec, _fwd_qdq(x), _fwd_qdq(w)))

"""LayerNorm and RMSNorm with a hand-written backward pass (tricks `norm_vjp`, `norm_recompute`).

    y = (x - mean) * rstd * scale + bias        rstd = 1 / sqrt(mean((x - mean)^2) + eps)
    dx     = rstd (g scale - mean_D(g scale) - xhat mean_D(g scale xhat))
    dscale = sum_N(g xhat)     dbias = sum_N(g)

Statistics and arithmetic are fp32 whatever x's dtype; y and dx come back in x's dtype, so the
backward reads and writes the residual stream's own [N, D] tensors and nothing wider. Autodiff of
the fp32 formula (model/ops.py, the reference) left XLA:GPU a backward that wrote the fp32 product
g * xhat only to read it back for dscale's column sum; here the column sums see only g, x and the
per-row statistics, so XLA fuses both into the pass that writes dx.

The statistics. With `keep_stats` the forward keeps each row's mean and rstd for the backward;
without, it keeps only x and the backward recomputes them in its pass of row sums (`_recomputed`),
so the forward is one kernel that reads x and writes y. The lowering (ops.py) decides which:
kept where the norm feeds an fp8 GEMM (whose e4m3 cast then computes y from x and the statistics)
and under fsdp. docs/ops.md has each choice's predicted gain.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

EPS = 1e-5  # model.norm_eps's default


def normalize(x: jax.Array, scale: jax.Array | None, bias: jax.Array | None, rms: bool,
              keep_stats: bool = False, eps: float = EPS) -> jax.Array:
    """LayerNorm (rms=False) or RMSNorm of x over its last axis; scale/bias [D] (fp32) or None.
    keep_stats: the forward keeps each row's mean and rstd for the backward, which otherwise
    recomputes them. eps: model.norm_eps."""
    return _norm(x, scale, bias, rms, keep_stats, False, eps)


def normalize_with_amax(x: jax.Array, scale: jax.Array | None, bias: jax.Array | None,
                        rms: bool, eps: float = EPS) -> tuple[jax.Array, jax.Array]:
    """(`normalize` keeping the statistics, an upper bound on max |y|: fp32, no gradient), for a
    norm that feeds an fp8 GEMM, whose e4m3 cast needs max |y| for its scale (fp8.py `quantize`'s
    amax; trick `norm_amax`). |y_j| <= |x_j - mean| rstd |scale_j| + |bias_j|, so the bound is the
    largest row's max |x - mean| rstd times max |scale| plus max |bias| (and 2^-7 more for y's
    rounding to x's dtype). The row maxima come from the pass that sums the variance, which reads
    the same x - mean: the cast's reduction over y itself was a pass over [rows, D] of its own.
    As activation_amax's, a bound:
    the largest value then lands in (fmax/4, fmax] where |scale| and |bias| do not peak at the
    largest deviation, not (fmax/2, fmax]."""
    return _norm(x, scale, bias, rms, True, True, eps)


def _stats(x32: jax.Array, rms: bool, eps: float, deviation: bool = False) -> tuple:
    """Per row: the mean [..., 1] (None for RMSNorm) and rstd [..., 1], fp32; with `deviation`
    also max |x - mean| [..., 1], a reduction of the variance's pass."""
    mean = None if rms else x32.mean(-1, keepdims=True)
    centred = x32 if rms else x32 - mean
    rstd = jax.lax.rsqrt(jnp.square(centred).mean(-1, keepdims=True) + eps)
    if not deviation:
        return mean, rstd
    return mean, rstd, jnp.max(jnp.abs(centred), -1, keepdims=True)


def _amax_bound(deviation: jax.Array, rstd: jax.Array, scale: jax.Array | None, bias: jax.Array | None) -> jax.Array:
    """`normalize_with_amax`'s bound on max |y|."""
    bound = jnp.max(deviation * rstd)
    bound = bound if scale is None else bound * jnp.max(jnp.abs(scale))
    bound = bound if bias is None else bound + jnp.max(jnp.abs(bias))
    return jax.lax.stop_gradient(bound * (1 + 2.0 ** -7))


def _xhat(x: jax.Array, mean: jax.Array | None, rstd: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 if mean is None else x32 - mean) * rstd


def _apply(x, mean, rstd, scale, bias) -> jax.Array:
    y = _xhat(x, mean, rstd)
    y = y if scale is None else y * scale
    y = y if bias is None else y + bias
    return y.astype(x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _norm(x, scale, bias, rms, keep_stats, with_amax, eps):
    return _norm_fwd(x, scale, bias, rms, keep_stats, with_amax, eps)[0]


def _norm_fwd(x, scale, bias, rms, keep_stats, with_amax, eps):
    if with_amax:
        mean, rstd, deviation = _stats(x.astype(jnp.float32), rms, eps, deviation=True)
        y = (_apply(x, mean, rstd, scale, bias), _amax_bound(deviation, rstd, scale, bias))
    else:
        mean, rstd = _stats(x.astype(jnp.float32), rms, eps)
        y = _apply(x, mean, rstd, scale, bias)
    if not keep_stats:
        return y, (x, None, None, scale, bias)
    return y, (x, mean, rstd, scale, bias)


def _norm_bwd(rms, keep_stats, with_amax, eps, res, g):
    g = g[0] if with_amax else g  # the bound has no gradient
    x, mean, rstd, scale, bias = res
    rows = tuple(range(x.ndim - 1))
    g32 = g.astype(jnp.float32)
    gs = g32 if scale is None else g32 * scale
    if keep_stats:
        # XLA:GPU would otherwise fuse the forward's row reductions into this pass again (recomputing
        # mean and rstd from x) and then had to write g * xhat out for dscale's column sum.
        x, mean, rstd = jax.lax.optimization_barrier((x, mean, rstd))
        xhat = _xhat(x, mean, rstd)
        gs_mean = None if rms else jnp.mean(gs, axis=-1, keepdims=True)
        gs_xhat_mean = jnp.mean(gs * xhat, axis=-1, keepdims=True)
    else:
        xhat, rstd, gs_mean, gs_xhat_mean = _recomputed(x, gs, rms, eps)
    dscale = None if scale is None else jnp.sum(g32 * xhat, axis=rows).astype(scale.dtype)
    dbias = None if bias is None else jnp.sum(g32, axis=rows).astype(bias.dtype)
    dx = gs - xhat * gs_xhat_mean
    if not rms:
        dx = dx - gs_mean
    return (dx * rstd).astype(x.dtype), dscale, dbias


def _recomputed(x: jax.Array, gs: jax.Array, rms: bool, eps: float) -> tuple:
    """xhat, rstd and the backward's two row means, mean_D(gs) (None for RMSNorm) and mean_D(gs xhat),
    from one pass over x and g: the row sums of x, x^2, gs and gs x. Sums of x and x^2 lose the
    variance to cancellation where a row's mean is large against its spread, so LayerNorm's are of
    d = x - x[..., :1] (each row shifted by its first element, exactly: the variance is
    shift-invariant, and d's mean is of the spread's size), and xhat = (d - mean_D(d)) rstd, never
    through the mean itself (x[0] + mean_D(d) rounds at x's magnitude)."""
    n, x32 = x.shape[-1], x.astype(jnp.float32)
    d = x32 if rms else x32 - x[..., :1].astype(jnp.float32)
    s2, sgd = jnp.sum(d * d, -1, keepdims=True) / n, jnp.sum(gs * d, -1, keepdims=True) / n
    if rms:
        rstd = jax.lax.rsqrt(s2 + eps)
        return d * rstd, rstd, None, rstd * sgd
    s1, sg = jnp.sum(d, -1, keepdims=True) / n, jnp.sum(gs, -1, keepdims=True) / n
    rstd = jax.lax.rsqrt(jnp.maximum(s2 - s1 * s1, 0.0) + eps)
    return (d - s1) * rstd, rstd, sg, rstd * (sgd - s1 * sg)


_norm.defvjp(_norm_fwd, _norm_bwd)

"""fp8 matmuls for the transformer's linear layers (`model.fp8`): a choice of the lowering, as
float8 is a converter in torchtitan; the model never knows (ops.py `Lowering.linear`).

Formats. Forward operands (activations and weights) are float8_e4m3fn (3 mantissa bits, max 448):
precision matters more than range there. The gradient flowing back into a matmul is float8_e5m2
(2 mantissa bits, max 57344): gradients span a wider range. Products accumulate in fp32 inside the
GEMM, and the result is rescaled and written in the compute dtype.

Scaling recipe: current (dynamic) per-tensor scaling. Each operand is divided by the smallest
power of two >= amax(|x|) / fp8_max just before the cast, so its largest element lands in the
format's top binade (torchao's power-of-two scales; MX formats' are powers of two too), and the
GEMM's result is multiplied back by both scales: exact, so the GEMM writes the compute dtype,
rounded once. The amax is the tensor's own on every step: no state to checkpoint, no stale scale
after a loss spike (delayed scaling's weakness). Inside the train step's `shard_map` the manual
dp axis is split by hand, so a `pmax` over it keeps one scale per tensor on every layout (pp's
stages hold other tensors: no pmax over it). Tuned forms take some amaxes from a bound their
producer already has (norm_amax, activation_amax) and reduce a gradient's over its rows first,
in the kernel that sums its bias gradient (fp8_pins).

Direct fp8 GEMMs: `lax.dot_general` on the fp8 arrays with the compute dtype as its preferred
type, which XLA:GPU's GEMM rewriter turns into a cuBLASLt fp8 GEMM (`__cublas$lt$matmul$f8`;
tests/test_gpu_compile.py holds it). The older quantize-dequantize pattern was simplified away
before the rewriter saw it, on a real H100 (docs/benchmarks.md). On a CPU, XLA upcasts the fp8
operands and computes the same products exactly, which is what the CPU tests check.

Weights under fsdp: a weight's e4m3 copy is constrained to the parameter's own sharding, so the
cast runs on each shard and the all-gather moves 1 byte an element (a pipeline's stage weights,
gathered whole once a round, are left alone). Once per step (trick prequantize, jaxgpt/copies.py) the
train step writes each layer's e4m3 copy in the weight's layout (the dx GEMM's operand) and with
the forward's contracted axes last (the forward's K-major operand); the loop's GEMMs read them
(`Prequantized`, `_prequantized_einsum`), bit for bit what quantizing in the loop gives.

Gradients (`custom_vjp`): straight-through; both gradient GEMMs in fp8 too, dy in e5m2 against
the forward's saved e4m3 operands (cuBLASLt takes no e5m2 x e5m2). Which layers: the block
linears (and the experts'), ~all of a block's FLOPs; the embedding and, unless model.fp8_head,
the head stay in the compute dtype (loss.py); attention's batched matmuls stay bf16 in its kernel.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxgpt.model.remat import SCALE
from jaxgpt.parallel.mesh import shard

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def power_of_two_scale(amax: jax.Array, fp8: jnp.dtype) -> jax.Array:
    """The smallest power of two >= amax / the format's max (1 where amax is 0): dividing by it
    puts max|x| in (fmax/2, fmax], and multiplying a product by it is exact in any float format.
    An infinite amax stays the scale, so an inf in x becomes NaN in q, as it reached the loss
    before (clipped to fmax, it would hide a diverging run from train's non-finite check)."""
    mantissa, exponent = jnp.frexp(amax / float(jnp.finfo(fp8).max))  # value = mantissa * 2^exponent, mantissa in [0.5, 1)
    pow2 = jnp.ldexp(jnp.float32(1), jnp.where(mantissa == 0.5, exponent - 1, exponent))
    return jnp.where(amax > 0, jnp.where(jnp.isfinite(amax), pow2, amax), 1.0)


def quantize(x: jax.Array, fp8: jnp.dtype, pin: bool = False,
             amax: jax.Array | None = None, rows: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """x -> (q in `fp8`, fp32 power-of-two scale) with x ~= q * scale and max|q| in (fmax/2, fmax].

    amax: max |x| (fp32) when the caller knows it without reading x (`activation_amax`).

    rows: the axes a linear layer's bias gradient sums (a gradient's batch and sequence axes). The
    amax is then taken over them first, as a reduction of the bias gradient's shape, so that XLA:GPU
    computes both in one kernel and reads the gradient once for the two (`_column_amax`).

    pin: x and its amax pass an optimization barrier together, so that x is written once in its own
    dtype by the fusion that produces it and read once by the cast: without it XLA:GPU, allowed
    excess precision, wrote a gradient's fp32 values for the cast to read."""
    if amax is None:
        amax = _column_amax(x, rows) if rows else jnp.max(jnp.abs(x))
    amax = _global(amax.astype(jnp.float32))
    if pin:
        x, amax = jax.lax.optimization_barrier((x, amax))
    scale = checkpoint_name(power_of_two_scale(amax, fp8), SCALE)  # kept by every remat policy (remat.py)
    return _scaled_cast(x, scale, fp8), scale


def _column_amax(x: jax.Array, rows: tuple[int, ...]) -> jax.Array:
    """max |x|, as the max over `rows` first, then over what is left: exactly the full max.

    Why: a full reduction and the bias gradient's sum over the rows are reductions of two shapes,
    which XLA:GPU puts in two kernels, each reading the [rows, N] gradient; reduced over the rows
    first, the amax shares the bias sum's kernel. The barrier (on an [N] vector) keeps XLA's
    simplifier from folding the two maxima back into one full reduction."""
    return jnp.max(jax.lax.optimization_barrier(jnp.max(jnp.abs(x), axis=rows)))


def _scaled_cast(x: jax.Array, scale: jax.Array, fp8: jnp.dtype) -> jax.Array:
    """x / scale in fp32, clipped to the format's range, cast to `fp8`: the one cast `quantize` and
    `prequantize` share, so a prequantized weight is bit for bit the one quantized in the loop."""
    fmax = float(jnp.finfo(fp8).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(fp8)


def _global(amax: jax.Array) -> jax.Array:
    """amax over the whole tensor. Manual axes that split its rows (dp: the batch) need a pmax for
    one scale per tensor, as on any other layout. pp does not: each stage holds other layers and
    works on another micro-batch, so its tensors are other tensors, not shards of the same one."""
    if manual := tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes if a != "pp"):
        amax = jax.lax.pmax(amax, manual)
    return amax


@functools.cache
def einsum_operands(spec: str) -> tuple[str, str, str]:
    """'btd,df->btf' -> ('btd', 'df', 'btf'), checked: every index of an operand is in the other
    operand or in the output (no index summed inside one operand), so both gradients are einsums."""
    ins, out = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    if any(len(set(s)) != len(s) for s in (a, b, out)) or not set(a) <= set(b) | set(out) \
            or not set(b) <= set(a) | set(out) or set(out) != set(a) ^ set(b) | (set(a) & set(b) & set(out)):
        raise ValueError(f"fp8_einsum needs a two-operand matmul spec, got {spec!r}")
    return a, b, out


@functools.cache
def slice_spec(spec: str, axis: int) -> str:
    """The spec of one slice of the weight along its `axis`: 'btd,dshk->btshk', 1 -> 'btd,dhk->bthk'."""
    a, b, out = einsum_operands(spec)
    return f"{a},{b.replace(b[axis], '')}->{out.replace(b[axis], '')}"


def output_slices(y: jax.Array, spec: str, axis: int) -> tuple[jax.Array, ...]:
    """einsum(spec)'s output y as the outputs of the weight's slices along its `axis`."""
    _, b, out = einsum_operands(spec)
    at = out.index(b[axis])
    return tuple(jax.lax.index_in_dim(y, i, at, keepdims=False) for i in range(y.shape[at]))


def _bias_rows(spec: str) -> tuple[int, ...]:
    """The output's axes that are not the weight's: those a linear layer's bias gradient sums."""
    _, b, out = einsum_operands(spec)
    return tuple(i for i, c in enumerate(out) if c not in b)


@functools.cache
def _dot_plan(spec: str) -> tuple[tuple, tuple[int, ...]]:
    """dot_general's dimension numbers for a two-operand einsum, and the transpose to its output."""
    a, b, out = einsum_operands(spec)
    batch = [c for c in a if c in b and c in out]
    contract = [c for c in a if c in b and c not in out]
    dims = ((tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
            (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
    result = batch + [c for c in a if c not in b] + [c for c in b if c not in a]  # dot_general's order
    return dims, tuple(result.index(c) for c in out)


def planned_dot(spec: str, x: jax.Array, y: jax.Array, dtype: jnp.dtype | None = None) -> jax.Array:
    """einsum(spec, x, y) as one dot_general with `_dot_plan`'s dimension numbers (the contracted
    axes in x's order, so both operands keep them in one order) and `dtype` as its preferred type."""
    dims, perm = _dot_plan(spec)
    out = jax.lax.dot_general(x, y, dims, preferred_element_type=dtype)
    return out if perm == tuple(range(len(perm))) else jnp.transpose(out, perm)


def scaled_dot(spec: str, x_q: jax.Array, sx: jax.Array, y_q: jax.Array, sy: jax.Array,
               dtype: jnp.dtype, fold: bool = False) -> jax.Array:
    """einsum(spec) of two fp8 arrays with fp32 accumulation, rescaled, in `dtype`.

    fold: rescale in `dtype`, which XLA:GPU takes into the cuBLASLt call as its scale operand, rather
    than in fp32 after it, which the consumer's fusion computes (a custom call cannot: cuDNN's
    attention backward reads attn_out's dx as dO, and that rescale was a [rows, D] pass of its own
    per layer and micro-batch). Only for GEMMs no activation follows: a bf16 multiply is also taken
    into cuBLASLt's epilogue with the GELU after it, a GELU_AUX fp8 call XLA:GPU then fails to
    emit. The two agree bit for bit: the scales are powers of two, so the rescale is exact and the
    GEMM's rounding to `dtype` is the only one either way."""
    out = planned_dot(spec, x_q, y_q, dtype)
    if fold:
        return out * (sx * sy).astype(dtype)
    return (out.astype(jnp.float32) * (sx * sy)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_einsum(spec: str, w_axes: tuple | None, tuned: bool, x: jax.Array, w: jax.Array,
                x_amax: jax.Array | None = None) -> jax.Array:
    return _forward(spec, w_axes, tuned, x, w, x_amax)[0]


def _forward(spec, w_axes, tuned, x, w, x_amax=None):
    x_q, sx = quantize(x, E4M3, amax=x_amax)
    w_q, sw = quantize(w, E4M3)
    if w_axes is not None:  # the fp8 copy stays sharded like the parameter: fsdp gathers f8, not bf16
        w_q = shard(w_q, *w_axes)
    return scaled_dot(spec, x_q, sx, w_q, sw, x.dtype), (x_q, sx, w_q, sw)


def _backward(spec, tuned, residuals, dy, dw_dtype=None):
    """dx and dw, dy cast to e5m2. tuned (trick `fp8_pins`): dy pinned and its amax taken over its
    rows first, and dx's rescale folded into its GEMM (`quantize`, `scaled_dot`: the same values)."""
    x_q, sx, w_q, sw = residuals
    a, b, out = einsum_operands(spec)
    dy_q, sdy = quantize(dy, E5M2, pin=tuned, rows=_bias_rows(spec) if tuned else ())
    dx = scaled_dot(f"{out},{b}->{a}", dy_q, sdy, w_q, sw, dy.dtype, fold=tuned)
    dw = scaled_dot(f"{a},{out}->{b}", x_q, sx, dy_q, sdy, dw_dtype or dy.dtype)
    return dx, dw


def _backward_amax(spec, w_axes, tuned, residuals, dy):
    return (*_backward(spec, tuned, residuals, dy), None)  # x_amax: no gradient, as x's own amax has none


_fp8_einsum.defvjp(_forward, _backward_amax)


class Prequantized(NamedTuple):
    """A block weight's e4m3 copies, made once per optimizer step before the micro-batch loop
    (`prequantize`, called by jaxgpt/step.py), standing in the params dict for the weight itself.
    The GEMMs read q and q_t; w is there for its gradient (fp8_einsum's dw is the gradient of w)."""
    w: jax.Array      # the parameter (fp32), never read
    q: jax.Array      # e4m3, the weight's layout: the dx GEMM's operand (contracts its output axes)
    q_t: jax.Array | None  # e4m3, the forward's contracted axes moved last: the forward GEMM's operand;
    #                        None where fsdp gathers the weight (`prequantize`): the forward reads q
    scale: jax.Array  # fp32 power of two, one per layer (the leading stacked axes' shape)


def prequantize(w: jax.Array, stacked: int, contracted: int, dtype: jnp.dtype,
                axes: tuple | None = None, fsdp: bool = False) -> Prequantized:
    """w [stacked axes..., weight axes...] -> its e4m3 copies, one scale per layer, each layer's
    bit for bit what `fp8_einsum` makes of it inside the loop (the weight rounded to `dtype`, its
    amax, the power-of-two scale, the clipped cast). `contracted`: how many leading weight axes
    the forward GEMM contracts (q_t moves them last, so that GEMM reads K-major operands with no
    transpose in the loop). `axes`: w's logical axes, which q keeps (fsdp then gathers 1 byte an
    element) and q_t permutes.

    Where fsdp splits the weight the loop gathers it for each GEMM, and a q_t made here would be
    gathered as well as q; there q_t is None and the forward reads the gathered q, transposed."""
    w_c = w.astype(dtype)
    amax = _global(jnp.max(jnp.abs(w_c), axis=tuple(range(stacked, w.ndim))).astype(jnp.float32))
    scale = power_of_two_scale(amax, E4M3)
    q = _scaled_cast(w_c, scale.reshape(scale.shape + (1,) * (w.ndim - stacked)), E4M3)
    if axes is not None and "embed" in axes and fsdp:
        return Prequantized(w, shard(q, *axes), None, scale)
    perm = (*range(stacked), *range(stacked + contracted, w.ndim), *range(stacked, stacked + contracted))
    q_t = jnp.transpose(q, perm)
    if axes is not None:
        q, q_t = shard(q, *axes), shard(q_t, *(axes[i] for i in perm))
    return Prequantized(w, q, q_t, scale)


class PrequantizedFp32Grad(Prequantized):
    """A `Prequantized` weight whose gradient GEMM writes fp32 (trick grads_in_gemm), not the
    compute dtype. A type of its own, not a field: the choice must stay static."""


def _transposed_spec(spec: str) -> str:
    """'btd,df->btf' -> 'btd,fd->btf': the weight's contracted letters, which must lead, moved last
    (the layout of Prequantized.q_t)."""
    a, b, out = einsum_operands(spec)
    k = sum(c not in out for c in b)
    if any(c in out for c in b[:k]):
        raise ValueError(f"a prequantized weight's contracted axes must lead, got {spec!r}")
    return f"{a},{b[k:] + b[:k]}->{out}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _prequantized_einsum(spec: str, w_dtype: jnp.dtype, fp32_grad: bool, parts: int | None, x: jax.Array,
                         w: jax.Array, q: jax.Array, q_t: jax.Array, scale: jax.Array, x_amax: jax.Array | None = None,
                         b: jax.Array | None = None) -> jax.Array | tuple[jax.Array, ...]:
    """`jnp.einsum(spec, x, w)` (+ b) from the weight's e4m3 copies (`Prequantized`).

    parts: None, or an axis of w whose slices the forward takes as GEMMs of their own (q, k and v),
    the tuple of their outputs, each with the rescale in cuBLASLt's alpha and its bias (b: the
    tuple of the slices', any None) in its epilogue. Without parts a bias goes in the epilogue too
    (the MLP's in GEMM). The backward joins the slices' gradients for one e5m2 cast."""
    return _pre_forward(spec, w_dtype, fp32_grad, parts, x, w, q, q_t, scale, x_amax, b)[0]


def _pre_forward(spec, w_dtype, fp32_grad, parts, x, w, q, q_t, scale, x_amax=None, b=None):
    x_q, sx = quantize(x, E4M3, amax=x_amax)
    if (parts is None and b is None) or q_t is None:  # q_t None: fsdp gathers q, once for the forward and the backward
        y = scaled_dot(spec, x_q, sx, q, scale, x.dtype) if q_t is None else \
            scaled_dot(_transposed_spec(spec), x_q, sx, q_t, scale, x.dtype)
        return _with_bias(y, b, spec, parts), (x_q, sx, q, scale, b)
    # each GEMM (each slice's, or the one with a bias) as [rows, K] x [K, F], its output axes
    # flattened: cuBLASLt then takes the rescale into its alpha and the bias into its epilogue;
    # over [B, T, H, K] XLA:GPU applies both in a pass of their own
    _, wl, out = einsum_operands(spec)
    k = sum(c not in out for c in wl)  # the contracted axes: w's first, x's last, q_t's last
    rows, x2_q = x.shape[:-k], x_q.reshape(-1, math.prod(x.shape[-k:]))
    y = []
    for i in range(1 if parts is None else q.shape[parts]):
        # each GEMM its own copy of the scale (a barrier after the GEMM before): XLA:GPU folds a
        # rescale into cuBLASLt's alpha only where that scale has no other user
        sx_i = jax.lax.optimization_barrier((sx, y[-1]))[0] if y else sx
        w_i = q_t if parts is None else jax.lax.index_in_dim(q_t, i, parts - k, keepdims=False)
        b_i = b if parts is None or b is None else b[i]
        y_i = scaled_dot("rk,fk->rf", x2_q, sx_i, w_i.reshape(-1, x2_q.shape[1]), scale, x.dtype, fold=True)
        if b_i is not None:  # its own array (a barrier), as in linear.py `_precast_einsum`
            y_i = y_i + jax.lax.optimization_barrier(b_i.astype(x.dtype).reshape(-1))
        y.append(y_i.reshape(*rows, *w_i.shape[:-k]))
    if parts is None:
        # the MLP's in GEMM: a barrier keeps the activation after it out of the cuBLASLt call, which
        # XLA:GPU would make a GELU_AUX fp8 call it then fails to emit (RET_CHECK !has_aux_output)
        return jax.lax.optimization_barrier(y[0]), (x_q, sx, q, scale, b)
    return tuple(y), (x_q, sx, q, scale, b)


def _pre_backward(spec, w_dtype, fp32_grad, parts, residuals, dy):
    *residuals, b = residuals
    _, wl, out = einsum_operands(spec)
    if parts is not None:  # joined as autodiff joins slices' gradients (padded and added): XLA:GPU
        # then takes the amax and the bias's gradient in the kernel that joins them (a concatenate: two)
        axis, n = out.index(wl[parts]), len(dy)
        dy = sum(jax.lax.pad(jnp.expand_dims(g, axis), jnp.zeros((), g.dtype),
                             [(i if d == axis else 0, n - 1 - i if d == axis else 0, 0) for d in range(g.ndim + 1)])
                 for i, g in enumerate(dy))
    dx, dw = _backward(spec, True, residuals, dy, jnp.float32 if fp32_grad else None)
    db = None if b is None else jnp.sum(dy.astype(jnp.float32), axis=_bias_rows(spec))
    if isinstance(b, tuple):  # the slices' biases: db's leading axis is theirs
        db = tuple(None if b_i is None else db[i].astype(b_i.dtype) for i, b_i in enumerate(b))
    elif b is not None:
        db = db.astype(b.dtype)
    return dx, dw.astype(w_dtype), None, None, None, None, db  # q, q_t, scale, x_amax: made outside the gradient


_prequantized_einsum.defvjp(_pre_forward, _pre_backward)


def _with_bias(y: jax.Array, bias: jax.Array | tuple | None, spec: str, parts: int | None) -> jax.Array | tuple:
    """y + bias, or with `parts` y's slices along the weight's axis `parts`, each plus its bias
    (bias: the tuple of them, any None, as layers.py `dense` passes it)."""
    if parts is None:
        return y if bias is None else y + bias.astype(y.dtype)
    ys = output_slices(y, spec, parts)
    return ys if bias is None else tuple(y_i if b_i is None else y_i + b_i.astype(y_i.dtype)
                                         for y_i, b_i in zip(ys, bias, strict=True))


def fp8_einsum(spec: str, x: jax.Array, w: jax.Array, w_axes: tuple | None = None,
               x_amax: jax.Array | None = None, tuned: bool = True) -> jax.Array:
    """`jnp.einsum(spec, x, w)` as fp8 GEMMs: e4m3 operands forward, an e5m2 gradient backward.
    x and w share the compute dtype (the model casts its weights), which is also the output's.
    w_axes (the weight's logical axes; None in a pipeline, whose stage weights arrive gathered once
    per round): its e4m3 copy is constrained to the parameter's sharding, so the cast runs on each
    device's shard and fsdp's all-gather moves 1 byte an element. tuned: `_backward`'s pins."""
    einsum_operands(spec)
    return _fp8_einsum(spec, None if w_axes is None else tuple(w_axes), tuned, x, w.astype(x.dtype), x_amax)

"""The tuned linear layer: weight copies made once per step, biases in GEMM epilogues, q, k and v
as GEMMs of their own, weight gradients written in fp32, a norm's bias gradient routed through the
linears it feeds; and the barriers that keep XLA:GPU's fusions where these put them.

Why barriers. XLA:GPU fuses a bias (or a residual) into a GEMM's epilogue only where that operand
is an array of its own (a parameter, or behind an optimization barrier), and fuses elementwise
work into whatever kernel reads its result unless a barrier keeps the result whole.
`fence_gradient` is a barrier on the gradient only. docs/ops.md says what
each trick here removes and what it was predicted to gain; tests/test_ops.py holds each to the
reference form (model/ops.py), tests/test_gpu_compile.py to the kernels it is for.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgpt.lowering.fp8 import (Prequantized, PrequantizedFp32Grad, _prequantized_einsum, _with_bias,
                                 einsum_operands, fp8_einsum, output_slices, planned_dot, slice_spec)


class Precast(NamedTuple):
    """A block weight's copy in the compute dtype, made once per optimizer step before the
    micro-batch loop (jaxgpt/copies.py), standing in the params for the weight itself. The GEMMs read c;
    the gradient is w's (`_read_copy`)."""
    w: jax.Array  # the parameter (fp32)
    c: jax.Array  # w in the compute dtype


class PrecastFp32Grad(Precast):
    """A `Precast` whose weight gradient its GEMM writes in fp32 (`_precast_einsum`). A type of its
    own, not a field: a Precast is a pytree, and the choice must stay static."""


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _read_copy(dtype: jnp.dtype, w: jax.Array, c: jax.Array) -> jax.Array:
    """c (w cast to the compute dtype) forward; backward, the cotangent in w's dtype, to w: what
    autodiff of w.astype(c.dtype) gives, without the cast in every micro-batch."""
    return c


_read_copy.defvjp(lambda dtype, w, c: (c, None), lambda dtype, _, g: (g.astype(dtype), None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _precast_einsum(spec: str, w_dtype: jnp.dtype, fp32_grad: bool, parts: int | None, x: jax.Array,
                    w: jax.Array, c: jax.Array, b=None) -> jax.Array | tuple[jax.Array, ...]:
    """einsum(spec, x, c) (+ b), c being w cast to the compute dtype; the gradient goes to w, the
    parameter, in its own dtype (w_dtype), and to the bias b.

    fp32_grad (trick `grads_in_gemm`): the weight gradient's GEMM writes it in fp32, its
    accumulator's precision, where autodiff rounds it to the compute dtype first: XLA:GPU then takes
    the train step's sum over micro-batches into that GEMM (acc + x^T dy; jaxgpt/copies.py `gemm_pieces`).

    parts: None, or an axis of w whose slices are GEMMs of their own (trick `qkv_gemms`), `spec`
    being one slice's: the tuple of their outputs; b is then the tuple of their biases (any None).
    Their weight gradients are joined along that axis here.

    b: added in the GEMM's epilogue. XLA:GPU fuses a bias into a Triton GEMM only where the dot
    writes fp32 and the bias is an array of its own, one axis wide, on the output's last axis: so
    the dot is taken over the weight's output axes flattened, the bias behind a barrier."""
    return _precast_fwd(spec, w_dtype, fp32_grad, parts, x, w, c, b)[0]


def _slices(c: jax.Array, b, parts: int | None) -> list:
    """(c's slice, its bias) per GEMM: c and b whole, or with `parts` each slice and its own bias."""
    if parts is None:
        return [(c, b)]
    return [(jax.lax.index_in_dim(c, i, parts, keepdims=False), None if b is None else b[i])
            for i in range(c.shape[parts])]


def _biased_einsum(spec: str, x: jax.Array, c: jax.Array, b: jax.Array | None) -> jax.Array:
    if b is None:
        return jnp.einsum(spec, x, c)
    a, wl, out = einsum_operands(spec)
    k = len(wl) - b.ndim  # the contracted axes lead the weight; the bias's are its output axes, last
    if out != a[:-k] + wl[k:] or a[-k:] != wl[:k]:
        raise ValueError(f"a bias in the GEMM's epilogue needs a '...c,cf->...f'-shaped spec, got {spec!r}")
    y = jnp.einsum("...k,kf->...f", x.reshape(*x.shape[:-k], -1), c.reshape(math.prod(c.shape[:k]), -1),
                   preferred_element_type=jnp.float32)
    y = (y + jax.lax.optimization_barrier(b.astype(jnp.float32).reshape(-1))).astype(x.dtype)
    return y.reshape(*x.shape[:-k], *b.shape)


def _precast_fwd(spec, w_dtype, fp32_grad, parts, x, w, c, b=None):
    ys = [_biased_einsum(spec, x, c_i, b_i) for c_i, b_i in _slices(c, b, parts)]
    return tuple(ys) if parts is not None else ys[0], (x, c, b)


def _precast_bwd(spec, w_dtype, fp32_grad, parts, residuals, dy):
    x, c, b = residuals
    a, wl, out = einsum_operands(spec)
    dx, dws, dbs = None, [], []
    for (c_i, b_i), dy_i in zip(_slices(c, b, parts), dy if parts is not None else (dy,), strict=True):
        dx_i = planned_dot(f"{out},{wl}->{a}", dy_i, c_i)  # jnp.einsum's own order transposed QKV's gradient
        dx = dx_i if dx is None else dx + dx_i
        dws.append(planned_dot(f"{a},{out}->{wl}", x, dy_i, jnp.float32 if fp32_grad else None))
        db_i = None
        if b_i is not None:
            rows = tuple(range(dy_i.ndim - b_i.ndim))
            db_i = jnp.sum(dy_i.astype(jnp.float32), axis=rows).astype(b_i.dtype)
        dbs.append(db_i)
    dw = dws[0] if parts is None else jnp.stack(dws, parts)
    db = None if b is None else dbs[0] if parts is None else tuple(dbs)
    return dx, dw.astype(w_dtype), None, db


_precast_einsum.defvjp(_precast_fwd, _precast_bwd)


def weight_as_read(w, dtype: jnp.dtype) -> jax.Array:
    """A weight as its GEMM in `dtype` reads it: a `Precast`'s copy, or the parameter cast."""
    w = w.w if isinstance(w, Prequantized) else w
    return w.c if isinstance(w, Precast) else w.astype(dtype)


def parameter(w) -> jax.Array:
    """The parameter behind a weight form (a copy's `w`), or the weight itself."""
    return w.w if isinstance(w, Precast | Prequantized) else w


def dense(name: str, spec: str, x: jax.Array, w, axes: tuple | None, fp8: bool, x_amax: jax.Array | None = None, *,
          bias=None, parts: int | None = None, apart: bool = True, fp8_tuned: bool = True):
    """einsum(spec, x, w) (+ bias) for a weight in any of its forms: the parameter, its `Precast`
    copy or its `Prequantized` e4m3 copies (jaxgpt/copies.py), in fp8 (`fp8`) or the compute dtype, under
    the named scope `name`. axes: the weight's logical axes (fp8: its e4m3 copy keeps the
    parameter's sharding, so fsdp gathers 1 byte an element). bias: added in the GEMM's epilogue
    (`_precast_einsum`; fp8: cuBLASLt's, where the weight is prequantized).

    parts: an axis of w (its 'qkv' axis): the tuple of the outputs of its slices, each a GEMM of its
    own that writes its slice as the attention kernel reads it; the bias the tuple of the slices'
    biases (any None). Where not `apart` (fsdp: each slice's GEMM gathered its own slice, and the
    backward the whole weight again) one GEMM, sliced after."""
    if parts is not None and not apart:
        if bias is not None and all(b is not None for b in bias):  # added before the slices are taken, in one pass
            y = dense(name, spec, x, w, axes, fp8, x_amax, fp8_tuned=fp8_tuned)
            return output_slices(add_bias(y, jnp.stack(bias)), spec, parts)
        ys = output_slices(dense(name, spec, x, w, axes, fp8, x_amax, fp8_tuned=fp8_tuned), spec, parts)
        return ys if bias is None else tuple(add_bias(y, b) for y, b in zip(ys, bias, strict=True))
    if isinstance(w, Prequantized) and not fp8:
        w = w.w
    with jax.named_scope(name):
        if not fp8 and (bias is not None or parts is not None or isinstance(w, PrecastFp32Grad)):
            return _precast_einsum(spec if parts is None else slice_spec(spec, parts), jnp.dtype(parameter(w).dtype),
                                   isinstance(w, PrecastFp32Grad), parts, x, parameter(w),
                                   weight_as_read(w, x.dtype), bias)
        if isinstance(w, Prequantized):
            return _prequantized_einsum(spec, jnp.dtype(w.w.dtype), isinstance(w, PrequantizedFp32Grad), parts,
                                        x, *w, x_amax, bias)
        w = _read_copy(jnp.dtype(w.w.dtype), w.w, w.c) if isinstance(w, Precast) else w.astype(x.dtype)
        y = fp8_einsum(spec, x, w, axes, x_amax, fp8_tuned) if fp8 else jnp.einsum(spec, x, w)
        return _with_bias(y, bias, spec, parts)


def folded_bias(spec: str, in_bias: jax.Array | None, w, bias: jax.Array | None) -> jax.Array | None:
    """The bias of the linear layer einsum(spec, x, w) + bias whose input x lacks a bias of its
    own, in_bias (over the weight's contracted axes): (x + in_bias) W + bias = x W + (in_bias W +
    bias). In fp32, a GEMV on the parameter itself, whose gradient autodiff sends to the weight and
    to in_bias. `bias` itself where in_bias is None (trick `qkv_bias_drop`)."""
    if in_bias is None:
        return bias
    _, wl, out = einsum_operands(spec)
    k = sum(c not in out for c in wl)  # the contracted axes lead the weight
    folded = jnp.einsum(f"{wl[:k]},{wl}->{wl[k:]}", in_bias.astype(jnp.float32), parameter(w).astype(jnp.float32))
    return folded if bias is None else folded + bias


def passes_input_bias_grad(bias: jax.Array | None, in_bias: jax.Array | None, w: jax.Array,
                           contracted: int) -> jax.Array | None:
    """bias (of a linear layer z = x w + bias whose input x holds a bias of its own, in_bias), as
    it is, but with the gradient that reaches it passed on to in_bias too, through w: x = n +
    in_bias gives d in_bias = sum_rows(dz) w^T = d bias w^T, a GEMV (trick `routed_bias`: the
    norm whose bias it is then sums one column less over its [rows, D] gradient). w: the weight as
    the GEMM reads it, its `contracted` leading axes x's. bias itself where there is no in_bias
    (or no bias: a linear without one cannot carry it)."""
    if in_bias is None or bias is None:
        return bias
    return bias + _zero_passing_grad(contracted, in_bias, w).astype(bias.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _zero_passing_grad(contracted: int, in_bias: jax.Array, w: jax.Array) -> jax.Array:
    """0, shaped as w's output axes; its gradient g goes to in_bias as w g (none to w). The zeros
    take in_bias's type (full_like): dp-varying inside the train step's dp shard_map, so that g
    stays each shard's own, summed over shards once after the micro-batch loop as every gradient
    is (zeros of no input's type took an all-reduce of g in every micro-batch)."""
    return jax.lax.full_like(in_bias, 0, jnp.float32, shape=w.shape[contracted:])


def _zero_passing_grad_fwd(contracted, in_bias, w):
    return _zero_passing_grad(contracted, in_bias, w), w


def _zero_passing_grad_bwd(contracted, w, g):
    out = tuple(range(contracted, w.ndim))
    return jnp.tensordot(w.astype(jnp.float32), g.astype(jnp.float32), axes=(out, tuple(range(g.ndim)))), None


_zero_passing_grad.defvjp(_zero_passing_grad_fwd, _zero_passing_grad_bwd)


@jax.custom_vjp
def fence_gradient(x: jax.Array) -> jax.Array:
    """x, whose gradient passes an optimization barrier: the kernel that writes the gradient takes
    none of its consumers' work."""
    return x


fence_gradient.defvjp(lambda x: (x, None), lambda _, g: (jax.lax.optimization_barrier(g),))


def add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """y + bias in y's dtype; y itself where the layer has no bias (model.bias=false)."""
    return y if bias is None else y + bias.astype(y.dtype)

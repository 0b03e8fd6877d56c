"""The small pieces every block is built from: parameters with logical axes, the compute dtype,
norms and the dense MLP.

Precision. Parameters are fp32. Matmuls run in the compute dtype (bf16 on GPU); norms compute in fp32 and
return the input's dtype (norm.py, with its hand-written backward).
Initialisation follows GPT-2: normal(0.02) for weights and embeddings, zero biases, unit norm
scales (the residual projections' smaller std is chosen by their layers).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgpt.config import ModelConfig
from jaxgpt.gpu.target import target_device
from jaxgpt.model.activations import activate, activation_amax
from jaxgpt.model.fp8 import (Prequantized, PrequantizedFp32Grad, einsum_operands, linear, output_slices, planned_dot,
                              prequantize, slice_spec)
from jaxgpt.model.norm import normalize, normalize_with_amax
from jaxgpt.parallel.mesh import shard, splits

STD = 0.02


def compute_dtype(name: str) -> jnp.dtype:
    """model.dtype -> the dtype matmuls run in ('auto': bf16 on GPU/TPU, fp32 on CPU)."""
    if name == "auto":
        return jnp.bfloat16 if target_device().platform in ("gpu", "tpu") else jnp.float32
    return jnp.dtype(name)


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float | None) -> nnx.Param:
    """A parameter with its logical axes; std=None -> zeros, std=0 -> ones (LayerNorm scale)."""
    if std is None:
        value = jnp.zeros(shape, jnp.float32)
    elif std == 0:
        value = jnp.ones(shape, jnp.float32)
    else:
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, logical_axes=axes)


class Precast(NamedTuple):
    """A block weight's copy in the compute dtype, made once per optimizer step before the
    micro-batch loop (`precast_weights`), standing in the params dict for the weight itself. The
    GEMMs read c; the gradient is w's (`_read_copy`)."""
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


def _read_copy_fwd(dtype, w, c):
    return c, None


def _read_copy_bwd(dtype, _, g):
    return g.astype(dtype), None


_read_copy.defvjp(_read_copy_fwd, _read_copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _precast_einsum(spec: str, w_dtype: jnp.dtype, fp32_grad: bool, parts: int | None, x: jax.Array, w: jax.Array,
                    c: jax.Array, b: jax.Array | None = None) -> jax.Array | tuple[jax.Array, ...]:
    """einsum(spec, x, c) (+ b), c being w cast to the compute dtype; the gradient goes to w, the
    parameter, in its own dtype (w_dtype), and to the bias b.

    fp32_grad: the weight gradient's GEMM writes it in fp32, its accumulator's precision, where
    autodiff of x @ c (`_read_copy`) rounds it to the compute dtype first: XLA:GPU then takes the
    train step's sum over micro-batches into that GEMM (acc + x^T dy; jaxgpt/step.py sums these per
    GEMM, `gemm_pieces`) instead of adding the bf16 gradient to the fp32 sum in a pass of its own.
    Only there: a gradient that leaves the GEMM for a stack (scanned layers) or a reduce-scatter
    (fsdp) would move twice the bytes (jaxgpt.config.weight_grads_summed_in_gemm).

    parts: None, or an axis of w whose slices are GEMMs of their own, `spec` being one slice's: the
    tuple of their outputs; b is then the tuple of their biases (None for a slice without). Their
    weight gradients are joined along that axis here, so that a piece of the joined gradient is one
    GEMM's output (a slice of autodiff's sum of padded slices reads all of them).

    b: added in the GEMM's epilogue. XLA:GPU fuses a bias into a Triton GEMM only where the dot
    writes fp32 and the bias is an array of its own, one axis wide, on the output's last axis:
    so the dot is taken over the weight's output axes flattened, and the bias (a slice of the
    stacked parameters in the step) is made its own array behind an optimization barrier (a copy
    of a few KB). A bias added after the GEMM costs a pass over its output, where nothing else
    fuses it (the q, k and v GEMMs, whose outputs go to the attention kernel)."""
    return _precast_fwd(spec, w_dtype, fp32_grad, parts, x, w, c, b)[0]


def _slices(c: jax.Array, b: jax.Array | tuple | None, parts: int | None) -> list:
    """(c's slice, its bias) per GEMM: c and b whole, or with `parts` each slice and its own bias
    (b: a tuple of them, any of them None)."""
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
    ys = []
    for c_i, b_i in _slices(c, b, parts):
        # each part's GEMM after the one before: XLA:GPU's dot merger otherwise joins small ones
        # (gpt2-124m's on 8 GPUs) into one GEMM that writes [rows, 3D] in fp32 for a pass to split
        x_i = jax.lax.optimization_barrier((x, ys[-1]))[0] if ys else x
        ys.append(_biased_einsum(spec, x_i, c_i, b_i))
    return tuple(ys) if parts is not None else ys[0], (x, c, b)


def _precast_bwd(spec, w_dtype, fp32_grad, parts, residuals, dy):
    x, c, b = residuals
    a, wl, out = einsum_operands(spec)
    dx, dws, dbs = None, [], []
    for (c_i, b_i), dy_i in zip(_slices(c, b, parts), dy if parts is not None else (dy,), strict=True):
        dx_i = planned_dot(f"{out},{wl}->{a}", dy_i, c_i)  # jnp.einsum's own order transposed QKV's gradient (+60 ms)
        # on a GPU each slice's dx GEMM adds the sum so far in its epilogue (an array of its own: a
        # barrier); otherwise the last read both earlier ones (gpt2-124m on one H100: 912.1 -> 909.5 ms
        # predicted). Not on a CPU: XLA:CPU takes no sum into a dot, and the barrier only splits its fusions
        chained = dx is not None and target_device().platform == "gpu"
        dx = dx_i if dx is None else (jax.lax.optimization_barrier(dx) if chained else dx) + dx_i
        dws.append(planned_dot(f"{a},{out}->{wl}", x, dy_i, jnp.float32 if fp32_grad else None))
        # the bias gradient's sum: in the dx pass of the norm after the residual add, where that norm
        # routes its own bias's gradient, else a pass of its own (`Norm`'s fence)
        db_i = None
        if b_i is not None:
            rows = tuple(range(dy_i.ndim - b_i.ndim))
            db_i = jnp.sum(dy_i.astype(jnp.float32), axis=rows).astype(b_i.dtype)
        dbs.append(db_i)
    dw = dws[0] if parts is None else jnp.stack(dws, parts)
    db = None if b is None else dbs[0] if parts is None else tuple(dbs)
    return dx, dw.astype(w_dtype), None, db


_precast_einsum.defvjp(_precast_fwd, _precast_bwd)


def dense(name: str, spec: str, x: jax.Array, kernel: nnx.Param, fp8: bool, x_amax: jax.Array | None = None,
          *, bias: nnx.Param | jax.Array | tuple | None = None,
          split: bool = False) -> jax.Array | tuple[jax.Array, ...]:
    """`fp8.linear` on a weight parameter, cast to x's dtype; its logical axes go along so that
    under fp8 its e4m3 copy keeps the parameter's sharding (fsdp then gathers 1 byte an element).
    The parameter may hold the weight's `Prequantized` copies instead (`prequantize_weights`), or
    its `Precast` copy in the compute dtype (`precast_weights`).

    bias: added to the output, in the GEMM's epilogue (`_precast_einsum`; fp8: cuBLASLt's, where
    the weight is `Prequantized`). split: the tuple of the outputs of the weight's slices along its
    'qkv' axis (attention's q, k and v), each a GEMM of its own that writes its slice as the
    attention kernel reads it (fp8: the forward's); the bias then comes as the tuple of the
    slices' biases (any of them None), or as one array whose leading axis is the slices'. One
    GEMM, sliced after, under fsdp (`_slices_apart`) and where fp8 quantizes the weight in the loop
    (a pipeline's)."""
    if split and bias is not None and not isinstance(bias, tuple):
        bias = tuple(bias[...])
    if split and not _slices_apart():
        axis = kernel.logical_axes.index("qkv")
        if bias is not None and all(b is not None for b in bias):  # added before the slices are taken, in one pass
            return output_slices(add_bias(dense(name, spec, x, kernel, fp8, x_amax), jnp.stack(bias)), spec, axis)
        ys = output_slices(dense(name, spec, x, kernel, fp8, x_amax), spec, axis)
        return ys if bias is None else tuple(add_bias(y, b) for y, b in zip(ys, bias, strict=True))
    w, axes = kernel.get_value(), kernel.logical_axes
    b = bias if bias is None or isinstance(bias, tuple) else bias[...]
    parts = axes.index("qkv") if split else None
    if isinstance(w, Prequantized) and not fp8:
        w = w.w
    if not fp8 and (b is not None or split or isinstance(w, PrecastFp32Grad)):
        w_, c = w.w if isinstance(w, Precast) else w, weight_as_read(w, x.dtype)
        with jax.named_scope(name):
            return _precast_einsum(spec if parts is None else slice_spec(spec, parts), jnp.dtype(w_.dtype),
                                   isinstance(w, PrecastFp32Grad), parts, x, w_, c, b)
    if isinstance(w, Precast):
        w = _read_copy(jnp.dtype(w.w.dtype), w.w, w.c)
    return linear(name, spec, x, w, fp8, axes, x_amax, parts=parts, bias=b)


def folded_bias(spec: str, in_bias: jax.Array | None, kernel: nnx.Param,
                bias: nnx.Param | jax.Array | None) -> nnx.Param | jax.Array | None:
    """The bias of the linear layer einsum(spec, x, kernel) + bias whose input x lacks a bias of its
    own, in_bias (over the weight's contracted axes): (x + in_bias) W + bias = x W + (in_bias W +
    bias). In fp32, a GEMV on the parameter itself (a copy's `w`), whose gradient autodiff sends to
    the weight and to in_bias. `bias` itself where in_bias is None. attention.py `_qkv` says why
    (v's bias, folded into attn_out's)."""
    if in_bias is None:
        return bias
    _, wl, out = einsum_operands(spec)
    k = sum(c not in out for c in wl)  # the contracted axes lead the weight
    w = kernel.get_value()
    w = w.w if isinstance(w, Precast | Prequantized) else w
    folded = jnp.einsum(f"{wl[:k]},{wl}->{wl[k:]}", in_bias.astype(jnp.float32), w.astype(jnp.float32))
    return folded if bias is None else folded + bias[...]


def passes_input_bias_grad(bias: jax.Array | None, in_bias: jax.Array | None, w: jax.Array,
                           contracted: int) -> jax.Array | None:
    """bias (of a linear layer z = x w + bias whose input x holds a bias of its own, in_bias), as
    it is, but with the gradient that reaches it passed on to in_bias too, through w: x = n +
    in_bias gives d in_bias = sum_rows(dz) w^T = d bias w^T, the linear's own bias gradient times
    its weight, a GEMV. This is how a norm's bias gets its gradient where the norm routes it to the
    linears it feeds (`Norm.routed`): its backward then sums one column less over its [rows, D]
    gradient. w: the weight as the GEMM reads it, its `contracted` leading axes x's. bias itself
    where there is no in_bias (or no bias: a linear without one cannot carry it)."""
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


def weight_as_read(w: jax.Array | Precast, dtype: jnp.dtype) -> jax.Array:
    """A weight parameter's value as its GEMM in `dtype` (the compute dtype) reads it: a
    `Precast`'s copy, or the parameter cast."""
    return w.c if isinstance(w, Precast) else w.astype(dtype)


def project_out(name: str, spec: str, x: jax.Array, kernel: nnx.Param, fp8: bool, bias: nnx.Param | None,
                x_amax: jax.Array | None = None, in_bias: jax.Array | None = None) -> jax.Array:
    """`dense` for a projection back onto the residual stream (attention's and the MLP's c_proj),
    whose output the block adds to the stream. Where `gemm_epilogues`, the bias goes in the
    GEMM's epilogue, and XLA:GPU takes the block's residual add there too (blocks.py `_residual`),
    where it was a pass of its own. Elsewhere it is added after, as before: the next norm's
    statistics pass takes the bias and the residual add, and its backward sums the bias gradient
    beside the norm's. in_bias: a bias of x that x does not hold (`folded_bias`)."""
    bias = folded_bias(spec, in_bias, kernel, bias)
    if not gemm_epilogues(fp8):
        return add_bias(dense(name, spec, x, kernel, fp8, x_amax), bias)
    return dense(name, spec, x, kernel, fp8, x_amax, bias=bias)


def gemm_epilogues(fp8: bool) -> bool:
    """Whether the block's compute-dtype GEMMs take the work around them into their epilogues: a
    residual projection's bias and the residual add (`project_out`, blocks.py `_residual`), and
    with them the norms recompute their statistics (`Norm`) and attention's k and v add no bias
    (attention.py `_qkv`). Not in fp8 (`fp8`: the layer's GEMM is), where a cuBLASLt fp8 GEMM takes
    no residual and the fp8 backward already sums the biases' gradients in the kernel that takes
    the gradient's amax (gpt2-1.3b fp8 on one H100: 3,126.5 -> 3,147.9 ms a step predicted with k's
    and v's), and not under fsdp, where the bias sums took reduce-scatters and all-reduces of their
    own (gpt2-1.3b on 8 H100s, fsdp=8: 677.3 -> 690.9 ms)."""
    return not fp8 and _slices_apart()


def _slices_apart() -> bool:
    """Whether `dense`'s split takes each slice of a fused weight as a GEMM of its own: not where fsdp
    splits the weights. There it is one GEMM, sliced after: each slice's GEMM gathered its own
    slice, and the backward the whole weight again (gpt2-1.3b on 8 H100s, fsdp=8: 677.3 -> 697.9
    ms a step predicted)."""
    return splits("embed") == 1


def _pieces(stacked: jax.Array, axes: tuple, parts: bool) -> tuple:
    """A stacked block weight [L, ...] (or its gradient or copy; `axes` its logical axes) as a
    tuple of its L layers, each a tuple of its slices along 'qkv' where `parts`: the arrays its
    GEMMs read or write, where each slice is a GEMM of its own (`dense`'s split)."""
    if not parts:
        return tuple(stacked)
    axis = axes.index("qkv") - 1
    return tuple(tuple(jnp.moveaxis(layer, axis, 0)) for layer in stacked)


def _joined(pieces: tuple, axes: tuple) -> jax.Array:
    """`_pieces`' inverse: the stacked array again."""
    if isinstance(pieces[0], tuple):
        axis = axes.index("qkv") - 1
        return jnp.stack([jnp.stack(parts, axis) for parts in pieces])
    return jnp.stack(pieces)


def gemm_pieces(grads: dict, copies: dict, axes: dict) -> dict:
    """A dense model's block gradients (params['blocks']'s tree) as their GEMMs write them, where
    they write them in fp32 (the weight's copy once per step, in `copies`, a *Fp32Grad; `_pieces`):
    the train step sums these pieces over micro-batches, so that XLA:GPU takes each sum into the
    GEMM that writes the piece (jaxgpt/step.py). The other gradients as they are. `axes`: the
    blocks' logical axes."""
    def pieces(module: str, name: str, g):
        copy = copies.get(module, {}).get(name)
        if not isinstance(copy, PrecastFp32Grad | PrequantizedFp32Grad):
            return g
        w_axes = axes[module][name]
        return _pieces(g, w_axes, isinstance(copy, PrecastFp32Grad) and "qkv" in w_axes)
    return {module: {name: pieces(module, name, g) for name, g in weights.items()} for module, weights in grads.items()}


def from_gemm_pieces(grads: dict, axes: dict) -> dict:
    """`gemm_pieces`' inverse: the stacked gradients again."""
    return {module: {name: _joined(g, axes[module][name]) if isinstance(g, tuple) else g for name, g in weights.items()}
            for module, weights in grads.items()}


# A dense model's block linears: where each weight sits in its params['blocks'] dict, its kind
# (model.fp8) and how many of its leading axes the forward GEMM contracts.
LINEAR_WEIGHTS = {("attn", "c_attn_kernel"): ("qkv", 1), ("attn", "q_kernel"): ("qkv", 1),
                  ("attn", "kv_kernel"): ("qkv", 1), ("attn", "c_proj_kernel"): ("attn_out", 2),
                  ("mlp", "c_fc_kernel"): ("mlp_in", 1), ("mlp", "c_gate_kernel"): ("mlp_gate", 1),
                  ("mlp", "c_proj_kernel"): ("mlp_out", 1)}


def prequantize_weights(blocks: dict, axes: dict, kinds: frozenset[str], dtype: jnp.dtype, *,
                        unrolled: bool, fp32_grads: bool = False) -> dict:
    """{module: {name: Prequantized}} for the weights of `blocks` (a dense model's stacked
    params['blocks']) whose kind is in `kinds`, each layer quantized as `dense` would (fp8.prequantize);
    `axes`: their logical axes, the stacked 'layers' axis first. The train step makes these once per
    optimizer step, before its micro-batch loop, rather than once per micro-batch and layer.
    With the layers unrolled (`unrolled`, model.scan_layers=false), q and q_t come as tuples of
    per-layer arrays, which `with_prequantized` stacks inside the loop: XLA then folds each layer's
    slice of that stack back to the layer's own array, where a stacked array carried into the loop
    had each slice copied every micro-batch (gpt2-1.3b on an H100, 3,401.6 -> 3,372.8 ms a step
    predicted). Scanned layers slice the stack themselves, so there they stay stacked: stacking
    the tuples again would copy every copy once per micro-batch (llama-8b fp8 on 8 H100s, fsdp=8:
    5,721.6 -> 5,705.8 ms predicted). fp32_grads: `PrequantizedFp32Grad`s, as `precast_weights`."""
    out: dict = {}
    for (module, name), (kind, contracted) in LINEAR_WEIGHTS.items():
        if kind in kinds and name in blocks.get(module, {}):
            w_axes = axes[module][name]
            stacked = sum(a in ("layers", "sublayers") for a in w_axes)
            p = prequantize(blocks[module][name], stacked, contracted, dtype, w_axes)
            p = PrequantizedFp32Grad(*p) if fp32_grads else p
            if unrolled:  # q_t also in q, k and v's slices (`_pieces`): each the forward GEMM's own array
                q_t = None if p.q_t is None else _pieces(p.q_t, _transposed_axes(w_axes, contracted),
                                                         "qkv" in w_axes and _slices_apart())
                p = p._replace(q=tuple(p.q), q_t=q_t)
            out.setdefault(module, {})[name] = p
    return out


def _transposed_axes(axes: tuple, contracted: int) -> tuple:
    """A stacked weight's logical axes -> its `Prequantized.q_t`'s: the contracted ones moved last."""
    stacked = sum(a in ("layers", "sublayers") for a in axes)
    return axes[:stacked] + axes[stacked + contracted:] + axes[stacked:stacked + contracted]


def precast_weights(blocks: dict, axes: dict, skip: frozenset[str], dtype: jnp.dtype, *, unrolled: bool,
                    fp32_grads: bool = False) -> dict:
    """{module: {name: Precast}} for the block linears of `blocks` whose kind is not in `skip` (the
    fp8 ones, which `prequantize_weights` copies): each weight cast to the compute dtype once per
    optimizer step, before the micro-batch loop, instead of in every micro-batch (gpt2-1.3b's 16
    micro-batches on one H100 each cast and sliced all 24 layers' fp32 weights: 44.6 ms a step
    predicted). Where the layers are unrolled, per-layer tuples, as `prequantize_weights` keeps them,
    and q, k and v's slices of each layer's (`_pieces`): each is its GEMM's own array then, where a
    slice taken in the loop was copied every micro-batch (gpt2-1.3b: 12 ms a step predicted).
    fp32_grads: `PrecastFp32Grad`s, whose gradient GEMMs write fp32 (where the train step sums them
    in the GEMM, jaxgpt.config.weight_grads_summed_in_gemm)."""
    out: dict = {}
    for (module, name), (kind, _) in LINEAR_WEIGHTS.items():
        if kind not in skip and name in blocks.get(module, {}):
            w_axes = axes[module][name]
            c = shard(blocks[module][name].astype(dtype), *w_axes)
            out.setdefault(module, {})[name] = (PrecastFp32Grad if fp32_grads else Precast)(
                None, _pieces(c, w_axes, "qkv" in w_axes and _slices_apart()) if unrolled else c)
    return out


def copies_once_per_step(blocks: dict, axes: dict, fp8_kinds: frozenset[str], dtype: jnp.dtype, *,
                         unrolled: bool, fp32_grads: bool = False) -> dict:
    """Every block linear's copy that the train step makes once per optimizer step, before its
    micro-batch loop (jaxgpt.config.weights_once_per_step): the fp8 kinds' e4m3 copies
    (`prequantize_weights`), the others cast to the compute dtype (`precast_weights`; none where
    that is the parameters' fp32). `with_prequantized` puts them in the params."""
    out = precast_weights(blocks, axes, fp8_kinds, dtype, unrolled=unrolled, fp32_grads=fp32_grads) \
        if dtype != jnp.float32 else {}
    for module, weights in prequantize_weights(blocks, axes, fp8_kinds, dtype, unrolled=unrolled,
                                               fp32_grads=fp32_grads).items():
        out[module] = {**out.get(module, {}), **weights}
    return out


def with_prequantized(params: dict, prequantized: dict | None, axes: dict | None) -> dict:
    """params with the weights `copies_once_per_step` made copies of replaced by those copies
    (stacked again where they came per layer), each around the weight in `params` itself: the
    gradient is taken w.r.t. that one. `axes`: the logical axes of params['blocks']."""
    if not prequantized:
        return params
    blocks = dict(params["blocks"])
    for module, weights in prequantized.items():
        blocks[module] = {**blocks[module], **{name: _around(p, blocks[module][name], axes[module][name],
                                                             LINEAR_WEIGHTS[module, name][1])
                                               for name, p in weights.items()}}
    return {**params, "blocks": blocks}


def _around(p: Prequantized | Precast, w: jax.Array, axes: tuple, contracted: int) -> Prequantized | Precast:
    if isinstance(p, Precast):
        return p._replace(w=w, c=_joined(p.c, axes) if isinstance(p.c, tuple) else p.c)
    if not isinstance(p.q, tuple):
        return p._replace(w=w)
    q_t = None if p.q_t is None else _joined(p.q_t, _transposed_axes(axes, contracted))
    return p._replace(w=w, q=jnp.stack(p.q), q_t=q_t)


@jax.custom_vjp
def fence(x: jax.Array) -> jax.Array:
    """x behind an optimization barrier in the forward pass only (`jax.lax.optimization_barrier`'s own
    transpose puts one on the gradient too): x stays an array of its own, which XLA neither fuses
    into its consumers nor recomputes there."""
    return jax.lax.optimization_barrier(x)


def _fence_fwd(x):
    return fence(x), None


def _fence_bwd(_, g):
    return (g,)


fence.defvjp(_fence_fwd, _fence_bwd)


@jax.custom_vjp
def fence_gradient(x: jax.Array) -> jax.Array:
    """x, whose gradient passes an optimization barrier (`fence`'s counterpart in the backward
    pass): the kernel that writes the gradient takes none of its consumers' work."""
    return x


def _fence_gradient_fwd(x):
    return x, None


def _fence_gradient_bwd(_, g):
    return (jax.lax.optimization_barrier(g),)


fence_gradient.defvjp(_fence_gradient_fwd, _fence_gradient_bwd)


def add_bias(y: jax.Array, bias: nnx.Param | jax.Array | None) -> jax.Array:
    """y + bias in y's dtype; y itself where the layer has no bias (model.bias=false)."""
    return y if bias is None else y + bias[...].astype(y.dtype)


class FromNorm(NamedTuple):
    """What the linear layers that read a norm's output take from the norm besides it
    (`Norm.routed`): nothing by default."""
    bias: jax.Array | None = None  # its bias, which they pass the gradient to (`passes_input_bias_grad`)
    amax: jax.Array | None = None  # a bound on max |output| for their fp8 cast (norm.py `normalize_with_amax`)


class Norm(nnx.Module):
    """LayerNorm (GPT-2) or RMSNorm over the last axis, in fp32, eps model.norm_eps. A learned scale unless
    model.norm_scale=false; a bias for LayerNorm with model.bias. `axis` names the normalised
    dimension ('embed', or 'head_dim' for qk-norm, which is always RMS). `feeds`: the linear kind
    its output goes to ('qkv', 'mlp_in'): the forward keeps each row's statistics for the backward
    (norm.py) where that GEMM is in fp8 or fsdp splits it (`gemm_epilogues`), and `routed` decides
    from it what the norm hands that GEMM. `after`: the residual projection's kind before it
    ('attn_out', 'mlp_out'), whose bias's gradient sum `_fenced` keeps out of this norm's
    backward where it does not route."""

    def __init__(self, cfg: ModelConfig, d: int, rngs: nnx.Rngs, axis: str = "embed", rms: bool | None = None,
                 feeds: str | None = None, after: str | None = None):
        self.rms = cfg.norm == "rmsnorm" if rms is None else rms
        self.eps = cfg.norm_eps
        self.scale = param(rngs, (d,), (axis,), 0) if cfg.norm_scale else None
        self.bias = param(rngs, (d,), (axis,), None) if cfg.bias and not self.rms else None
        self.flatten = axis == "embed"
        self.feeds_fp8 = feeds in cfg.fp8_linears()
        self.routes_bias = feeds is not None and self.bias is not None
        self.after_fp8 = None if after is None or not cfg.bias else after in cfg.fp8_linears()

    def routed(self, x_BTD: jax.Array) -> tuple[jax.Array, FromNorm]:
        """(the norm of x, `FromNorm`). Before an fp8 GEMM: with a bound on the output's max |y|
        for its cast (norm.py `normalize_with_amax`, from the statistics' pass). Otherwise with
        its bias, where it routes it: the caller's linears that read the
        norm take its gradient (`passes_input_bias_grad`: each linear's bias gradient times its
        weight), and the backward here sums the scale's gradient alone over its [rows, D]
        gradient: that leaves room in its dx pass for the column sum of the residual branch's
        bias gradient, a pass of its own before (XLA:GPU fuses at most two column sums into one
        pass). Every linear the norm feeds must then have a bias (model.bias gives the norm and
        the linears theirs alike) or one that provably gets no gradient (attention's k, `_qkv`).
        Only where `gemm_epilogues` (fp8's backward sums its biases in the kernel that takes the
        gradient's amax; fsdp's bias sums are reductions across devices) and not before an MoE."""
        if self.feeds_fp8 and self.flatten:
            x = self._fenced(x_BTD)
            y, amax = normalize_with_amax(x.reshape(-1, x.shape[-1]), *self._params(), self.rms, self.eps)
            return y.reshape(x_BTD.shape), FromNorm(amax=amax)
        if not self.routes():
            return self(x_BTD), FromNorm()
        return self._normalize(x_BTD, jax.lax.stop_gradient(self.bias[...])), FromNorm(bias=self.bias[...])

    def _params(self) -> tuple[jax.Array | None, jax.Array | None]:
        """(scale, bias): each parameter's value, or None where the norm has none."""
        return tuple(None if p is None else p[...] for p in (self.scale, self.bias))

    def _fenced(self, x_BTD: jax.Array) -> jax.Array:
        """x, whose gradient passes a barrier (`fence_gradient`) where this norm does not route its
        bias's gradient but the residual branch before it (`after`) has its bias in its GEMM's
        epilogue (`project_out`): that bias's gradient sum then stays out of this norm's dx pass,
        which already takes two column sums (three do not fit: XLA:GPU took one of them out into
        a pass that read x and g again; after the last block, ln_f wrote its dx in fp32 for the
        sum's pass to read). After a routing norm's dx pass the sum goes in the pass itself."""
        fenced = self.after_fp8 is not None and gemm_epilogues(self.after_fp8) and not self.routes()
        return fence_gradient(x_BTD) if fenced else x_BTD

    def routes(self) -> bool:
        """Whether `routed` routes the bias's gradient (inside jit: fsdp is the mesh's)."""
        return self.routes_bias and gemm_epilogues(self.feeds_fp8)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        return self._normalize(self._fenced(x_BTD), self._params()[1])

    def _normalize(self, x_BTD: jax.Array, bias: jax.Array | None) -> jax.Array:
        # [B, T, D] is normalised as [B*T, D] (B and T are one axis to the layout: T is never split).
        # Over [B, T, D] the backward pass sums the scale's and bias's gradients over two axes, and
        # XLA:GPU laid that out by transposing the activations to [T, D, B] and back, fp32, in every
        # block: gpt2-124m on one H100, predicted 1,309 -> 1,209 ms a step (jaxgpt.plan --target h100).
        # The backward pass is norm.py's own (bf16 in and out, no fp32 [N, D] temporary).
        x = x_BTD.reshape(-1, x_BTD.shape[-1]) if self.flatten else x_BTD
        keep_stats = not gemm_epilogues(self.feeds_fp8)
        return normalize(x, self._params()[0], bias, self.rms, keep_stats, self.eps).reshape(x_BTD.shape)


class MLP(nnx.Module):
    """model.mlp: gelu or relu2 (in, out), or swiglu (in, gate, out: three GEMMs, the gate's named mlp_gate)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.n_embd, cfg.mlp_width
        self.c_fc_kernel = param(rngs, (D, F), ("embed", "mlp"), STD)
        self.c_fc_bias = param(rngs, (F,), ("mlp",), None) if cfg.bias else None
        if cfg.mlp == "swiglu":
            self.c_gate_kernel = param(rngs, (D, F), ("embed", "mlp"), STD)
            self.c_gate_bias = param(rngs, (F,), ("mlp",), None) if cfg.bias else None
        self.c_proj_kernel = param(rngs, (F, D), ("mlp", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = param(rngs, (D,), ("embed",), None) if cfg.bias else None
        self.kind, self.fp8 = cfg.mlp, cfg.fp8_linears()  # the kinds in fp8 (model.fp8)

    def __call__(self, x_BTD: jax.Array, norm: FromNorm = FromNorm()) -> jax.Array:
        """norm: what the norm before gives besides x (`Norm.routed`): its bias, which x holds and
        whose gradient the in (and gate) layers' biases pass on, and a bound on max |x| for their
        fp8 cast."""
        def bias(b: nnx.Param | None, kernel: nnx.Param) -> jax.Array | None:
            if b is None or norm.bias is None:
                return b
            return passes_input_bias_grad(b[...], norm.bias, weight_as_read(kernel.get_value(), x_BTD.dtype), 1)

        def linear(kind: str, kernel: nnx.Param, b: nnx.Param | None, amax: jax.Array | None) -> jax.Array:
            # in fp8 the bias goes in cuBLASLt's epilogue (fp8.py `_pre_forward`); in bf16 the
            # activation's kernel adds it (where the GEMM's epilogue would write h in fp32 first)
            if kind in self.fp8:
                return dense(kind, "btd,df->btf", x_BTD, kernel, True, amax, bias=bias(b, kernel))
            return add_bias(dense(kind, "btd,df->btf", x_BTD, kernel, False), bias(b, kernel))

        h_BTF = linear("mlp_in", self.c_fc_kernel, self.c_fc_bias, norm.amax)
        gate_BTF = None
        if self.kind == "swiglu":
            # under fsdp the gate's own copy of the norm's bound, after the in GEMM (a barrier): with
            # the same one XLA:GPU merged the two fp8 GEMMs (which read the gathered weights) into
            # one whose output it then split. Elsewhere they stay two GEMMs on one cast of x (the
            # barrier made it two: the llama-8b slice in fp8 on one H100, 5,679.8 -> 5,690.1 ms)
            amax = norm.amax
            if amax is not None and not _slices_apart():
                amax = jax.lax.optimization_barrier((amax, h_BTF))[0]
            gate_BTF = linear("mlp_gate", self.c_gate_kernel, self.c_gate_bias, amax)
        # fp8: the activation's amax bounded from h (activation_amax), so its e4m3 cast computes the
        # activation from h itself and no kernel writes the activation in bf16
        amax = activation_amax(self.kind, h_BTF) if "mlp_out" in self.fp8 else None
        keep = gemm_epilogues("mlp_out" in self.fp8)  # the out GEMM's epilogue takes gelu's backward
        if "mlp_in" in self.fp8 and not keep and self.c_fc_bias is not None:
            # the activation's backward writes dh in bf16 for the fp8 GEMM's cast and bias sum to
            # read (the pin `fp8.quantize` gives the cast alone): reading the unpinned dh, the sum
            # made XLA:GPU write it in fp32 (gpt2-124m fp8 on one H100, 900.6 against 945.0 ms a
            # step predicted). Not where the out GEMM's epilogue writes dh (`keep`), where the
            # fence split the kernel that sums it from the one that writes it (954.0 against 969.0)
            h_BTF = fence_gradient(h_BTF)
        h_BTF = shard(activate(self.kind, h_BTF, gate_BTF, keep_derivative=keep), "batch", "seq", "act_mlp")
        return project_out("mlp_out", "btf,fd->btd", h_BTF, self.c_proj_kernel, "mlp_out" in self.fp8, self.c_proj_bias,
                           amax)


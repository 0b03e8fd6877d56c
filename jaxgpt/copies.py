"""The weights' copies the train step makes once per optimizer step, before its micro-batch loop
(tricks `precast`, `prequantize`, `tables_in_compute_dtype` of the lowering, jaxgpt/lowering/),
and the per-GEMM pieces it sums their gradients in (`grads_in_gemm`). jaxgpt/step.py calls these;
the lowering's ops read the copies (jaxgpt/lowering/linear.py `dense`, ops.py `Lowering.lookup`).

    precast      each weight cast to the compute dtype once a step, not once a micro-batch
    prequantize  each fp8 weight's e4m3 copies (the weight's layout for the dx GEMM, the forward's
                 contracted axes last for the forward GEMM), one kernel per weight a step
    fp8_pieces   with the layers unrolled, each layer's e4m3 copy (and with q, k and v as GEMMs of
                 their own, each slice's) an array of its own, which XLA folds back into the loop's
                 reads; scanned layers slice the stack themselves (the bf16 copies go per layer)
    grads_in_gemm  with micro-batches and unrolled layers, each weight gradient's GEMM writes fp32
                 and the step sums the pieces over micro-batches, so XLA:GPU takes each sum into
                 the GEMM (acc + x^T dy)

The block weights' copies only for a dense model without a pipeline (a pipeline gathers its stage
weights itself, and the experts cast theirs); the tables' under fsdp, for any model.
docs/ops.md has each one's predicted gain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgpt.lowering.fp8 import Prequantized, PrequantizedFp32Grad, prequantize
from jaxgpt.lowering.linear import Precast, PrecastFp32Grad
from jaxgpt.parallel.mesh import shard

# A dense model's block linears: where each weight sits in its params['blocks'] dict, its kind
# (model.fp8) and how many of its leading axes the forward GEMM contracts.
LINEAR_WEIGHTS = {("attn", "c_attn_kernel"): ("qkv", 1), ("attn", "q_kernel"): ("qkv", 1),
                  ("attn", "kv_kernel"): ("qkv", 1), ("attn", "c_proj_kernel"): ("attn_out", 2),
                  ("mlp", "c_fc_kernel"): ("mlp_in", 1), ("mlp", "c_gate_kernel"): ("mlp_gate", 1),
                  ("mlp", "c_proj_kernel"): ("mlp_out", 1)}


def copies_once_per_step(blocks: dict, axes: dict, ops, dtype: jnp.dtype, fp32_grads: bool = False) -> dict:
    """{module: {name: copy}} of a dense model's stacked block weights (params['blocks']; `axes`
    their logical axes, 'layers' first) for the lowering `ops`: the fp8 kinds' e4m3 copies
    (`Prequantized`), the others cast to `dtype` (`Precast`; none where that is the parameters'
    fp32). fp32_grads: the *Fp32Grad forms (`ops.grads_in_gemm`). `with_copies` puts them in."""
    unrolled = not ops.cfg.scan_layers
    out: dict = {}
    for (module, name), (kind, contracted) in LINEAR_WEIGHTS.items():
        if name not in blocks.get(module, {}):
            continue
        w, w_axes = blocks[module][name], axes[module][name]
        split = "qkv" in w_axes and ops.qkv_apart  # each slice its own GEMM's operand
        if kind in ops.fp8 and ops.on("prequantize"):
            stacked = sum(a in ("layers", "sublayers") for a in w_axes)
            p = prequantize(w, stacked, contracted, dtype, w_axes, ops.fsdp)
            p = PrequantizedFp32Grad(*p) if fp32_grads else p
            if unrolled and ops.on("fp8_pieces"):
                q_t = None if p.q_t is None else _pieces(p.q_t, _transposed_axes(w_axes, contracted), split)
                p = p._replace(q=tuple(p.q), q_t=q_t)
        elif kind not in ops.fp8 and ops.on("precast") and dtype != jnp.float32:
            c = shard(w.astype(dtype), *w_axes)
            c = _pieces(c, w_axes, False) if unrolled else c
            p = (PrecastFp32Grad if fp32_grads else Precast)(None, c)
        else:
            continue
        out.setdefault(module, {})[name] = p
    return out


def table_copies(params: dict, ops, dtype: jnp.dtype) -> dict:
    """{name: Precast} of the embedding and head tables (wte, wpe, lm_head), cast to `dtype` where each
    shard lives and then gathered whole along D, once per step (trick tables_in_compute_dtype):
    under fsdp the lookups and the loss read one gather of dtype's bytes a step, where each read
    the fp32 table's. The gradient stays the fp32 parameter's (`Lowering.lookup`, loss.py)."""
    if not (ops.on("tables_in_compute_dtype") and ops.fsdp and dtype != jnp.float32):
        return {}
    axes = {"wte": ("vocab", ops.table_axes), "lm_head": ("vocab", ops.table_axes), "wpe": ("pos", (None, None))}
    return {name: Precast(None, shard(shard(params[name].astype(dtype), first, "embed"), *read))
            for name, (first, read) in axes.items() if name in params}


def with_copies(params: dict, copies: dict | None, axes: dict | None, tables: dict | None = None) -> dict:
    """params with the weights `copies_once_per_step` (and `table_copies`: tables) made copies of
    replaced by those copies (stacked again where they came per layer), each around the weight in
    `params` itself: the gradient is taken w.r.t. that one. `axes`: the logical axes of
    params['blocks']."""
    params = {**params, **{name: c._replace(w=params[name]) for name, c in (tables or {}).items()}}
    if not copies:
        return params
    blocks = dict(params["blocks"])
    for module, weights in copies.items():
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


def _transposed_axes(axes: tuple, contracted: int) -> tuple:
    """A stacked weight's logical axes -> its `Prequantized.q_t`'s: the contracted ones moved last."""
    stacked = sum(a in ("layers", "sublayers") for a in axes)
    return axes[:stacked] + axes[stacked + contracted:] + axes[stacked:stacked + contracted]


def _pieces(stacked: jax.Array, axes: tuple, parts: bool) -> tuple:
    """A stacked block weight [L, ...] (or its gradient or copy; `axes` its logical axes) as a
    tuple of its L layers, each a tuple of its slices along 'qkv' where `parts`."""
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


def gemm_pieces(grads: dict, copies: dict, axes: dict, qkv_apart: bool) -> dict:
    """A dense model's block gradients as their GEMMs write them, where they write them in fp32
    (the weight's copy a *Fp32Grad; `_pieces`; q, k and v's apart where `qkv_apart`): the train
    step sums these pieces over micro-batches, so that XLA:GPU takes each sum into the GEMM that
    writes the piece. The other gradients as they are. `axes`: the blocks' logical axes."""
    def pieces(module: str, name: str, g):
        copy = copies.get(module, {}).get(name)
        if not isinstance(copy, PrecastFp32Grad | PrequantizedFp32Grad):
            return g
        w_axes = axes[module][name]
        return _pieces(g, w_axes, isinstance(copy, PrecastFp32Grad) and "qkv" in w_axes and qkv_apart)
    return {module: {name: pieces(module, name, g) for name, g in weights.items()} for module, weights in grads.items()}


def from_gemm_pieces(grads: dict, axes: dict) -> dict:
    """`gemm_pieces`' inverse: the stacked gradients again."""
    return {module: {name: _joined(g, axes[module][name]) if isinstance(g, tuple) else g for name, g in weights.items()}
            for module, weights in grads.items()}

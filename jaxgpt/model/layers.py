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
from jaxgpt.model.fp8 import Prequantized, PrequantizedFp32Grad, einsum_operands, linear, planned_dot, prequantize
from jaxgpt.model.norm import normalize
from jaxgpt.parallel.mesh import shard

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _precast_einsum(spec: str, w_dtype: jnp.dtype, x: jax.Array, w: jax.Array, c: jax.Array) -> jax.Array:
    """einsum(spec, x, c), c being w cast to the compute dtype once per step (`Precast`); the
    gradient goes to w, the parameter, in its own dtype.

    The weight gradient's GEMM writes it in fp32, its accumulator's precision, where autodiff of
    x @ c (`_read_copy`) rounds it to the compute dtype first: XLA:GPU then takes the train step's
    sum over micro-batches into that GEMM (acc + x^T dy; jaxgpt/step.py sums these per layer)
    instead of adding the bf16 gradient to the fp32 sum in a pass of its own. Only there: a
    gradient that leaves the GEMM for a stack (scanned layers) or a reduce-scatter (fsdp) would
    move twice the bytes (jaxgpt.config.weight_grads_summed_in_gemm)."""
    return jnp.einsum(spec, x, c)


def _precast_fwd(spec, w_dtype, x, w, c):
    return jnp.einsum(spec, x, c), (x, c)


def _precast_bwd(spec, w_dtype, residuals, dy):
    x, c = residuals
    a, b, out = einsum_operands(spec)
    dx = planned_dot(f"{out},{b}->{a}", dy, c)  # jnp.einsum's own order transposed QKV's gradient (+60 ms)
    dw = planned_dot(f"{a},{out}->{b}", x, dy, jnp.float32)
    return dx, dw.astype(w_dtype), None


_precast_einsum.defvjp(_precast_fwd, _precast_bwd)


def dense(name: str, spec: str, x: jax.Array, kernel: nnx.Param, fp8: bool,
          x_amax: jax.Array | None = None) -> jax.Array:
    """`fp8.linear` on a weight parameter, cast to x's dtype; its logical axes go along so that
    under fp8 its e4m3 copy keeps the parameter's sharding (fsdp then gathers 1 byte an element).
    The parameter may hold the weight's `Prequantized` copies instead (`prequantize_weights`), or
    its `Precast` copy in the compute dtype (`precast_weights`)."""
    w = kernel.get_value()
    if isinstance(w, PrecastFp32Grad):  # a kind not in fp8 (copies_once_per_step)
        with jax.named_scope(name):
            return _precast_einsum(spec, jnp.dtype(w.w.dtype), x, w.w, w.c)
    if isinstance(w, Precast):
        w = _read_copy(jnp.dtype(w.w.dtype), w.w, w.c)
    return linear(name, spec, x, w, fp8, kernel.logical_axes, x_amax)


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
            out.setdefault(module, {})[name] = p._replace(q=tuple(p.q), q_t=_layers(p.q_t)) if unrolled else p
    return out


def precast_weights(blocks: dict, axes: dict, skip: frozenset[str], dtype: jnp.dtype, *, unrolled: bool,
                    fp32_grads: bool = False) -> dict:
    """{module: {name: Precast}} for the block linears of `blocks` whose kind is not in `skip` (the
    fp8 ones, which `prequantize_weights` copies): each weight cast to the compute dtype once per
    optimizer step, before the micro-batch loop, instead of in every micro-batch (gpt2-1.3b's 16
    micro-batches on one H100 each cast and sliced all 24 layers' fp32 weights: 44.6 ms a step
    predicted). Per-layer tuples where the layers are unrolled, as `prequantize_weights` keeps them.
    fp32_grads: `PrecastFp32Grad`s, whose gradient GEMMs write fp32 (where the train step sums them
    in the GEMM, jaxgpt.config.weight_grads_summed_in_gemm)."""
    out: dict = {}
    for (module, name), (kind, _) in LINEAR_WEIGHTS.items():
        if kind not in skip and name in blocks.get(module, {}):
            c = shard(blocks[module][name].astype(dtype), *axes[module][name])
            out.setdefault(module, {})[name] = (PrecastFp32Grad if fp32_grads else Precast)(
                None, tuple(c) if unrolled else c)
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


def _layers(x: jax.Array | None) -> tuple | None:
    return None if x is None else tuple(x)


def _stacked(x: tuple | None) -> jax.Array | None:
    return None if x is None else jnp.stack(x)


def with_prequantized(params: dict, prequantized: dict | None) -> dict:
    """params with the weights `copies_once_per_step` made copies of replaced by those copies
    (stacked again where they came per layer), each around the weight in `params` itself: the
    gradient is taken w.r.t. that one."""
    if not prequantized:
        return params
    blocks = dict(params["blocks"])
    for module, weights in prequantized.items():
        blocks[module] = {**blocks[module], **{name: _around(p, blocks[module][name]) for name, p in weights.items()}}
    return {**params, "blocks": blocks}


def _around(p: Prequantized | Precast, w: jax.Array) -> Prequantized | Precast:
    if isinstance(p, Precast):
        return p._replace(w=w, c=jnp.stack(p.c) if isinstance(p.c, tuple) else p.c)
    return p._replace(w=w, **({"q": jnp.stack(p.q), "q_t": _stacked(p.q_t)} if isinstance(p.q, tuple) else {}))


def add_bias(y: jax.Array, bias: nnx.Param | None) -> jax.Array:
    """y + bias in y's dtype; y itself where the layer has no bias (model.bias=false)."""
    return y if bias is None else y + bias[...].astype(y.dtype)


class Norm(nnx.Module):
    """LayerNorm (GPT-2) or RMSNorm over the last axis, in fp32, eps 1e-5. A learned scale unless
    model.norm_scale=false; a bias for LayerNorm with model.bias. `axis` names the normalised
    dimension ('embed', or 'head_dim' for qk-norm, which is always RMS)."""

    def __init__(self, cfg: ModelConfig, d: int, rngs: nnx.Rngs, axis: str = "embed", rms: bool | None = None):
        self.rms = cfg.norm == "rmsnorm" if rms is None else rms
        self.scale = param(rngs, (d,), (axis,), 0) if cfg.norm_scale else None
        self.bias = param(rngs, (d,), (axis,), None) if cfg.bias and not self.rms else None
        self.flatten = axis == "embed"

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        # [B, T, D] is normalised as [B*T, D] (B and T are one axis to the layout: T is never split).
        # Over [B, T, D] the backward pass sums the scale's and bias's gradients over two axes, and
        # XLA:GPU laid that out by transposing the activations to [T, D, B] and back, fp32, in every
        # block: gpt2-124m on one H100, predicted 1,309 -> 1,209 ms a step (jaxgpt.plan --target h100).
        # The backward pass is norm.py's own (bf16 in and out, no fp32 [N, D] temporary).
        x = x_BTD.reshape(-1, x_BTD.shape[-1]) if self.flatten else x_BTD
        value = lambda p: None if p is None else p[...]  # noqa: E731
        return normalize(x, value(self.scale), value(self.bias), self.rms).reshape(x_BTD.shape)


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

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        h_BTF = add_bias(dense("mlp_in", "btd,df->btf", x_BTD, self.c_fc_kernel, "mlp_in" in self.fp8), self.c_fc_bias)
        gate_BTF = None
        if self.kind == "swiglu":
            gate_BTF = add_bias(dense("mlp_gate", "btd,df->btf", x_BTD, self.c_gate_kernel, "mlp_gate" in self.fp8),
                             self.c_gate_bias)
        # fp8: the activation's amax bounded from h (activation_amax), so its e4m3 cast computes the
        # activation from h itself and no kernel writes the activation in bf16
        amax = activation_amax(self.kind, h_BTF) if "mlp_out" in self.fp8 else None
        h_BTF = shard(activate(self.kind, h_BTF, gate_BTF), "batch", "seq", "act_mlp")
        return add_bias(dense("mlp_out", "btf,fd->btd", h_BTF, self.c_proj_kernel, "mlp_out" in self.fp8, amax),
                     self.c_proj_bias)

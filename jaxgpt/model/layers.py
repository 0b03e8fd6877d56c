"""The small pieces every block is built from: parameters with logical axes, norms and the dense MLP.

Precision. Parameters are fp32; matmuls run in the compute dtype (bf16 on a GPU); norms compute in
fp32 and return their input's dtype (model/ops.py). Initialisation follows GPT-2: normal(0.02) for
weights and embeddings, zero biases, unit norm scales (the residual projections' smaller std is
chosen by their layers).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgpt.config import ModelConfig
from jaxgpt.model.ops import Ops
from jaxgpt.parallel.mesh import shard

STD = 0.02


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float | None) -> nnx.Param:
    """A parameter with its logical axes; std=None -> zeros, std=0 -> ones (a norm's scale)."""
    if std is None:
        value = jnp.zeros(shape, jnp.float32)
    elif std == 0:
        value = jnp.ones(shape, jnp.float32)
    else:
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, logical_axes=axes)


def value(p: nnx.Param | None) -> jax.Array | None:
    """A parameter's value, or None where the layer has none."""
    return None if p is None else p[...]


class Norm(nnx.Module):
    """LayerNorm (GPT-2) or RMSNorm over the last axis, eps model.norm_eps: a learned scale unless
    model.norm_scale=false, a bias for LayerNorm with model.bias. `axis` names the normalised
    dimension ('embed', or 'head_dim' for qk-norm, always RMS); `before`, what reads the output
    ('attn', 'mlp', 'moe', 'head', 'scores'), is for the lowering (model/ops.py)."""

    def __init__(self, cfg: ModelConfig, d: int, rngs: nnx.Rngs, ops: Ops, before: str, axis: str = "embed",
                 rms: bool | None = None):
        self.rms = cfg.norm == "rmsnorm" if rms is None else rms
        self.scale = param(rngs, (d,), (axis,), 0) if cfg.norm_scale else None
        self.bias = param(rngs, (d,), (axis,), None) if cfg.bias and not self.rms else None
        self.ops, self.before = ops, before

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.ops.norm(x, value(self.scale), value(self.bias), self.rms, self.before)


class MLP(nnx.Module):
    """model.mlp: act(x W_in + b_in) W_out + b_out with GELU or relu^2; SwiGLU's
    (silu(x W_gate + b_gate) * (x W_in + b_in)) W_out + b_out has a third matrix, the gate."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ops: Ops):
        D, F = cfg.n_embd, cfg.mlp_width
        self.c_fc_kernel = param(rngs, (D, F), ("embed", "mlp"), STD)
        self.c_fc_bias = param(rngs, (F,), ("mlp",), None) if cfg.bias else None
        if cfg.mlp == "swiglu":
            self.c_gate_kernel = param(rngs, (D, F), ("embed", "mlp"), STD)
            self.c_gate_bias = param(rngs, (F,), ("mlp",), None) if cfg.bias else None
        self.c_proj_kernel = param(rngs, (F, D), ("mlp", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = param(rngs, (D,), ("embed",), None) if cfg.bias else None
        self.kind, self.ops = cfg.mlp, ops

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        def linear(name: str, kernel: nnx.Param, bias: nnx.Param | None) -> jax.Array:
            return shard(self.ops.linear(name, "btd,df->btf", x_BTD, kernel, bias), "batch", "seq", "act_mlp")

        h_BTF = linear("mlp_in", self.c_fc_kernel, self.c_fc_bias)
        gate_BTF = linear("mlp_gate", self.c_gate_kernel, self.c_gate_bias) if self.kind == "swiglu" else None
        a_BTF = self.ops.activation(self.kind, h_BTF, gate_BTF)
        return self.ops.linear("mlp_out", "btf,fd->btd", a_BTF, self.c_proj_kernel, self.c_proj_bias)

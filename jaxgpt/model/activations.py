"""The dense MLP's nonlinearities (model.mlp) with backward passes that keep only the GEMM outputs.

    gelu    gelu_tanh(h)               keeps h            (moe.py's custom VJP, reused here)
    relu2   relu(h)^2                  keeps h            dh = 2 relu(h) g
    swiglu  silu(gate) h               keeps gate and h   dh = silu(gate) g
                                                          dgate = h g sig(gate) (1 + gate (1 - sig(gate)))

h and gate are [B, T, F] in the GEMM's output layout and dtype (bf16 on a GPU); the derivative is
formed in fp32 inside the elementwise pass that reads g, and rounded once. Autodiff's residuals
are relu(h) and the mask, or silu(gate), sigmoid(gate) and h; in the compiled H100 step XLA already
recomputes those inside the backward's fusions (a SwiGLU step moves the same bf16 [rows, F]
tensors with either backward; docs/benchmarks.md "Issue 40"), so here the saved set is stated
rather than left to fusion heuristics, as gelu_tanh's had to be. Values are autodiff's bit for bit;
gradients are checked against autodiff in tests/test_custom_vjps.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgpt.model.moe import gelu_tanh


def activate(kind: str, h: jax.Array, gate: jax.Array | None = None) -> jax.Array:
    """model.mlp's nonlinearity on h = x W_in (and gate = x W_gate for swiglu)."""
    if kind == "swiglu":
        return swiglu(gate, h)
    if kind == "relu2":
        return relu2(h)
    return gelu_tanh(h)


@jax.custom_vjp
def relu2(h: jax.Array) -> jax.Array:
    """relu(h)^2 (the modded-nanogpt MLP)."""
    return jnp.square(jax.nn.relu(h))


def _relu2_fwd(h):
    return relu2(h), h


def _relu2_bwd(h, g):
    x = h.astype(jnp.float32)
    return ((2 * jnp.maximum(x, 0) * g.astype(jnp.float32)).astype(g.dtype),)


relu2.defvjp(_relu2_fwd, _relu2_bwd)


@jax.custom_vjp
def swiglu(gate: jax.Array, h: jax.Array) -> jax.Array:
    """silu(gate) * h (Llama's gated MLP)."""
    return jax.nn.silu(gate) * h


def _swiglu_fwd(gate, h):
    return swiglu(gate, h), (gate, h)


def _swiglu_bwd(res, g):
    gate, h = res
    a, x, g32 = gate.astype(jnp.float32), h.astype(jnp.float32), g.astype(jnp.float32)
    sig = jax.nn.sigmoid(a)
    dh = g32 * a * sig
    dgate = g32 * x * sig * (1 + a * (1 - sig))
    return dgate.astype(gate.dtype), dh.astype(h.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)

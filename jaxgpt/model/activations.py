"""The dense MLP's nonlinearities (model.mlp) with backward passes that keep only the GEMM outputs.

    gelu    gelu_tanh(h)               keeps h            tanh recomputed where the derivative is formed
    relu2   relu(h)^2                  keeps h            dh = 2 relu(h) g
    swiglu  silu(gate) h               keeps gate and h   dh = silu(gate) g
                                                          dgate = h g sig(gate) (1 + gate (1 - sig(gate)))

Dense MLPs and experts (model/moe.py, dropless.py) both take them from here.
h and gate are [B, T, F] (an expert's [..., F]) in the GEMM's output layout and dtype (bf16 on a GPU); the derivative is
formed in fp32 inside the elementwise pass that reads g, and rounded once. Autodiff's residuals
are relu(h) and the mask, or silu(gate), sigmoid(gate) and h; in the compiled H100 step XLA already
recomputes those inside the backward's fusions (a SwiGLU step moves the same bf16 [rows, F]
tensors with either backward; docs/benchmarks.md "Issue 40"), so here the saved set is stated
rather than left to fusion heuristics, as gelu_tanh's had to be. Values are autodiff's bit for bit;
gradients are checked against autodiff in tests/test_custom_vjps.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def activate(kind: str, h: jax.Array, gate: jax.Array | None = None) -> jax.Array:
    """model.mlp's nonlinearity on h = x W_in (and gate = x W_gate for swiglu), dense or expert."""
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


@jax.custom_vjp
def gelu_tanh(h: jax.Array) -> jax.Array:
    """GPT-2's tanh-approximate GELU, 0.5 h (1 + tanh(c (h + 0.044715 h^3))), c = sqrt(2 / pi), with
    a backward pass that keeps only h and recomputes tanh where the derivative is formed. Autodiff
    kept tanh(...) as its own [B, T, F] tensor, written by one kernel and read by the next (6.4 GB
    a layer for gpt2-124m's 512-sequence micro-batch; jaxgpt.plan --target h100)."""
    return jax.nn.gelu(h, approximate=True)


def _gelu_tanh_fwd(h: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gelu_tanh(h), h


def _gelu_tanh_bwd(h: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    c, k = math.sqrt(2 / math.pi), 0.044715
    x = h.astype(jnp.float32)
    t = jnp.tanh(c * (x + k * x * x * x))
    dgelu = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x)
    return ((g.astype(jnp.float32) * dgelu).astype(g.dtype),)


gelu_tanh.defvjp(_gelu_tanh_fwd, _gelu_tanh_bwd)

"""model.mlp's nonlinearities with backward passes that keep only the GEMM outputs (trick
activation_vjps; the reference is autodiff of the formulas, jaxgpt/model/ops.py).

    gelu    gelu_tanh(h)               keeps h            tanh recomputed where the derivative is formed
            (gelu_derivative:          keeps gelu'(h)     dh = g gelu'(h), in the out GEMM's epilogue)
             gelu_tanh_keeping_derivative)
    relu2   relu(h)^2                  keeps h            dh = 2 relu(h) g
    swiglu  silu(gate) h               keeps gate and h   dh = silu(gate) g
                                                          dgate = h g sig(gate) (1 + gate (1 - sig(gate)))

h and gate are [B, T, F] (an expert's [..., F]) in the GEMM's output dtype; the derivative is
formed in fp32 inside the elementwise pass that reads g and rounded once. Autodiff kept tanh(...)
as a [B, T, F] tensor of its own, written by one kernel and read by the next; here the saved set is
stated rather than left to fusion heuristics. Values are autodiff's bit for bit (tests/test_ops.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def activate(kind: str, h: jax.Array, gate: jax.Array | None = None, keep_derivative: bool = False) -> jax.Array:
    """model.mlp's nonlinearity on h = x W_in (and gate = x W_gate for swiglu), dense or expert.
    keep_derivative: gelu keeps its derivative rather than h, in a low-precision compute dtype
    (`gelu_tanh_keeping_derivative`); the dense MLP asks where its out GEMM can take the product."""
    if kind == "swiglu":
        return swiglu(gate, h)
    if kind == "relu2":
        return relu2(h)
    if keep_derivative and jnp.dtype(h.dtype).itemsize < 4:
        return gelu_tanh_keeping_derivative(h)
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
    a backward pass that keeps only h and recomputes tanh where the derivative is formed."""
    return jax.nn.gelu(h, approximate=True)


def _gelu_tanh_fwd(h: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gelu_tanh(h), h


def _gelu_tanh_bwd(h: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return ((g.astype(jnp.float32) * _gelu_derivative(h.astype(jnp.float32))).astype(g.dtype),)


gelu_tanh.defvjp(_gelu_tanh_fwd, _gelu_tanh_bwd)


def _gelu_derivative(x: jax.Array) -> jax.Array:
    c, k = math.sqrt(2 / math.pi), 0.044715
    t = jnp.tanh(c * (x + k * x * x * x))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x)


@jax.custom_vjp
def gelu_tanh_keeping_derivative(h: jax.Array) -> jax.Array:
    """`gelu_tanh` whose forward writes gelu'(h), rounded to h's dtype, beside gelu(h), and whose
    backward is the product g gelu'(h) alone: in the compute dtype, with gelu'(h) an array of its
    own (an optimization barrier), so XLA:GPU takes it into the epilogue of the GEMM that writes g
    (the MLP out projection's dx) and no pass reads g and h again: the backward's [rows, F] pass
    (read h and g, write dh) becomes one more write in the forward. The price is one rounding more: dh = round(g round(gelu'(h)))
    where `gelu_tanh` gives round(g gelu'(h)), within two bf16 roundings of the fp32 product
    (tests/test_kernels.py). Values are jax.nn.gelu's bit for bit."""
    return jax.nn.gelu(h, approximate=True)


def _gelu_keep_fwd(h: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gelu_tanh_keeping_derivative(h), _gelu_derivative(h.astype(jnp.float32)).astype(h.dtype)


def _gelu_keep_bwd(d: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return (g * jax.lax.optimization_barrier(d),)


gelu_tanh_keeping_derivative.defvjp(_gelu_keep_fwd, _gelu_keep_bwd)


# The tanh-GELU's most negative value is -0.170041, at h = -0.7525; rounded up, it bounds |gelu(h)| for h < 0.
GELU_NEGATIVE_BOUND = 0.1701


def activation_amax(kind: str, h: jax.Array) -> jax.Array | None:
    """max |activate(kind, h)| from h's largest element alone (fp32), for the fp8 cast of the
    activation (fp8.py `quantize`'s amax; trick activation_amax); None for swiglu, a product of two tensors.

    gelu and relu2 increase with h >= 0, and below 0 gelu stays within GELU_NEGATIVE_BOUND and
    relu2 is 0: so max(act(max(h, 0)), that bound) is the amax itself whenever the largest value
    is positive and above the bound (every real MLP), and an upper bound otherwise. A reduction over
    h rather than over act(h) lets XLA compute the activation inside the fusion that casts it to
    e4m3: reducing act(h) made it write act(h) in bf16 for the reduction and the cast to read (XLA
    does not duplicate tanh into two kernels), one [rows, F] tensor written and read more per
    layer and micro-batch."""
    if kind == "swiglu":
        return None
    top = jnp.maximum(jnp.max(h).astype(jnp.float32), 0.0)
    if kind == "relu2":
        return jnp.square(top)
    return jnp.maximum(jax.nn.gelu(top, approximate=True), GELU_NEGATIVE_BOUND)

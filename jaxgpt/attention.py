"""Causal self-attention behind one function.

Every attention call in the model goes through `causal_attention`, so choosing a kernel is a
decision made here and nowhere else. Today the only kernel is XLA's (`jax.nn.dot_product_attention`
with implementation='xla'): it runs on every backend and computes the softmax in fp32 even for
bf16 inputs. The H100 path adds cuDNN flash attention behind the same signature.

Letters: B batch, T time (sequence), H heads, K head dim.
"""

from __future__ import annotations

import jax


def causal_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *, impl: str = "xla") -> jax.Array:
    """softmax(q k^T / sqrt(K) + causal mask) v, returning [B, T, H, K] in the inputs' dtype."""
    if impl != "xla":
        raise ValueError(f"unknown attention kernel {impl!r}")
    return jax.nn.dot_product_attention(q_BTHK, k_BTHK, v_BTHK, is_causal=True, implementation="xla")

"""Positions for model.position=rope: rotary embeddings of queries and keys (RoFormer; Llama).
(model.position=learned is GPT-2's `wpe` table, in gpt.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope(x_BTHK: jax.Array, pos: jax.Array | int, theta: float) -> jax.Array:
    """Rotary position embedding of queries or keys at positions pos, pos+1, ... (model.position=rope),
    or, for a [B, T] array `pos`, at those positions (model.position_reset: each token's place in its
    document).

    Feature pairs (i, i + K/2) of each head rotate by angle t * theta^(-2i/K): Hugging Face Llama's
    `rotate_half` layout, so its q/k weights load without a permutation. Angles and the rotation
    are fp32 (t up to seq_len times the fastest frequency needs the mantissa); the result is cast
    back. Keys are cached rotated, so a decoded token only rotates its own q and k."""
    T, K = x_BTHK.shape[1], x_BTHK.shape[-1]
    inv_freq_F = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    if jnp.ndim(pos) == 2:  # [B, T]
        at_BT = jnp.asarray(pos, jnp.float32)
    else:
        at_BT = (pos + jnp.arange(T, dtype=jnp.float32))[None, :]
    angle_BTF = at_BT[..., None] * inv_freq_F
    cos_BT1F, sin_BT1F = (f(angle_BTF)[:, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos_BT1F - x2 * sin_BT1F, x2 * cos_BT1F + x1 * sin_BT1F], axis=-1)
    return rotated.astype(x_BTHK.dtype)

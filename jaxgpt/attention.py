"""Causal self-attention behind one function, and the choice of kernel.

Every attention call in the model goes through `causal_attention`; which kernel runs is decided
once per run by `select_kernel` from `model.attention`:

    xla    `jax.nn.dot_product_attention(implementation='xla')`: runs everywhere; materialises the
           [B, H, T, T] scores (fp32 logits and softmax even for bf16 inputs).
    cudnn  cuDNN's fused flash attention (`implementation='cudnn'`): never materialises the
           scores, so memory is linear in T and it is several times faster on Hopper. It needs an
           NVIDIA GPU of compute capability >= 8.0, bf16 or fp16 inputs, and a head dim that is a
           multiple of 8 and at most 128.
    auto   cudnn where all of that holds, else xla; the reason is logged once at start-up.

Asking for `cudnn` where it cannot run is a `UserError` raised before compilation.

Grouped-query attention needs nothing here: k and v arrive with G <= H heads, query head h reading
kv head h // (H/G), and both kernels take them as they are (XLA's reshapes q to [B, T, G, H/G, K];
cuDNN takes fewer kv heads natively), so the repeated K/V are never materialised.

Letters: B batch, T time (sequence), H heads, G key/value heads, K head dim.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxgpt.errors import UserError
from jaxgpt.gpu.target import target_device
from jaxgpt.manual import per_shard

KERNELS = ("auto", "xla", "cudnn")


def cudnn_unavailable_reason(dtype: jnp.dtype, head_dim: int, device: jax.Device | None = None) -> str | None:
    """Why cuDNN flash attention cannot run here, or None if it can."""
    device = device or target_device()  # a compile-only GPU while compiling for one (jaxgpt.gpu)
    if device.platform != "gpu" or "NVIDIA" not in getattr(device, "device_kind", "NVIDIA"):
        return f"it needs an NVIDIA GPU (this is {device.platform})"
    capability = float(getattr(device, "compute_capability", "0") or 0)
    if capability < 8.0:
        return f"it needs compute capability >= 8.0 (this GPU has {capability})"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"it needs bf16 or fp16 compute (model.dtype gives {jnp.dtype(dtype).name})"
    if head_dim % 8 or head_dim > 128:
        return f"it needs a head dim that is a multiple of 8 and at most 128 (this model has {head_dim})"
    return None


def select_kernel(requested: str, dtype: jnp.dtype, head_dim: int) -> tuple[str, str]:
    """(kernel, why) for `model.attention`; raises UserError if cudnn is asked for and cannot run."""
    if requested == "xla":
        return "xla", "model.attention=xla"
    reason = cudnn_unavailable_reason(dtype, head_dim)
    if requested == "cudnn":
        if reason:
            raise UserError(f"model.attention=cudnn cannot run here: {reason}; use model.attention=auto or xla")
        return "cudnn", "model.attention=cudnn"
    if reason:
        return "xla", f"auto: cuDNN flash attention unavailable because {reason}"
    return "cudnn", "auto: NVIDIA GPU, bf16/fp16 and head dim fit cuDNN flash attention"


def causal_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *, impl: str = "xla") -> jax.Array:
    """softmax(q k^T / sqrt(K) + causal mask) v, returning [B, T, H, K] in the inputs' dtype."""
    if impl not in ("xla", "cudnn"):
        raise ValueError(f"unresolved attention kernel {impl!r}: call select_kernel first")
    attend = partial(jax.nn.dot_product_attention, is_causal=True, implementation=impl)
    if impl == "cudnn":  # each device attends over its own rows and heads (jaxgpt/manual.py: why)
        return per_shard(attend, ("batch", "seq", "act_heads", None), q_BTHK, k_BTHK, v_BTHK)
    return attend(q_BTHK, k_BTHK, v_BTHK)


def reference_attention(q_BTHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array) -> jax.Array:
    """The textbook formula in fp32, for tests; G < H kv heads are repeated to H."""
    repeat = q_BTHK.shape[2] // k_BTGK.shape[2]
    q, k, v = (jnp.repeat(x, h, axis=2).astype(jnp.float32)
               for x, h in ((q_BTHK, 1), (k_BTGK, repeat), (v_BTGK, repeat)))
    T, K = q.shape[1], q.shape[-1]
    scores_BHTT = jnp.einsum("bthk,bshk->bhts", q, k) / jnp.sqrt(K)
    scores_BHTT = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores_BHTT, -jnp.inf)
    return jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores_BHTT, axis=-1), v).astype(q_BTHK.dtype)


def rope(x_BTHK: jax.Array, pos: jax.Array | int, theta: float) -> jax.Array:
    """Rotary position embedding of queries or keys at positions pos, pos+1, ... (model.position=rope).

    Feature pairs (i, i + K/2) of each head rotate by angle t * theta^(-2i/K): Hugging Face Llama's
    `rotate_half` layout, so its q/k weights load without a permutation. Angles and the rotation
    are fp32 (t up to seq_len times the fastest frequency needs the mantissa); the result is cast
    back. Keys are cached rotated, so a decoded token only rotates its own q and k."""
    T, K = x_BTHK.shape[1], x_BTHK.shape[-1]
    inv_freq_F = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    angle_TF = (pos + jnp.arange(T, dtype=jnp.float32))[:, None] * inv_freq_F[None, :]
    cos_1T1F, sin_1T1F = (f(angle_TF)[None, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos_1T1F - x2 * sin_1T1F, x2 * cos_1T1F + x1 * sin_1T1F], axis=-1)
    return rotated.astype(x_BTHK.dtype)

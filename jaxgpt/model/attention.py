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

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.gpu.target import target_device
from jaxgpt.model.layers import STD, Norm, add_bias, compute_dtype, dense, param
from jaxgpt.model.positions import rope
from jaxgpt.parallel.manual import per_shard
from jaxgpt.parallel.mesh import shard

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
    if impl == "cudnn":  # each device attends over its own rows and heads (jaxgpt/parallel/manual.py: why)
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


class KV(NamedTuple):
    """One layer's cached keys and values, [B, S, G, K] (S = seq_len slots, G kv heads; RoPE applied)."""
    k: jax.Array
    v: jax.Array


class KVCache(NamedTuple):
    """Keys and values of every layer, [L, B, S, G, K], and the next position to write."""
    k: jax.Array
    v: jax.Array
    pos: jax.Array  # int32 scalar

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, dtype: jnp.dtype) -> KVCache:
        shape = (cfg.n_layer, batch, cfg.seq_len, cfg.kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        H, G, K, D = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.n_embd
        bias = cfg.bias
        if G == H:  # multi-head: GPT-2's fused kernel, its tree unchanged
            self.c_attn_kernel = param(rngs, (D, 3, H, K), ("embed", "qkv", "heads", "head_dim"), STD)
            self.c_attn_bias = param(rngs, (3, H, K), ("qkv", "heads", "head_dim"), None) if bias else None
        else:  # grouped-query: q of H heads, k and v of G; each tp shard holds whole groups
            self.q_kernel = param(rngs, (D, H, K), ("embed", "heads", "head_dim"), STD)
            self.q_bias = param(rngs, (H, K), ("heads", "head_dim"), None) if bias else None
            self.kv_kernel = param(rngs, (D, 2, G, K), ("embed", "qkv", "kv_heads", "head_dim"), STD)
            self.kv_bias = param(rngs, (2, G, K), ("qkv", "kv_heads", "head_dim"), None) if bias else None
        self.grouped = G != H
        if cfg.qk_norm:
            self.q_norm = Norm(cfg, K, rngs, axis="head_dim", rms=True)
            self.k_norm = Norm(cfg, K, rngs, axis="head_dim", rms=True)
        self.qk_norm = cfg.qk_norm
        self.rope_theta = cfg.rope_theta if cfg.position == "rope" else None
        self.c_proj_kernel = param(rngs, (H, K, D), ("heads", "head_dim", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = param(rngs, (D,), ("embed",), None) if bias else None
        self.impl, _ = select_kernel(cfg.attention, compute_dtype(cfg.dtype), cfg.head_dim)
        self.fp8 = cfg.fp8

    def _qkv(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, T, H, K], k and v [B, T, G, K]; one GEMM (multi-head) or two (grouped), all named qkv."""
        if not self.grouped:
            qkv_BT3HK = add_bias(dense("qkv", "btd,dshk->btshk", x_BTD, self.c_attn_kernel, self.fp8),
                              self.c_attn_bias)
            qkv_BT3HK = shard(qkv_BT3HK, "batch", "seq", None, "act_heads", None)
            return tuple(qkv_BT3HK[:, :, i] for i in range(3))
        q_BTHK = add_bias(dense("qkv", "btd,dhk->bthk", x_BTD, self.q_kernel, self.fp8), self.q_bias)
        kv_BT2GK = add_bias(dense("qkv", "btd,dsgk->btsgk", x_BTD, self.kv_kernel, self.fp8),
                         self.kv_bias)
        kv_BT2GK = shard(kv_BT2GK, "batch", "seq", None, "act_heads", None)
        return shard(q_BTHK, "batch", "seq", "act_heads", None), kv_BT2GK[:, :, 0], kv_BT2GK[:, :, 1]

    def __call__(self, x_BTD: jax.Array, kv: KV | None = None, pos: jax.Array | None = None):
        """Training: x -> y. Decoding (kv given): the T new positions start at `pos`; they attend
        to the cache [B, S, G, K] updated with their own keys/values; returns (y, new kv)."""
        dt = x_BTD.dtype
        q_BTHK, k_BTGK, v_BTGK = self._qkv(x_BTD)
        if self.qk_norm:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        if self.rope_theta is not None:
            start = 0 if kv is None else pos
            q_BTHK, k_BTGK = rope(q_BTHK, start, self.rope_theta), rope(k_BTGK, start, self.rope_theta)
        if kv is None:
            out_BTHK = causal_attention(q_BTHK, k_BTGK, v_BTGK, impl=self.impl)
        else:
            k_BSGK = jax.lax.dynamic_update_slice(kv.k, k_BTGK.astype(kv.k.dtype), (0, pos, 0, 0))
            v_BSGK = jax.lax.dynamic_update_slice(kv.v, v_BTGK.astype(kv.v.dtype), (0, pos, 0, 0))
            T, S = x_BTD.shape[1], k_BSGK.shape[1]
            visible_TS = jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None]  # causal, and unwritten slots hidden
            out_BTHK = jax.nn.dot_product_attention(q_BTHK, k_BSGK.astype(dt), v_BSGK.astype(dt),
                                                    mask=visible_TS[None, None], implementation="xla")
            kv = KV(k_BSGK, v_BSGK)
        y_BTD = dense("attn_out", "bthk,hkd->btd", out_BTHK, self.c_proj_kernel, self.fp8)
        y_BTD = add_bias(y_BTD, self.c_proj_bias)
        return y_BTD if kv is None else (y_BTD, kv)

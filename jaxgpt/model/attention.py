"""Causal self-attention: the layer, its KV cache.

    q, k, v = x W_qkv + b_qkv            (grouped-query: q = x W_q + b_q, k, v = x W_kv + b_kv)
    q, k = qk_norm(q), qk_norm(k)        (model.qk_norm)
    q, k = rope(q), rope(k)              (model.position=rope)
    y = attention(q, k, v) W_o + b_o     softmax(q k^T / sqrt(K) + causal mask) v per head

The attention itself is an op (model/ops.py): its kernel (XLA's, cuDNN's or tokamax's flash
attention, model.attention) and its layout under context parallelism are the lowering's
(jaxgpt/lowering/attention.py). Grouped-query attention needs nothing here: k and v arrive with
G <= H heads, query head h reading kv head h // (H/G), and every kernel takes them as they are.
Document masking (model.document_mask, jaxgpt/model/documents.py) reaches the op as each
position's document start.

Letters: B batch, T time (sequence), S cache slots, H heads, G key/value heads, K head dim.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgpt.config import ModelConfig
from jaxgpt.model.documents import Documents
from jaxgpt.model.layers import STD, Norm, param
from jaxgpt.model.ops import Ops
from jaxgpt.model.positions import rope


class KV(NamedTuple):
    """One layer's cached keys and values, [B, S, G, K] (S = seq_len slots, G kv heads; RoPE applied)."""
    k: jax.Array
    v: jax.Array


class KVCache(NamedTuple):
    """Keys and values of every layer, [L, B, S, G, K], the next position to write, and where each
    row's latest document starts (model.document_mask: its queries see no slot before it)."""
    k: jax.Array
    v: jax.Array
    pos: jax.Array  # int32 scalar
    doc_start: jax.Array  # int32 [B]

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, dtype: jnp.dtype) -> KVCache:
        shape = (cfg.n_layer, batch, cfg.seq_len, cfg.kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32),
                   jnp.zeros((batch,), jnp.int32))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ops: Ops):
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
            self.q_norm = Norm(cfg, K, rngs, ops, before="scores", axis="head_dim", rms=True)
            self.k_norm = Norm(cfg, K, rngs, ops, before="scores", axis="head_dim", rms=True)
        self.qk_norm = cfg.qk_norm
        self.rope_theta = cfg.rope_theta if cfg.position == "rope" else None
        self.c_proj_kernel = param(rngs, (H, K, D), ("heads", "head_dim", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = param(rngs, (D,), ("embed",), None) if bias else None
        self.position_reset, self.ops = cfg.position_reset, ops

    def qkv(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, T, H, K], k and v [B, T, G, K]: the fused weight's slices (multi-head: c_attn
        [D, 3, H, K]; grouped: q [D, H, K] and kv [D, 2, G, K])."""
        if not self.grouped:
            return self.ops.linear("qkv", "btd,dshk->btshk", x_BTD, self.c_attn_kernel, self.c_attn_bias,
                                   parts=("q", "k", "v"))
        q_BTHK = self.ops.linear("qkv", "btd,dhk->bthk", x_BTD, self.q_kernel, self.q_bias)
        k_BTGK, v_BTGK = self.ops.linear("qkv", "btd,dsgk->btsgk", x_BTD, self.kv_kernel, self.kv_bias,
                                         parts=("k", "v"))
        return q_BTHK, k_BTGK, v_BTGK

    def __call__(self, x_BTD: jax.Array, kv: KV | None = None, pos: jax.Array | None = None,
                 docs: Documents | None = None):
        """Training: x -> y. Decoding (kv given): the T new positions start at `pos`; they attend
        to the cache [B, S, G, K] updated with their own keys/values; returns (y, new kv).
        `docs` (model.document_mask): each position sees only its own document."""
        q_BTHK, k_BTGK, v_BTGK = self.qkv(x_BTD)
        if self.qk_norm:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        if self.rope_theta is not None:
            if docs is None:
                start = 0 if kv is None else pos
            else:  # each index's position: its place in its document, or in the window (in device order under cp)
                start = docs.position_BT if self.position_reset else docs.at_T[None, :]
            q_BTHK, k_BTGK = rope(q_BTHK, start, self.rope_theta), rope(k_BTGK, start, self.rope_theta)
        if kv is None:
            out_BTHK = self.ops.attention(q_BTHK, k_BTGK, v_BTGK, docs)
        else:
            out_BTHK, kv = self.ops.cached_attention(q_BTHK, k_BTGK, v_BTGK, kv, pos, docs)
        y_BTD = self.ops.linear("attn_out", "bthk,hkd->btd", out_BTHK, self.c_proj_kernel, self.c_proj_bias)
        return y_BTD if kv is None else (y_BTD, kv)

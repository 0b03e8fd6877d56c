"""Causal self-attention behind one function, and the choice of kernel.

Every attention call in the model goes through `causal_attention`; which kernel runs is decided
once per run by `select_kernel` from `model.attention`:

    xla    `jax.nn.dot_product_attention(implementation='xla')`: runs everywhere; materialises the
           [B, H, T, T] scores (fp32 logits and softmax even for bf16 inputs).
    cudnn  cuDNN's fused flash attention (`implementation='cudnn'`): never materialises the
           scores, so memory is linear in T and it is several times faster on Hopper. It needs an
           NVIDIA GPU of compute capability >= 8.0, bf16 or fp16 inputs, and a head dim that is a
           multiple of 8 and at most 128.
    mosaic tokamax's Pallas Mosaic GPU flash attention (jaxgpt/model/flash.py): FlashAttention-3's
           design on Hopper, written in JAX; an NVIDIA GPU of compute capability >= 8.0, bf16 or
           fp16, plain causal attention (no document_mask, no cp), no dp, ep or pp axis (fsdp and
           tp are fine), and tokamax installed. Not chosen by auto until a GPU measures it faster
           than cuDNN (scripts/attention_bench.py).
    auto   cudnn where all of that holds, else xla; the reason is logged once at start-up.

Asking for `cudnn` or `mosaic` where it cannot run is a `UserError` raised before compilation.

Document masking (model.document_mask, jaxgpt/model/documents.py) reaches both kernels as the
documents' start positions: XLA's takes a boolean [B, 1, T, T] mask beside `is_causal`; cuDNN's
takes each row's documents as its packed layout (`jax._src.cudnn.fused_attention_stablehlo`'s
q_offsets/kv_offsets and per-document lengths, mask type PADDING_CAUSAL), still a flash kernel
that never holds [T, T] scores. JAX's public `jax.nn.dot_product_attention` does not pass the
offsets on, so this calls the function behind it; its packed layout needs a Hopper GPU (compute
capability 9.0), which `cudnn_unavailable_reason` checks.

Context parallelism (the cp mesh axis, jaxgpt/parallel/context.py) splits the queries' positions
over devices in a balanced order that is not the window's, so neither kernel may use its built-in
causal mask there: `_context_parallel` masks by each index's true position (`Documents.at_T`). XLA's
kernel gets K and V gathered whole by a sharding constraint; cuDNN's runs per device on its own
queries against K and V gathered inside the per-device function (`_cudnn_context`, its mask the
kernel's bias operand).

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
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention  # packed layout: module docstring

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.gpu.target import target_device
from jaxgpt.model import flash
from jaxgpt.model.documents import Documents, packed_segments, visible
from jaxgpt.model.layers import (STD, FromNorm, Norm, compute_dtype, dense, gemm_epilogues, param,
                                 passes_input_bias_grad, project_out, weight_as_read)
from jaxgpt.model.positions import rope
from jaxgpt.parallel.context import ways as cp_ways
from jaxgpt.parallel.manual import per_shard
from jaxgpt.parallel.mesh import shard
from jaxgpt.parallel.pipeline import vary

KERNELS = ("auto", "xla", "cudnn", "mosaic")


def gpu_unavailable_reason(dtype: jnp.dtype, device: jax.Device) -> str | None:
    """Why a flash kernel for NVIDIA GPUs (cudnn, mosaic) cannot run on `device` in `dtype`, or None."""
    if device.platform != "gpu" or "NVIDIA" not in getattr(device, "device_kind", "NVIDIA"):
        return f"it needs an NVIDIA GPU (this is {device.platform})"
    capability = float(getattr(device, "compute_capability", "0") or 0)
    if capability < 8.0:
        return f"it needs compute capability >= 8.0 (this GPU has {capability})"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"it needs bf16 or fp16 compute (model.dtype gives {jnp.dtype(dtype).name})"
    return None


def cudnn_unavailable_reason(dtype: jnp.dtype, head_dim: int, device: jax.Device | None = None,
                             document_mask: bool = False) -> str | None:
    """Why cuDNN flash attention cannot run here, or None if it can."""
    device = device or target_device()  # a compile-only GPU while compiling for one (jaxgpt.gpu)
    if reason := gpu_unavailable_reason(dtype, device):
        return reason
    capability = float(getattr(device, "compute_capability", "0") or 0)
    if document_mask and capability < 9.0:
        return f"with model.document_mask its packed layout needs compute capability >= 9.0 (this GPU has {capability})"
    if head_dim % 8 or head_dim > 128:
        return f"it needs a head dim that is a multiple of 8 and at most 128 (this model has {head_dim})"
    return None


def select_kernel(requested: str, dtype: jnp.dtype, head_dim: int, document_mask: bool = False) -> tuple[str, str]:
    """(kernel, why) for `model.attention`; raises UserError if cudnn or mosaic is asked for and cannot run."""
    if requested == "xla":
        return "xla", "model.attention=xla"
    if requested == "mosaic":
        if reason := (gpu_unavailable_reason(dtype, target_device()) or flash.unavailable_reason()):
            raise UserError(f"model.attention=mosaic cannot run here: {reason}; use model.attention=auto or xla")
        return "mosaic", "model.attention=mosaic"
    reason = cudnn_unavailable_reason(dtype, head_dim, document_mask=document_mask)
    if requested == "cudnn":
        if reason:
            raise UserError(f"model.attention=cudnn cannot run here: {reason}; use model.attention=auto or xla")
        return "cudnn", "model.attention=cudnn"
    if reason:
        return "xla", f"auto: cuDNN flash attention unavailable because {reason}"
    return "cudnn", "auto: NVIDIA GPU, bf16/fp16 and head dim fit cuDNN flash attention"


def causal_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *, impl: str = "xla",
                     docs: Documents | None = None, max_documents: int = 64) -> jax.Array:
    """softmax(q k^T / sqrt(K) + causal mask) v, returning [B, T, H, K] in the inputs' dtype; with
    `docs` each query sees only its own document (module docstring)."""
    if impl not in ("xla", "cudnn", "mosaic"):
        raise ValueError(f"unresolved attention kernel {impl!r}: call select_kernel first")
    heads = ("batch", "seq", "act_heads", None)
    if impl == "mosaic":  # plain causal only (jaxgpt.config.validate); per device, as cuDNN's
        return per_shard(flash.attend, heads, q_BTHK, k_BTHK, v_BTHK)
    if cp_ways() > 1:  # context parallel: docs holds each index's position (jaxgpt/parallel/context.py)
        return _context_parallel(q_BTHK, k_BTHK, v_BTHK, docs, impl)
    if impl == "cudnn" and docs is not None:
        attend = partial(_cudnn_documents, max_documents=max_documents)
        return per_shard(attend, heads, q_BTHK, k_BTHK, v_BTHK, docs.start_BT,
                         arg_axes=(heads, heads, heads, ("batch", "seq")))
    attend = partial(jax.nn.dot_product_attention, is_causal=True, implementation=impl)
    if impl == "cudnn":  # each device attends over its own rows and heads (jaxgpt/parallel/manual.py: why)
        return per_shard(attend, heads, q_BTHK, k_BTHK, v_BTHK)
    if docs is not None:
        mask_B1TT = visible(docs, docs.at_T)[:, None]
        return attend(q_BTHK, k_BTHK, v_BTHK, mask=mask_B1TT)
    return attend(q_BTHK, k_BTHK, v_BTHK)


def _context_parallel(q_BTHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array, docs: Documents,
                      impl: str) -> jax.Array:
    """Attention with the sequence split over cp (jaxgpt/parallel/context.py): the queries stay
    split, K and V are gathered whole, and the mask comes from each index's position and document
    start in `docs` (device order), so it is causal whatever order the positions are in."""
    if impl == "xla" or q_BTHK.shape[1] % cp_ways():  # cuDNN: a window cp splits evenly (scoring's buckets may not)
        whole = ("batch", None, "act_heads", None)
        k_BTGK, v_BTGK = shard(k_BTGK, *whole), shard(v_BTGK, *whole)  # all-gathered over cp
        mask_B1TT = visible(docs, docs.at_T)[:, None]  # split over cp along the queries, like the scores
        return jax.nn.dot_product_attention(q_BTHK, k_BTGK, v_BTGK, mask=mask_B1TT, implementation="xla")
    return _cudnn_context(q_BTHK, k_BTGK, v_BTGK, docs.start_BT, docs.at_T)


_HEADS = ("batch", "seq", "act_heads", None)
_CONTEXT_AXES = (_HEADS, _HEADS, _HEADS, ("batch", "seq"), ("seq",))  # q, k, v, start, at


@jax.custom_vjp
def _cudnn_context(q_BTHK, k_BTGK, v_BTGK, start_BT, at_T) -> jax.Array:
    """cuDNN flash attention under cp: each device's queries against the whole window's K and V,
    gathered over cp inside a per-device `shard_map` (`_local_context`).

    A custom_vjp whose backward runs a second per-device function (`_local_context_grads`: the
    forward again, cuDNN's backward, dK and dV reduce-scattered over cp by hand), so autodiff never
    transposes a shard_map: transposed inside the train step's dp shard_map, the gathers'
    cotangents lose their manual-axis types (jaxgpt/parallel/manual.py). The price is one more
    attention forward per layer in the backward pass."""
    return per_shard(_local_context, _HEADS, q_BTHK, k_BTGK, v_BTGK, start_BT, at_T, arg_axes=_CONTEXT_AXES)


def _cudnn_context_fwd(q_BTHK, k_BTGK, v_BTGK, start_BT, at_T):
    return _cudnn_context(q_BTHK, k_BTGK, v_BTGK, start_BT, at_T), (q_BTHK, k_BTGK, v_BTGK, start_BT, at_T)


def _cudnn_context_bwd(res, d_out_BTHK):
    """(dq, dk, dv, None, None): res holds the forward's inputs (q, k, v, start, at)."""
    grads = per_shard(_local_context_grads, _HEADS, *res, d_out_BTHK, arg_axes=(*_CONTEXT_AXES, _HEADS))
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)  # the step's (dp): as the primals vary
    return (*(vary(g, manual) for g in grads), None, None)


_cudnn_context.defvjp(_cudnn_context_fwd, _cudnn_context_bwd)


def _local_attend(k_BtGK, v_BtGK, start_Bt, at_t):
    """(this device's attention as a function of q and the whole K, V; the whole K, V): the keys
    gathered over cp, the causal and document mask [B, 1, t, T] from the positions as cuDNN's bias.
    Every (query, key) block is computed, masked or not: each device does the same t x T work
    (balanced, not skipped)."""
    gather = partial(jax.lax.all_gather, axis_name="cp", tiled=True)
    k_BTGK, v_BTGK, key_at_T = gather(k_BtGK, axis=1), gather(v_BtGK, axis=1), gather(at_t, axis=0)
    key_11T = key_at_T[None, None, :]
    mask_B1tT = ((key_11T >= start_Bt[:, :, None]) & (key_11T <= at_t[None, :, None]))[:, None]
    return partial(jax.nn.dot_product_attention, mask=mask_B1tT, implementation="cudnn"), k_BTGK, v_BTGK


def _local_context(q_BtHK, k_BtGK, v_BtGK, start_Bt, at_t) -> jax.Array:
    attend, k_BTGK, v_BTGK = _local_attend(k_BtGK, v_BtGK, start_Bt, at_t)
    return attend(q_BtHK, k_BTGK, v_BTGK)


def _local_context_grads(q_BtHK, k_BtGK, v_BtGK, start_Bt, at_t, d_out_BtHK):
    attend, k_BTGK, v_BTGK = _local_attend(k_BtGK, v_BtGK, start_Bt, at_t)
    dq_BtHK, dk_BTGK, dv_BTGK = jax.vjp(attend, q_BtHK, k_BTGK, v_BTGK)[1](d_out_BtHK)
    scatter = partial(jax.lax.psum_scatter, axis_name="cp", scatter_dimension=1, tiled=True)
    return dq_BtHK, scatter(dk_BTGK), scatter(dv_BTGK)


def _cudnn_documents(q_BTHK, k_BTGK, v_BTGK, start_BT, *, max_documents: int) -> jax.Array:
    """cuDNN flash attention over each row's documents as packed sequences, causal within each."""
    lengths_BM, offsets_BM1 = packed_segments(start_BT, max_documents)
    return cudnn_attention.dot_product_attention(
        q_BTHK, k_BTGK, v_BTGK, q_seqlen=lengths_BM, kv_seqlen=lengths_BM, q_offsets=offsets_BM1,
        kv_offsets=offsets_BM1, scale=1 / math.sqrt(q_BTHK.shape[-1]), mask_type=cudnn_attention.MaskType.PADDING_CAUSAL)


def reference_attention(q_BTHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array,
                        docs: Documents | None = None) -> jax.Array:
    """The textbook formula in fp32, for tests; G < H kv heads are repeated to H; `docs`: masked
    to each query's document."""
    repeat = q_BTHK.shape[2] // k_BTGK.shape[2]
    q, k, v = (jnp.repeat(x, h, axis=2).astype(jnp.float32)
               for x, h in ((q_BTHK, 1), (k_BTGK, repeat), (v_BTGK, repeat)))
    T, K = q.shape[1], q.shape[-1]
    scores_BHTT = jnp.einsum("bthk,bshk->bhts", q, k) / jnp.sqrt(K)
    scores_BHTT = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores_BHTT, -jnp.inf)
    if docs is not None:
        scores_BHTT = jnp.where(visible(docs, jnp.arange(T))[:, None], scores_BHTT, -jnp.inf)  # window order
    return jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores_BHTT, axis=-1), v).astype(q_BTHK.dtype)


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
        self.grouped, self.heads = G != H, H
        if cfg.qk_norm:
            self.q_norm = Norm(cfg, K, rngs, axis="head_dim", rms=True)
            self.k_norm = Norm(cfg, K, rngs, axis="head_dim", rms=True)
        self.qk_norm = cfg.qk_norm
        self.rope_theta = cfg.rope_theta if cfg.position == "rope" else None
        self.k_bias_cancels = not cfg.qk_norm and cfg.position != "rope"  # `_qkv`
        self.c_proj_kernel = param(rngs, (H, K, D), ("heads", "head_dim", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = param(rngs, (D,), ("embed",), None) if bias else None
        self.impl, _ = select_kernel(cfg.attention, compute_dtype(cfg.dtype), cfg.head_dim, cfg.document_mask)
        self.fp8 = cfg.fp8_linears()  # the kinds in fp8 (model.fp8)
        self.position_reset, self.max_documents = cfg.position_reset, cfg.max_documents

    def _qkv(self, x_BTD: jax.Array, norm: FromNorm) -> tuple[jax.Array, ...]:
        """q [B, T, H, K], k and v [B, T, G, K], all named qkv, and v's bias [H, K] (or None), which
        the caller folds into attn_out's. The weights are fused (multi-head: c_attn [D, 3, H, K];
        grouped: q [D, H, K] and kv [D, 2, G, K]); each of q, k and v is a GEMM of its own on its
        slice, writing its output as the attention kernel reads it, with the bias in its epilogue
        (`dense`'s split and bias). One GEMM for all three wrote [B, T, 3, H, K]: splitting it (with
        the bias) copied q, k and v once more, and joining their gradients for its backward GEMMs
        copied them again (gpt2-124m on one H100, 981.8 -> 956.6 ms a step predicted; gpt2-1.3b
        4,037.5 -> 3,970.2; in fp8 942.8 -> 923.0 and 3,182.1 -> 3,125.8; jaxgpt.plan --target
        h100). In fp8 the backward still joins them: the kernel that does takes their amax and the
        bias's gradient too.

        Where `gemm_epilogues`, only q's GEMM adds a bias. k's adds q . b_k to all of a query's
        scores alike, which softmax ignores (not with rope or qk-norm, which make it differ by key);
        each softmax row sums to 1, so v's adds b_v to every output row, b_v W_o after attn_out,
        which goes into its bias (`__call__`). Their gradients are then exact (k's zero, v's a GEMV
        of attn_out's bias gradient), where each was a pass of its own over a [rows, D] gradient
        (gpt2-124m on one H100: 934.9 -> 926.9 ms a step predicted; gpt2-1.3b 3,906.4 -> 3,892.6)."""
        fp8 = "qkv" in self.fp8
        drop = gemm_epilogues(bool({"qkv", "attn_out"} & self.fp8))  # k's and v's biases go (below)
        v_bias = None
        if not self.grouped:
            b = self.c_attn_bias
            b_q, b_k, b_v = (None, None, None) if b is None else tuple(b[...])
            if norm.bias is not None:
                w = weight_as_read(self.c_attn_kernel.get_value(), x_BTD.dtype)
                b_q, b_k, b_v = (passes_input_bias_grad(b_i, norm.bias, w[:, i], 1) for i, b_i in enumerate((b_q, b_k, b_v)))
            if drop:
                b_k, b_v, v_bias = None if self.k_bias_cancels else b_k, None, b_v
            q_BTHK, k_BTGK, v_BTGK = dense("qkv", "btd,dshk->btshk", x_BTD, self.c_attn_kernel, fp8, norm.amax, split=True,
                                           bias=None if b is None else (b_q, b_k, b_v))
        else:
            q_bias = None if self.q_bias is None else self.q_bias[...]
            if norm.bias is not None:
                q_bias = passes_input_bias_grad(q_bias, norm.bias, weight_as_read(self.q_kernel.get_value(), x_BTD.dtype), 1)
            q_BTHK = dense("qkv", "btd,dhk->bthk", x_BTD, self.q_kernel, fp8, norm.amax, bias=q_bias)
            b = self.kv_bias
            b_k, b_v = (None, None) if b is None else tuple(b[...])
            if norm.bias is not None:
                w = weight_as_read(self.kv_kernel.get_value(), x_BTD.dtype)
                b_k, b_v = (passes_input_bias_grad(b_i, norm.bias, w[:, i], 1) for i, b_i in enumerate((b_k, b_v)))
            if drop:  # head h reads group h // (H/G)
                v_bias = None if b_v is None else jnp.repeat(b_v, self.heads // b_v.shape[0], axis=0)
                b_k, b_v = None if self.k_bias_cancels else b_k, None
            k_BTGK, v_BTGK = dense("qkv", "btd,dsgk->btsgk", x_BTD, self.kv_kernel, fp8, norm.amax, split=True,
                                   bias=None if b is None else (b_k, b_v))
        return (*(shard(y, "batch", "seq", "act_heads", None) for y in (q_BTHK, k_BTGK, v_BTGK)), v_bias)

    def __call__(self, x_BTD: jax.Array, kv: KV | None = None, pos: jax.Array | None = None,
                 docs: Documents | None = None, norm: FromNorm = FromNorm()):
        """Training: x -> y. Decoding (kv given): the T new positions start at `pos`; they attend
        to the cache [B, S, G, K] updated with their own keys/values; returns (y, new kv).
        `docs` (model.document_mask): each position sees only its own document. norm: what the
        norm before gives besides x (`Norm.routed`): its bias, which x holds and whose gradient q,
        k and v's biases pass on (k's, where `_qkv` drops it, has none: its gradient is zero), and
        a bound on max |x| for their fp8 cast."""
        dt = x_BTD.dtype
        q_BTHK, k_BTGK, v_BTGK, v_bias_HK = self._qkv(x_BTD, norm)
        if self.qk_norm:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        if self.rope_theta is not None:
            if docs is None:
                start = 0 if kv is None else pos
            else:  # each index's position: its place in its document, or in the window (in device order under cp)
                start = docs.position_BT if self.position_reset else docs.at_T[None, :]
            q_BTHK, k_BTGK = rope(q_BTHK, start, self.rope_theta), rope(k_BTGK, start, self.rope_theta)
        if kv is None:
            out_BTHK = causal_attention(q_BTHK, k_BTGK, v_BTGK, impl=self.impl, docs=docs,
                                        max_documents=self.max_documents)
        else:
            k_BSGK = jax.lax.dynamic_update_slice(kv.k, k_BTGK.astype(kv.k.dtype), (0, pos, 0, 0))
            v_BSGK = jax.lax.dynamic_update_slice(kv.v, v_BTGK.astype(kv.v.dtype), (0, pos, 0, 0))
            T, S = x_BTD.shape[1], k_BSGK.shape[1]
            if docs is None:
                visible_B1TS = (jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None])[None, None]  # causal, unwritten slots hidden
            else:
                visible_B1TS = visible(docs, jnp.arange(S, dtype=jnp.int32))[:, None]
            out_BTHK = jax.nn.dot_product_attention(q_BTHK, k_BSGK.astype(dt), v_BSGK.astype(dt),
                                                    mask=visible_B1TS, implementation="xla")
            kv = KV(k_BSGK, v_BSGK)
        y_BTD = project_out("attn_out", "bthk,hkd->btd", out_BTHK, self.c_proj_kernel, "attn_out" in self.fp8,
                            self.c_proj_bias, in_bias=v_bias_HK)
        return y_BTD if kv is None else (y_BTD, kv)

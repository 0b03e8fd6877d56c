"""Causal attention's kernels, and the choice of one (model.attention), made once per run.

Every attention the model computes goes through the op (model/ops.py `Ops.attention`); under a
lowering (ops.py) it is `causal_attention` with the kernel `select_kernel` chose:

    xla    `jax.nn.dot_product_attention(implementation='xla')`: runs everywhere; materialises the
           [B, H, T, T] scores (fp32 logits and softmax even for bf16 inputs).
    cudnn  cuDNN's fused flash attention (`implementation='cudnn'`): never materialises the
           scores, so memory is linear in T and it is several times faster on Hopper. It needs an
           NVIDIA GPU of compute capability >= 8.0, bf16 or fp16 inputs, and a head dim that is a
           multiple of 8 and at most 128.
    mosaic tokamax's Pallas Mosaic GPU flash attention (flash.py): FlashAttention-3's design on
           Hopper, written in JAX; an NVIDIA GPU of compute capability >= 8.0, bf16 or fp16, plain
           causal attention (no document_mask, no cp), no dp, ep or pp axis (fsdp and tp are
           fine), and tokamax installed. Not chosen by auto until a GPU measures it faster than
           cuDNN (scripts/attention_bench.py).
    auto   cudnn where all of that holds, else xla; the reason is logged once at start-up.

Asking for `cudnn` or `mosaic` where it cannot run is a `UserError` raised before compilation.

Document masking (model.document_mask, jaxgpt/model/documents.py) reaches both kernels as the
documents' start positions: XLA's takes a boolean [B, 1, T, T] mask beside `is_causal`; cuDNN's
takes each row's documents as its packed layout (`jax._src.cudnn.fused_attention_stablehlo`'s
q_offsets/kv_offsets and per-document lengths, mask type PADDING_CAUSAL, `packed_segments`), still
a flash kernel that never holds [T, T] scores. JAX's public `jax.nn.dot_product_attention` does not
pass the offsets on, so this calls the function behind it; its packed layout needs a Hopper GPU
(compute capability 9.0), which `cudnn_unavailable_reason` checks.

Context parallelism (the cp mesh axis, jaxgpt/parallel/context.py) splits the queries' positions
over devices in a balanced order that is not the window's, so neither kernel may use its built-in
causal mask there: `_context_parallel` masks by each index's true position (`Documents.at_T`). XLA's
kernel gets K and V gathered whole by a sharding constraint; cuDNN's runs per device on its own
queries against K and V gathered inside the per-device function (`_cudnn_context`, its mask the
kernel's bias operand).

Letters: B batch, T time (sequence), H heads, G key/value heads, K head dim, M documents per row.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention  # packed layout: module docstring

from jaxgpt.errors import UserError
from jaxgpt.lowering import flash
from jaxgpt.model.documents import Documents, visible
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


def cudnn_unavailable_reason(dtype: jnp.dtype, head_dim: int, device: jax.Device,
                             document_mask: bool = False) -> str | None:
    """Why cuDNN flash attention cannot run on `device` (a compile-only GPU while compiling for one,
    jaxgpt.gpu), or None if it can."""
    if reason := gpu_unavailable_reason(dtype, device):
        return reason
    capability = float(getattr(device, "compute_capability", "0") or 0)
    if document_mask and capability < 9.0:
        return f"with model.document_mask its packed layout needs compute capability >= 9.0 (this GPU has {capability})"
    if head_dim % 8 or head_dim > 128:
        return f"it needs a head dim that is a multiple of 8 and at most 128 (this model has {head_dim})"
    return None


def select_kernel(requested: str, dtype: jnp.dtype, head_dim: int, device: jax.Device,
                  document_mask: bool = False) -> tuple[str, str]:
    """(kernel, why) for `model.attention` on `device`; raises UserError if cudnn or mosaic is asked
    for and cannot run."""
    if requested == "xla":
        return "xla", "model.attention=xla"
    if requested == "mosaic":
        if reason := (gpu_unavailable_reason(dtype, device) or flash.unavailable_reason()):
            raise UserError(f"model.attention=mosaic cannot run here: {reason}; use model.attention=auto or xla")
        return "mosaic", "model.attention=mosaic"
    reason = cudnn_unavailable_reason(dtype, head_dim, device, document_mask)
    if requested == "cudnn":
        if reason:
            raise UserError(f"model.attention=cudnn cannot run here: {reason}; use model.attention=auto or xla")
        return "cudnn", "model.attention=cudnn"
    if reason:
        return "xla", f"auto: cuDNN flash attention unavailable because {reason}"
    return "cudnn", "auto: NVIDIA GPU, bf16/fp16 and head dim fit cuDNN flash attention"


def causal_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *, impl: str = "xla",
                     docs: Documents | None = None, max_documents: int = 64, cp: int = 1) -> jax.Array:
    """softmax(q k^T / sqrt(K) + causal mask) v, returning [B, T, H, K] in the inputs' dtype; with
    `docs` each query sees only its own document (module docstring)."""
    if impl not in ("xla", "cudnn", "mosaic"):
        raise ValueError(f"unresolved attention kernel {impl!r}: call select_kernel first")
    heads = ("batch", "seq", "act_heads", None)
    if impl == "mosaic":  # plain causal only (jaxgpt.config.validate); per device, as cuDNN's
        return per_shard(flash.attend, heads, q_BTHK, k_BTHK, v_BTHK)
    if cp > 1:  # context parallel: docs holds each index's position (jaxgpt/parallel/context.py)
        return _context_parallel(q_BTHK, k_BTHK, v_BTHK, docs, impl, cp)
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
                      impl: str, cp: int) -> jax.Array:
    """Attention with the sequence split over cp (jaxgpt/parallel/context.py): the queries stay
    split, K and V are gathered whole, and the mask comes from each index's position and document
    start in `docs` (device order), so it is causal whatever order the positions are in."""
    if impl == "xla" or q_BTHK.shape[1] % cp:  # cuDNN: a window cp splits evenly (scoring's buckets may not)
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


def packed_segments(start_BT: jax.Array, max_documents: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed layout for one device's rows: (lengths [B, M], offsets [B, M+1]) of each
    row's first M documents, -1 past the last (jax._src.cudnn.fused_attention_stablehlo's
    convention). The M-th runs to the window's end, taking in any documents after it."""
    B, T = start_BT.shape
    M = min(max_documents, T)
    first_BT = start_BT == jnp.arange(T, dtype=jnp.int32)[None, :]  # a document begins here
    offsets_BM = jax.vmap(lambda f_T: jnp.nonzero(f_T, size=M, fill_value=-1)[0].astype(jnp.int32))(first_BT)
    # a document ends where the next begins, the last one at T
    next_BM = jnp.concatenate([offsets_BM[:, 1:], jnp.full((B, 1), -1, jnp.int32)], axis=1)
    lengths_BM = jnp.where(offsets_BM < 0, -1, jnp.where(next_BM < 0, T, next_BM) - offsets_BM)
    return lengths_BM, jnp.concatenate([offsets_BM, jnp.full((B, 1), -1, jnp.int32)], axis=1)

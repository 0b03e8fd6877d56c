"""Next-token cross-entropy, computed a chunk of positions at a time.

Letters: B batch, T time, C chunks, t positions per chunk (T = C*t), D model width, V vocabulary.

Why chunks. The head's fp32 logits [B, T, V] are the largest tensor of a GPT step: 412 MB for
the default run (16 x 128 x 50304) and 6.6 GB for gpt2-124m's 32-sequence micro-batch, plus as
much again for their softmax and gradient. Materialised whole they dominate XLA's temporaries (GPU
memory) and, on a CPU, the bytes each step allocates, faults in and frees.

How. `chunked_cross_entropy` runs the tied head and the loss over C chunks of t positions in a
`lax.scan`, and computes the gradients in the same pass (a `custom_vjp`, the idea of Liger's fused
linear cross-entropy): per chunk, logits -> loss, dlogits = softmax - one_hot, dx = dlogits @ wte,
dwte += dlogits^T x. The forward pass keeps dx [C, B, t, D] and dwte [V, D] as residuals and the
backward pass only scales them by the incoming cotangent. Only one chunk's [B, t, V] exists at a
time, and the FLOPs are autodiff's (no logits are recomputed, as a `jax.checkpoint`ed chunk would).
Without differentiation (evaluation) only the loss is computed; `token_nats` is the same head
and cross-entropy per position, [B, T], for sums over chosen positions (val bits per byte, a task
choice's log-likelihood).

The head's table is whatever the caller passes: `wte` for the tied head (GPT-2's), `lm_head` with
model.tie_embeddings=false (`model.head_table`). With model.logit_softcap=c the logits are
c * tanh(z / c) and dlogits picks up the factor 1 - (logits / c)^2, in the same pass.

`model.loss_chunk` sets t; 0 (the default) takes the largest divisor of T that keeps a chunk
within `AUTO_CHUNK_ROWS` rows per device (on a CPU, n_embd rows if that is more), and t = T is a
single chunk. Under FSDP the embedding table is gathered once, before the loop, not once per
chunk (the same `shard` the input lookup uses). Precision follows the model: logits, softmax and
the accumulated dwte in fp32, the two gradient matmuls in the compute dtype with fp32 accumulation.

The label's logit is picked by comparing the vocabulary index with the label and summing, not by
a gather: with the vocabulary split over tp that is Megatron's vocab-parallel cross-entropy (each
shard sums its own slice, XLA adds one small all-reduce), XLA fuses the compare into the
reduction, and it avoids a gather that XLA's partitioner cannot split inside the train step's dp
`shard_map` when fsdp and tp are both > 1.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.gpu.target import target_device
from jaxgpt.model.fp8 import E4M3, E5M2, quantize, scaled_dot
from jaxgpt.model.gpt import head_logits, softcap
from jaxgpt.parallel.mesh import MESH_AXES, RULES, shard

# model.loss_chunk=0: the most positions per chunk whose logits stay within this many rows
# (sequences x positions) per device. On a CPU, n_embd rows (at least 128): a chunk's logits
# [rows, V] no larger than the [V, D] table gradient every chunk adds to. The default run (D 128):
# 128 rows was the fastest chunk measured on a 2-core Intel Xeon (1,258 ms a step against 1,511 for
# 512 rows and 2,102 for one chunk, issue 23) and as fast as 256-1,024 rows on a 2-core AMD EPYC,
# where one chunk is 1.5x slower; gpt2-124m (D 768, 1 x 1024 tokens) on that AMD: 512 positions 4%
# faster than 128 (docs/benchmarks.md, "CPU vs a PyTorch reference"). On a GPU, 8192 rows keep the
# head's matmuls large while the logits of gpt2-124m's 32-sequence micro-batch shrink from 6.6 GB
# to 1.6 GB.
AUTO_CHUNK_ROWS = {"cpu": 128}
AUTO_CHUNK_ROWS_ACCELERATOR = 8192


def chunk_positions(cfg: ModelConfig, rows_per_device: int, T: int | None = None) -> int:
    """Positions per loss chunk t (a divisor of T, default seq_len) for `model.loss_chunk`, given
    the sequences each device holds; a loss_chunk that does not divide a shorter T (evaluation's
    length buckets) falls back to the auto rule."""
    T = T or cfg.seq_len
    if cfg.loss_chunk and T % cfg.loss_chunk == 0:
        return cfg.loss_chunk
    platform = target_device().platform
    budget = max(AUTO_CHUNK_ROWS[platform], cfg.n_embd) if platform in AUTO_CHUNK_ROWS else AUTO_CHUNK_ROWS_ACCELERATOR
    limit = max(1, budget // max(1, rows_per_device))
    return max(t for t in range(1, min(T, limit) + 1) if T % t == 0)


def _rows_per_device(B: int) -> int:
    """Sequences per device of a batch of B inside jit: B over the batch's mesh axes that are not
    already split by hand (inside the train step's dp shard_map, B is one dp shard's)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return B
    axes = [a for a in MESH_AXES if a in RULES["batch"] and a not in set(mesh.manual_axes)]
    return max(1, B // math.prod(mesh.shape[a] for a in axes))


def _cross_entropy(logits_BTV: jax.Array, labels_BT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(fp32 cross-entropy summed per sequence [B], logsumexp [B, T], label mask [B, T, V]);
    vocab-parallel, no gather. Per-sequence sums keep the chunk loop free of a cross-device
    reduction: the batch axis stays split until the sum after the loop."""
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    is_label_BTV = jnp.arange(logits_BTV.shape[-1]) == labels_BT[..., None]
    label_logit_BT = jnp.sum(jnp.where(is_label_BTV, logits_BTV, 0.0), axis=-1)
    return jnp.sum(lse_BT - label_logit_BT, axis=-1), lse_BT, is_label_BTV


def chunked_cross_entropy(x_BTD: jax.Array, wte_VD: jax.Array, labels_BT: jax.Array, cfg: ModelConfig,
                          dtype: jnp.dtype) -> jax.Array:
    """Mean cross-entropy of the tied head on final features x [B, T, D] (after ln_f)."""
    B, T, D = x_BTD.shape
    t = chunk_positions(cfg, _rows_per_device(B))
    x_CBtD = shard(x_BTD.reshape(B, T // t, t, D).swapaxes(0, 1), None, "batch", "seq", "act_embed")
    labels_CBt = labels_BT.reshape(B, T // t, t).swapaxes(0, 1)
    return _head_loss(x_CBtD, wte_VD, labels_CBt, cfg.vocab_size, dtype, cfg.fp8_head, cfg.logit_softcap) / (B * T)


def token_nats(x_BTD: jax.Array, wte_VD: jax.Array, labels_BT: jax.Array, cfg: ModelConfig,
               dtype: jnp.dtype) -> jax.Array:
    """fp32 cross-entropy of every position [B, T] (evaluation: no gradient), the head applied a
    chunk at a time like `chunked_cross_entropy`; its sum over all positions is that function's
    loss times B*T (up to summation order)."""
    B, T, D = x_BTD.shape
    t = chunk_positions(cfg, _rows_per_device(B), T)
    x_CBtD = shard(x_BTD.reshape(B, T // t, t, D).swapaxes(0, 1), None, "batch", "seq", "act_embed")
    labels_CBt = labels_BT.reshape(B, T // t, t).swapaxes(0, 1)
    head = _Head(wte_VD, cfg.vocab_size, dtype, cfg.fp8_head, cfg.logit_softcap)

    @jax.named_scope("head")
    def body(_, chunk):
        x_BtD, labels_Bt = chunk
        logits_BtV = head.logits(x_BtD)[0]
        lse_Bt = jax.nn.logsumexp(logits_BtV, axis=-1)
        is_label_BtV = jnp.arange(logits_BtV.shape[-1]) == labels_Bt[..., None]
        return None, lse_Bt - jnp.sum(jnp.where(is_label_BtV, logits_BtV, 0.0), axis=-1)

    nats_CBt = jax.lax.scan(body, None, (x_CBtD, labels_CBt))[1]
    return nats_CBt.swapaxes(0, 1).reshape(B, T)


class _Head:
    """The head's table as its GEMMs take it: in the compute dtype, or (model.fp8_head) in e4m3
    with its per-tensor scale, quantized once per step before the chunk loop."""

    def __init__(self, wte_VD: jax.Array, vocab_size: int, dtype: jnp.dtype, fp8: bool, cap: float):
        self.vocab_size, self.dtype, self.fp8, self.cap = vocab_size, dtype, fp8, cap
        self.wte_VD = _gathered(wte_VD, dtype)
        if fp8:
            self.wte_q_VD, self.s_wte = quantize(self.wte_VD, E4M3)

    def logits(self, x_BtD: jax.Array) -> tuple[jax.Array, tuple]:
        """fp32 logits [B, t, V] of one chunk, and what its gradient GEMMs reuse (x in e4m3)."""
        if not self.fp8:
            return head_logits(x_BtD, self.wte_VD, self.vocab_size, self.dtype, self.cap), (x_BtD.astype(self.dtype), None)
        x_q_BtD, s_x = quantize(x_BtD, E4M3)
        logits_BtV = scaled_dot("btd,vd->btv", x_q_BtD, s_x, self.wte_q_VD, self.s_wte, jnp.float32)
        logits_BtV = shard(softcap(logits_BtV, self.cap), "batch", "seq", "act_vocab")
        is_real_V = jnp.arange(self.wte_VD.shape[0]) < self.vocab_size
        return jnp.where(is_real_V, logits_BtV, -jnp.inf), (x_q_BtD, s_x)

    def grads(self, dlogits_BtV: jax.Array, x_saved: tuple, S: int) -> tuple[jax.Array, jax.Array]:
        """(dx [B, t, D] = dlogits @ wte, dwte per batch shard [S, V, D] = dlogits^T x), fp32."""
        x_BtD, s_x = x_saved
        B, t = x_BtD.shape[:2]
        dlogits_SbtV = shard(dlogits_BtV.reshape(S, B // S, t, -1), "batch", None, "seq", "act_vocab")
        x_SbtD = shard(x_BtD.reshape(S, B // S, t, -1), "batch", None, "seq", "act_embed")
        if not self.fp8:
            dx_BtD = jnp.einsum("btv,vd->btd", dlogits_BtV, self.wte_VD, preferred_element_type=jnp.float32)
            return dx_BtD, jnp.einsum("sbtv,sbtd->svd", dlogits_SbtV, x_SbtD, preferred_element_type=jnp.float32)
        dlogits_q_BtV, s_d = quantize(dlogits_BtV, E5M2)  # one scale for the chunk, as x's
        dlogits_q_SbtV = shard(dlogits_q_BtV.reshape(S, B // S, t, -1), "batch", None, "seq", "act_vocab")
        dx_BtD = scaled_dot("btv,vd->btd", dlogits_q_BtV, s_d, self.wte_q_VD, self.s_wte, jnp.float32)
        return dx_BtD, scaled_dot("sbtv,sbtd->svd", dlogits_q_SbtV, s_d, x_SbtD, s_x, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _head_loss(x_CBtD, wte_VD, labels_CBt, vocab_size, dtype, fp8, cap):
    """Summed loss over the chunks (the primal: evaluation, no gradients)."""
    head = _Head(wte_VD, vocab_size, dtype, fp8, cap)

    @jax.named_scope("head")  # names the head's GEMMs in the compiled HLO (jaxgpt.hlo.gemm_layers)
    def body(_, chunk):
        x_BtD, labels_Bt = chunk
        return None, _cross_entropy(head.logits(x_BtD)[0], labels_Bt)[0]

    return jnp.sum(jax.lax.scan(body, None, (x_CBtD, labels_CBt))[1])


def _head_loss_fwd(x_CBtD, wte_VD, labels_CBt, vocab_size, dtype, fp8, cap):
    """The loss and, chunk by chunk, its gradients: dlogits = softmax - one_hot, then
    dx = dlogits @ wte and dwte += dlogits^T x. Same FLOPs as autodiff, no recompute; the
    gradients are the residuals, so the backward pass only scales them."""
    B, t = x_CBtD.shape[1:3]
    S = B // _rows_per_device(B)  # batch shards: each keeps its own partial dwte through the loop
    param_VD, head = wte_VD, _Head(wte_VD, vocab_size, dtype, fp8, cap)

    @jax.named_scope("head")
    def body(dwte_SVD, chunk):
        x_BtD, labels_Bt = chunk
        logits_BtV, x_saved = head.logits(x_BtD)
        loss_B, lse_Bt, is_label_BtV = _cross_entropy(logits_BtV, labels_Bt)
        dlogits_BtV = jnp.exp(logits_BtV - lse_Bt[..., None]) - is_label_BtV
        if cap:  # through the soft-cap: d(c tanh(z/c))/dz = 1 - (capped/c)^2; the -inf padding gets 0
            dlogits_BtV = jnp.where(jnp.isfinite(logits_BtV), dlogits_BtV * (1 - jnp.square(logits_BtV / cap)), 0.0)
        dlogits_BtV = dlogits_BtV.astype(dtype)
        dlogits_BtV = shard(dlogits_BtV, "batch", "seq", "act_vocab")
        dx_BtD, dwte_chunk_SVD = head.grads(dlogits_BtV, x_saved, S)
        dwte_SVD = dwte_SVD + dwte_chunk_SVD
        return shard(dwte_SVD, "batch", "vocab", None), (loss_B, dx_BtD.astype(x_BtD.dtype))

    # A [V, D] carry would be all-reduced over the batch axes in every chunk (GSPMD has no
    # partial-sum carry); one partial sum per batch shard, summed once after the loop, is one
    # reduction per step. full_like keeps wte's type (dp-varying inside the dp shard_map).
    zeros_SVD = shard(jax.lax.full_like(param_VD, 0, jnp.float32, shape=(S, *param_VD.shape)), "batch", "vocab", None)
    dwte_SVD, (losses_CB, dx_CBtD) = jax.lax.scan(body, zeros_SVD, (x_CBtD, labels_CBt))
    # Summed straight into the parameter's own layout: under fsdp a reduce-scatter, not an
    # all-reduce of the whole table followed by a slice.
    dwte_VD = shard(jnp.sum(dwte_SVD, axis=0).astype(param_VD.dtype), "vocab", "embed")
    return jnp.sum(losses_CB), (dx_CBtD, dwte_VD, labels_CBt)


def _gathered(wte_VD: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The table in the compute dtype, whole along D: under FSDP one gather per micro-batch, in
    bf16 on a GPU, before the chunk loop (not one per chunk); the gradient is the custom_vjp's."""
    return shard(wte_VD.astype(dtype), "vocab", None)


def _head_loss_bwd(vocab_size, dtype, fp8, cap, residuals, g):
    dx_CBtD, dwte_VD, labels_CBt = residuals
    int_zero = np.zeros(labels_CBt.shape, jax.dtypes.float0)  # integer labels have no gradient
    return (g * dx_CBtD).astype(dx_CBtD.dtype), g * dwte_VD, int_zero


_head_loss.defvjp(_head_loss_fwd, _head_loss_bwd)

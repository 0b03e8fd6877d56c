"""Next-token cross-entropy, computed a chunk of positions at a time.

Letters: B batch, T time, C chunks, t positions per chunk (T = C*t), D model width, V vocabulary.

Why chunks. The head's logits [B, T, V] are the largest tensor of a GPT step: in fp32, 412 MB
for the default run (16 x 128 x 50304) and 6.6 GB for a 32-sequence gpt2-124m micro-batch, plus as
much again for their softmax and gradient. Materialised whole they dominate XLA's temporaries (GPU
memory) and, on a CPU, the bytes each step allocates, faults in and frees.

How. The loss of a position is logsumexp(logits) - logit[label]. `chunked_cross_entropy` runs the
tied head and the logsumexp over C chunks of t positions in a `lax.scan`, and computes the
gradients in the same pass (a `custom_vjp`, the idea of Liger's fused linear cross-entropy): per
chunk, logits -> lse and p = softmax, dx = p @ wte, dwte += p^T x. The forward pass keeps dx
[C, B, t, D] and dwte [V, D] as residuals and the backward pass only scales them by the incoming
cotangent. Only one chunk's [B, t, V] exists at a time, and the FLOPs are autodiff's (no logits
are recomputed, as a `jax.checkpoint`ed chunk would). Without differentiation (evaluation) only
the loss is computed; `token_nats` is the same head and cross-entropy per position, [B, T], for
sums over chosen positions (val bits per byte, a task choice's log-likelihood).

The label's term. `label_logits` takes logit[label] once for the whole batch, outside the loop, as
the dot product of x with the label's row of the table, looked up as the input embedding is
(`GPT.embed`, `lookup_table`: the same gather under every layout). Autodiff gives its
gradient, the one-hot part of dlogits (-wte[label] into dx, a scatter-add of -x into dwte), so the
loop's gradient is the softmax p alone. This is what makes a chunk cheap: the loop reads and
writes each chunk's [B, t, V] as few times as XLA allows (on a CPU, where those passes dominate the
step):
    the logits GEMM writes it; the max m and the sum s of exp(logits - m) read it, on a GPU in one
    pass (`online_max_sum`: running max and rescaled sum together; gpt2-124m on an H100 predicted
    1,168 -> 1,131 ms a step), on a CPU in two (one pass costs two exps per element there: 432 ->
    781 ms): the max, then e = exp(logits - m), written once in the compute dtype, whose row sums
    are s. lse = m + log s.
    p = e / s is never written (except with model.fp8_head, whose e5m2 quantization takes p):
    the dx and dwte GEMMs read e, and the 1/s goes on their small sides, dx = (e @ wte) / s and
    dwte^T += (x / s)^T e. Before, e's sum and p were two more
    passes over the chunk on a CPU (the default run's head on a 2-core AMD EPYC: 583 -> 554 ms).
    The vocabulary's padding: on a CPU with V whole on each device the loop takes the table's real
    rows only (`_Head`; its gradient's padding rows are 0), so no pass masks; otherwise each
    pass masks the padding itself (a masked copy read by the others would be one more write).
dwte is accumulated as [D, V] (x^T @ e reads e in its own row-major layout; e^T @ x made XLA
write a transposed copy of it every chunk) and transposed once after the loop. Measured on the
default run's head alone (value_and_grad, 16 chunks of [128, 50304], one CPU device, 2-core Intel
Xeon): 500 ms -> 375 ms per step; the whole step 640 ms -> 520 ms (docs/benchmarks.md).

The head's table is whatever the caller passes: `wte` for the tied head (GPT-2's), `lm_head` with
model.tie_embeddings=false (`model.head_table`). With model.logit_softcap=c the logits are
c * tanh(z / c) (the label's logit too), and e picks up the factor 1 - (logits / c)^2 after its sum is taken.

Per-token weights (supervised fine-tuning's loss mask, `weights_BT`): the loss is sum(w * nats) /
sum(w), and the chunk loop scales each row's gradients by its weight where it scales them by
1 / (its row sum) anyway (dx = (e @ wte) * w / s, dwte^T += (x * w / s)^T e): a row of weight 0
adds nothing to the loss and gets exactly zero gradient, at no extra pass. Without weights
(pretraining) the loop is as above.

`model.loss_chunk` sets t; 0 (the default) takes the largest divisor of T that keeps a chunk
within `AUTO_CHUNK_ROWS` rows per device (on a CPU, n_embd rows if that is more), and t = T is a
single chunk. Under FSDP the embedding table is gathered once, before the loop, not once per
chunk (its fsdp shards, as the input lookup gathers them; V stays on tp). Precision follows the
model: the logits GEMM accumulates in fp32 and writes the compute dtype, so in bf16 (the GPU
default) the loss is fp32 cross-entropy of bf16-rounded logits, the label's logit rounded alike:
what nanoGPT's head under autocast, llm.c's and nanochat's compute. The max, row sums, logsumexp
and the accumulated dwte are fp32; e and x / s are rounded to the compute dtype for the two
gradient matmuls, which accumulate in fp32. bf16 logits halve the bytes of the three passes over
each chunk (the GEMM's write, the max-sum's read, the exp pass's read): gpt2-124m on an H100,
1,031.5 -> 991.2 ms a step predicted (docs/benchmarks.md). Sampling's `head_logits` stays fp32.
On a CPU in bf16, dwte leaves the loop through an optimization barrier (`pins_dwte`: one chunk's
GEMM with the transpose folded in is one XLA:CPU cannot run).

With the vocabulary split over tp this is Megatron's vocab-parallel cross-entropy: each shard
reduces its own slice of the logits (XLA adds small all-reduces of [B, t] maxima and sums), and
the label's row is gathered from the table (`lookup_table`, as the input lookup reads it), never
from the [B, t, V] logits, a gather that XLA's partitioner cannot split inside the train step's dp
`shard_map` when fsdp and tp are both > 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from jaxgpt.config import ModelConfig
from jaxgpt.gpu.target import target_device
from jaxgpt.model.fp8 import E4M3, E5M2, quantize, scaled_dot
from jaxgpt.model.gpt import lookup_table, softcap
from jaxgpt.parallel.mesh import shard, splits

# model.loss_chunk=0: the most positions per chunk whose logits stay within this many rows
# (sequences x positions) per device. On a CPU, 256 rows or n_embd if more. The default run (D 128)
# on a 2-core AMD EPYC, with the gradient GEMMs reading e (no p pass): 256 rows 3,194 and 512 rows
# 3,241 tokens/s against 2,928 for 128 rows (256 taken: as fast, and half the memory per pass),
# and 1,024 rows far slower (a step's arrays of [rows, V] outgrow the caches). With the earlier
# loss, 128 rows had been the fastest on a 2-core Intel Xeon (1,258 ms a step against 1,511 for
# 512 rows). gpt2-124m (D 768, 1 x 1024 tokens) on that AMD: 512 positions 4% faster than 128
# (docs/benchmarks.md, "CPU vs a PyTorch reference"). On a GPU, 8192 rows keep the head's matmuls
# large while the logits of a 32-sequence gpt2-124m micro-batch shrink from 6.6 GB to 1.6 GB.
AUTO_CHUNK_ROWS = {"cpu": 256}
AUTO_CHUNK_ROWS_ACCELERATOR = 8192


def chunk_positions(cfg: ModelConfig, rows_per_device: int, T: int | None = None) -> int:
    """Positions per loss chunk t (a divisor of T, default seq_len) for `model.loss_chunk`, given
    the sequences each device holds; a loss_chunk that does not divide a shorter T (evaluation's
    length buckets) falls back to the auto rule."""
    T = T or cfg.seq_len
    w = _seq_ways(T, T)  # context parallelism: a chunk takes t/w positions on each device
    if cfg.loss_chunk and T % cfg.loss_chunk == 0 and cfg.loss_chunk % w == 0:
        return cfg.loss_chunk
    platform = target_device().platform
    budget = max(AUTO_CHUNK_ROWS[platform], cfg.n_embd) if platform in AUTO_CHUNK_ROWS else AUTO_CHUNK_ROWS_ACCELERATOR
    limit = max(w, budget * w // max(1, rows_per_device))
    return max(t for t in range(w, min(T, limit) + 1, w) if T % t == 0)


def _rows_per_device(B: int) -> int:
    """Sequences per device of a batch of B inside jit: B over the batch's mesh axes that are not
    already split by hand (inside the train step's dp shard_map, B is one dp shard's)."""
    return max(1, B // splits("batch"))


def label_logits(x_BTD: jax.Array, table_VD: jax.Array, labels_BT: jax.Array, dtype: jnp.dtype,
                 cap: float = 0.0) -> jax.Array:
    """The logit of each position's label [B, T], in fp32: the head's dot product for that one row
    of the table, read by a lookup as the input embedding's is (`GPT.embed`), so no pass over
    [B, T, V] picks it out. As the head's GEMM: operands rounded to the compute dtype, products
    summed in fp32, the sum rounded to the compute dtype (with model.fp8_head, the label's term
    keeps the compute dtype's operands); its gradient (a scatter-add of x into the label rows) is
    autodiff's."""
    rows_BTD = lookup_table(table_VD)[labels_BT]
    z_BT = jnp.sum(x_BTD.astype(dtype).astype(jnp.float32) * rows_BTD.astype(dtype).astype(jnp.float32), axis=-1)
    return softcap(z_BT.astype(dtype).astype(jnp.float32), cap)


def online_lse(x: jax.Array) -> jax.Array:
    """logsumexp over the last axis in one pass over x (`online_max_sum`)."""
    m, total = online_max_sum(x)
    return m + jnp.log(total)


def online_max_sum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(m, sum of exp(x - m)) over the last axis, m the maximum, in one pass over x: a reduction
    of (running max, sum) pairs, rescaling the sum whenever the max grows (flash attention's online
    softmax). -inf entries add nothing; a row of only -inf gives (-inf, 0), so m + log(sum) is -inf
    as logsumexp is."""
    def combine(a: tuple, b: tuple) -> tuple:
        (m1, s1), (m2, s2) = a, b
        m = jnp.maximum(m1, m2)
        shift = jnp.where(m == -jnp.inf, 0.0, m)  # exp(-inf - -inf) would be NaN
        return m, s1 * jnp.exp(m1 - shift) + s2 * jnp.exp(m2 - shift)

    x = x.astype(jnp.float32)
    return jax.lax.reduce((x, jnp.ones_like(x)), (jnp.float32(-jnp.inf), jnp.float32(0)), combine, (x.ndim - 1,))


def _chunks(x_BTD: jax.Array, t: int) -> jax.Array:
    """[B, T, D] -> [C, B, t, D], the chunk loop's order. Under context parallelism (w devices
    splitting T into w contiguous pieces) chunk c takes the c-th t/w positions of every piece,
    so each device works on its own positions in every iteration (`_unchunk` undoes it)."""
    B, T, D = x_BTD.shape
    w = _seq_ways(T, t)
    x_CBtD = x_BTD.reshape(B, w, T // t, t // w, D).transpose(2, 0, 1, 3, 4).reshape(T // t, B, t, D)
    return shard(x_CBtD, None, "batch", "seq", "act_embed")


def _chunks_BT(w_BT: jax.Array, t: int) -> jax.Array:
    """[B, T] -> [C, B, t] in `_chunks`' order (per-position weights beside the features)."""
    B, T = w_BT.shape
    w = _seq_ways(T, t)
    w_CBt = w_BT.reshape(B, w, T // t, t // w).transpose(2, 0, 1, 3).reshape(T // t, B, t)
    return shard(w_CBt, None, "batch", "seq")


def _unchunk(y_CBt: jax.Array) -> jax.Array:
    """[C, B, t] in `_chunks`' order -> [B, T]."""
    C, B, t = y_CBt.shape
    w = _seq_ways(C * t, t)
    return y_CBt.reshape(C, B, w, t // w).transpose(1, 2, 0, 3).reshape(B, C * t)


def _seq_ways(T: int, t: int) -> int:
    """The devices splitting the positions (cp) where each chunk splits evenly over them, else 1."""
    w = splits("seq")
    return w if T % w == 0 and t % w == 0 else 1


def chunked_cross_entropy(x_BTD: jax.Array, wte_VD: jax.Array, labels_BT: jax.Array, cfg: ModelConfig,
                          dtype: jnp.dtype, weights_BT: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy of the tied head on final features x [B, T, D] (after ln_f); with
    `weights_BT` [B, T] (None: every position counts), sum(w * nats) / sum(w) (0 where sum(w) is 0),
    a position of weight 0 getting exactly zero gradient (module docstring)."""
    B, T, _ = x_BTD.shape
    t = chunk_positions(cfg, _rows_per_device(B))
    w_CBt = None if weights_BT is None else _chunks_BT(weights_BT.astype(jnp.float32), t)
    lse = _head_lse(_chunks(x_BTD, t), wte_VD, w_CBt, cfg.vocab_size, dtype, cfg.fp8_head, cfg.logit_softcap)
    label_BT = label_logits(x_BTD, wte_VD, labels_BT, dtype, cfg.logit_softcap)
    if weights_BT is None:
        return (lse - jnp.sum(label_BT)) / (B * T)
    w_BT = weights_BT.astype(jnp.float32)
    total = jnp.sum(w_BT)
    return (lse - jnp.sum(w_BT * label_BT)) / jnp.where(total > 0, total, 1.0)


def token_nats(x_BTD: jax.Array, wte_VD: jax.Array, labels_BT: jax.Array, cfg: ModelConfig,
               dtype: jnp.dtype) -> jax.Array:
    """fp32 cross-entropy of every position [B, T] (evaluation: no gradient) of the logits in the
    compute dtype, the head applied a
    chunk at a time like `chunked_cross_entropy`; its sum over all positions is that function's
    loss times B*T (up to summation order)."""
    B, T, _ = x_BTD.shape
    t = chunk_positions(cfg, _rows_per_device(B), T)
    head = _Head(wte_VD, cfg.vocab_size, dtype, cfg.fp8_head, cfg.logit_softcap)

    @jax.named_scope("head")
    def body(_, x_BtD):
        return None, head.lse(head.logits(x_BtD)[0])

    lse_BT = _unchunk(jax.lax.scan(body, None, _chunks(x_BTD, t))[1])
    return lse_BT - label_logits(x_BTD, wte_VD, labels_BT, dtype, cfg.logit_softcap)


def pins_dwte(platform: str, dtype: jnp.dtype) -> bool:
    """Whether the chunk loop's dwte result goes through an optimization barrier. XLA:CPU runs a
    bf16 x bf16 -> fp32 GEMM only as a YNNPACK fusion, and gives any other to its DotThunk with both
    operands converted to fp32 first. With one chunk the scan is removed after that conversion is
    decided, and the transpose of dwte after the loop is folded into its GEMM ([V, D] = e^T (x / s),
    contracting e's rows): a layout YNNPACK does not take, left as a bf16 x bf16 -> fp32 dot that
    DotThunk cannot run ("UNIMPLEMENTED: Unsupported element type for DotThunk::Execute"). The
    barrier keeps the transpose a copy after the loop, as it is with several chunks. fp32 GEMMs
    (which DotThunk runs) and GPUs keep the fold."""
    return platform == "cpu" and jnp.dtype(dtype) != jnp.float32


class _Head:
    """The head's table as its GEMMs take it: in the compute dtype, or (model.fp8_head) in e4m3
    with its per-tensor scale, quantized once per step before the chunk loop. On a CPU with the
    vocabulary whole on each device, only its real rows: no pass masks the padding."""

    def __init__(self, wte_VD: jax.Array, vocab_size: int, dtype: jnp.dtype, fp8: bool, cap: float):
        self.vocab_size, self.dtype, self.fp8, self.cap = vocab_size, dtype, fp8, cap
        self.wte_VD = _gathered(wte_VD, dtype)
        platform = target_device().platform
        self.online = platform != "cpu"
        self.pin_dwte = pins_dwte(platform, dtype)
        if platform == "cpu" and splits("vocab") == 1:  # trim: the real rows only
            self.wte_VD = self.wte_VD[:vocab_size]
        # None: no padding columns to mask (a trimmed table, or a vocabulary that needed none)
        V = self.wte_VD.shape[0]
        self.is_real_V = jnp.arange(V) < vocab_size if V > vocab_size else None
        if fp8:
            self.wte_q_VD, self.s_wte = quantize(self.wte_VD, E4M3)
            # dx's GEMM contracts V, and cuBLASLt's fp8 GEMMs read only K-major operands: the table
            # V-minor too, once here. Pinned row-major: without the constraint, layout assignment
            # lays the transpose out as the table itself, and the fp8 rewrite then transposed it
            # in every chunk (gpt2-124m with fp8_head on one H100: 874.5 -> 872.6 ms predicted)
            self.wte_q_DV = with_layout_constraint(self.wte_q_VD.T, Layout(major_to_minor=(0, 1)))

    def _real(self, a_BtV: jax.Array, padding: float) -> jax.Array:
        """a with the vocabulary's padding columns set to `padding` (nothing to do when trimmed)."""
        return a_BtV if self.is_real_V is None else jnp.where(self.is_real_V, a_BtV, padding)

    def _exp(self, logits_BtV: jax.Array, m_Bt: jax.Array) -> jax.Array:
        """exp(logits - m) over the real vocabulary, 0 on any padding."""
        return self._real(jnp.exp(logits_BtV.astype(jnp.float32) - m_Bt[..., None]), 0.0)

    def logits(self, x_BtD: jax.Array) -> tuple[jax.Array, tuple]:
        """Logits [B, t, V] of one chunk in the compute dtype (soft-capped: fp32 from the rounded
        ones), and what the gradient GEMMs reuse. Any
        padding columns (an untrimmed table) are left as computed: the passes over them mask
        them themselves."""
        if not self.fp8:
            x_BtD = x_BtD.astype(self.dtype)
            logits_BtV = jnp.einsum("btd,vd->btv", x_BtD, self.wte_VD, preferred_element_type=self.dtype)
            saved = (x_BtD, None)
        else:
            x_q_BtD, s_x = quantize(x_BtD, E4M3)
            logits_BtV = scaled_dot("btd,vd->btv", x_q_BtD, s_x, self.wte_q_VD, self.s_wte, self.dtype)
            saved = (x_q_BtD, s_x)
        if self.cap:  # on the rounded logits, in fp32 (nanochat's order)
            logits_BtV = softcap(logits_BtV.astype(jnp.float32), self.cap)
        return shard(logits_BtV, "batch", "seq", "act_vocab"), saved

    def max_sum(self, logits_BtV: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(m, sum of exp(logits - m)) over the real vocabulary [B, t], m the maximum. On a GPU in
        one pass (`online_max_sum`); on a CPU, where that pass's two exps per element cost more
        than a second read (the default run's head: 432 -> 781 ms), the max alone."""
        if self.online:
            return online_max_sum(self._real(logits_BtV, -jnp.inf))
        m_Bt = jnp.max(self._real(logits_BtV, -jnp.inf), axis=-1).astype(jnp.float32)
        return m_Bt, None

    def lse(self, logits_BtV: jax.Array) -> jax.Array:
        """logsumexp over the real vocabulary [B, t]."""
        m_Bt, total_Bt = self.max_sum(logits_BtV)
        if total_Bt is None:
            total_Bt = jnp.sum(self._exp(logits_BtV, m_Bt), axis=-1)
        return m_Bt + jnp.log(total_Bt)

    def exp_weights(self, logits_BtV: jax.Array, m_Bt: jax.Array, total_Bt: jax.Array | None
                    ) -> tuple[jax.Array, jax.Array]:
        """(e [B, t, V] in the compute dtype, its fp32 row sums [B, t]): e = exp(logits - m) over the
        real vocabulary (0 on the padding), times the soft-cap's derivative
        d(c tanh(z/c))/dz = 1 - (capped/c)^2 when there is one, so that e / sum is dloss/dlogits
        less the label's one-hot (which `label_logits` contributes). The sum is the one `max_sum`
        gave, or (CPU) a read of e itself."""
        e_BtV = self._exp(logits_BtV, m_Bt)
        if total_Bt is None:
            total_Bt = jnp.sum(e_BtV, axis=-1)
        if self.cap:
            e_BtV = e_BtV * (1 - jnp.square(logits_BtV / self.cap))
        return shard(e_BtV.astype(self.dtype), "batch", "seq", "act_vocab"), total_Bt

    def grads(self, e_BtV: jax.Array, inv_Bt: jax.Array, x_saved: tuple, S: int) -> tuple[jax.Array, jax.Array]:
        """The gradient GEMMs of dlogits = e * inv (inv = 1 / the row sums), without writing it:
        dx [B, t, D] = (e @ wte) * inv and dwte transposed, per batch shard,
        [S, D, V] = (x * inv)^T e; fp32."""
        x_BtD, s_x = x_saved
        B, t = x_BtD.shape[:2]
        e_SbtV = shard(e_BtV.reshape(S, B // S, t, -1), "batch", None, "seq", "act_vocab")
        if not self.fp8:
            xs_BtD = (x_BtD.astype(jnp.float32) * inv_Bt[..., None]).astype(x_BtD.dtype)
            xs_SbtD = shard(xs_BtD.reshape(S, B // S, t, -1), "batch", None, "seq", "act_embed")
            dx_BtD = jnp.einsum("btv,vd->btd", e_BtV, self.wte_VD, preferred_element_type=jnp.float32)
            return dx_BtD * inv_Bt[..., None], jnp.einsum("sbtd,sbtv->sdv", xs_SbtD, e_SbtV,
                                                          preferred_element_type=jnp.float32)
        # fp8: p = e / s quantized (as before this form): the dwte GEMM contracts over rows, so
        # the row sums cannot be applied after it, and its scaled GEMM takes one scale per operand.
        p_BtV = e_BtV * inv_Bt[..., None].astype(e_BtV.dtype)
        dlogits_q_BtV, s_d = quantize(p_BtV, E5M2)  # one scale for the chunk, as x's
        dlogits_q_SbtV = shard(dlogits_q_BtV.reshape(S, B // S, t, -1), "batch", None, "seq", "act_vocab")
        x_SbtD = shard(x_BtD.reshape(S, B // S, t, -1), "batch", None, "seq", "act_embed")
        dx_BtD = scaled_dot("btv,dv->btd", dlogits_q_BtV, s_d, self.wte_q_DV, self.s_wte, jnp.float32)
        return dx_BtD, scaled_dot("sbtd,sbtv->sdv", x_SbtD, s_x, dlogits_q_SbtV, s_d, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _head_lse(x_CBtD, wte_VD, w_CBt, vocab_size, dtype, fp8, cap):
    """The logsumexp of the head's logits summed over every position, each weighted by w_CBt
    (None: 1) (the primal: no gradients)."""
    head = _Head(wte_VD, vocab_size, dtype, fp8, cap)

    @jax.named_scope("head")  # names the head's GEMMs in the compiled HLO (jaxgpt.hlo.gemm_layers)
    def body(_, xs):
        x_BtD, w_Bt = xs
        lse_Bt = head.lse(head.logits(x_BtD)[0])
        return None, jnp.sum(lse_Bt if w_Bt is None else w_Bt * lse_Bt, axis=-1)

    return jnp.sum(jax.lax.scan(body, None, (x_CBtD, w_CBt))[1])


def _head_lse_fwd(x_CBtD, wte_VD, w_CBt, vocab_size, dtype, fp8, cap):
    """The summed logsumexp and, chunk by chunk, its gradients: e = exp(logits - max) and its row
    sums s, then dx = (e @ wte) / s and dwte^T += (x / s)^T e (p = e / s); with weights w, w / s in
    place of 1 / s. Same GEMMs as autodiff, no recompute; the gradients are the residuals, so the
    backward pass only scales them."""
    B = x_CBtD.shape[1]
    S = B // _rows_per_device(B)  # batch shards: each keeps its own partial dwte through the loop
    param_VD, head = wte_VD, _Head(wte_VD, vocab_size, dtype, fp8, cap)

    @jax.named_scope("head")
    def body(dwte_SDV, xs):
        x_BtD, w_Bt = xs
        logits_BtV, x_saved = head.logits(x_BtD)
        m_Bt, total_Bt = head.max_sum(logits_BtV)
        e_BtV, total_Bt = head.exp_weights(logits_BtV, m_Bt, total_Bt)
        inv_Bt = 1 / total_Bt if w_Bt is None else w_Bt / total_Bt
        dx_BtD, dwte_chunk_SDV = head.grads(e_BtV, inv_Bt, x_saved, S)
        dwte_SDV = dwte_SDV + dwte_chunk_SDV
        lse_Bt = m_Bt + jnp.log(total_Bt)
        lse_Bt = lse_Bt if w_Bt is None else w_Bt * lse_Bt
        return shard(dwte_SDV, "batch", None, "vocab"), (jnp.sum(lse_Bt, axis=-1), dx_BtD.astype(x_BtD.dtype))

    # A [V, D] carry would be all-reduced over the batch axes in every chunk (GSPMD has no
    # partial-sum carry); one partial sum per batch shard, summed once after the loop, is one
    # reduction per step. full_like keeps wte's type (dp-varying inside the dp shard_map).
    V, D = head.wte_VD.shape
    zeros_SDV = shard(jax.lax.full_like(param_VD, 0, jnp.float32, shape=(S, D, V)), "batch", None, "vocab")
    dwte_SDV, (lse_CB, dx_CBtD) = jax.lax.scan(body, zeros_SDV, (x_CBtD, w_CBt))
    if head.pin_dwte:
        dwte_SDV = jax.lax.optimization_barrier(dwte_SDV)  # keeps the .T below out of the GEMM
    # Summed straight into the parameter's own layout: under fsdp a reduce-scatter, not an
    # all-reduce of the whole table followed by a slice. A trimmed table's padding rows get 0.
    dwte_VD = jnp.sum(dwte_SDV, axis=0).T
    dwte_VD = jnp.pad(dwte_VD, ((0, param_VD.shape[0] - V), (0, 0)))
    dwte_VD = shard(dwte_VD.astype(param_VD.dtype), "vocab", "embed")
    return jnp.sum(lse_CB), (dx_CBtD, dwte_VD, w_CBt)


def _gathered(wte_VD: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The table in the compute dtype, whole along D: under FSDP one gather per micro-batch, in
    bf16 on a GPU, before the chunk loop (not one per chunk); the gradient is the custom_vjp's."""
    return shard(wte_VD.astype(dtype), "vocab", None)


def _head_lse_bwd(vocab_size, dtype, fp8, cap, residuals, g):
    dx_CBtD, dwte_VD, w_CBt = residuals  # the weights get no gradient (they are data)
    return (g * dx_CBtD).astype(dx_CBtD.dtype), g * dwte_VD, None if w_CBt is None else jnp.zeros_like(w_CBt)


_head_lse.defvjp(_head_lse_fwd, _head_lse_bwd)

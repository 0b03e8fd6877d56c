"""The fused head and cross-entropy (trick `fused_loss`): the head's logits a chunk of positions at
a time, the gradients computed in the same pass (a `custom_vjp`, the idea of Liger's fused linear
cross-entropy).

Letters: B batch, T time, C chunks, t positions per chunk (T = C*t), D model width, V vocabulary.

Why chunks. The head's logits [B, T, V] are the largest tensor of a GPT step; materialised whole
they dominate XLA's temporaries (GPU memory) and, on a CPU, the bytes each step allocates, faults
in and frees. The reference form (model/ops.py `token_nats`) chunks too, recomputing each chunk's
logits in the backward pass; this one computes them once.

How. The loss of a position is logsumexp(logits) - logit[label]. `_head_lse` runs the head and the
logsumexp over C chunks of t positions in a `lax.scan`, and per chunk the gradients: logits -> lse
and e = exp(logits - m), dx = (e @ wte) / s, dwte^T += (x / s)^T e (p = e / s never written). The
forward pass keeps dx [C, B, t, D] and dwte [V, D] as residuals and the backward only scales them
by the incoming cotangent. `label_logits` takes logit[label] once for the whole batch, outside the
loop, as the dot product of x with the label's row of the table, looked up as the input embedding
is; autodiff gives its gradient, the one-hot part of dlogits, so the loop's gradient is the
softmax alone. Per-token weights (SFT's loss mask) scale each position's lse, label term and
gradient rows: the loss is sum(w nats) / sum(w).

Each chunk's [B, t, V] is read and written as few times as XLA allows: the logits GEMM writes it;
on a GPU the max m and the sum s of exp(logits - m) read it in one pass (`online_max_sum`), on a
CPU (where that pass's two exps per element cost more than a second read) in two; the dx and dwte
GEMMs read e. On a CPU with V whole on each device the loop takes the table's real rows only
(`_Head`), so no pass masks the padding. dwte is accumulated as [D, V] per batch shard and summed
and transposed once after the loop.

Precision follows the model: the logits GEMM accumulates in fp32 and writes the compute dtype
(bf16 on a GPU: fp32 cross-entropy of bf16-rounded logits, the label's logit rounded alike, as
nanoGPT's head under autocast, llm.c's and nanochat's compute); the max, sums, logsumexp and dwte
are fp32. With model.fp8_head the head's three GEMMs are fp8 (fp8.py `quantize`, `scaled_dot`).
With the vocabulary split over tp this is Megatron's vocab-parallel cross-entropy: each shard
reduces its own slice of the logits, and the label's row comes from the table, never from the
logits. docs/ops.md has its predicted gain; docs/benchmarks.md the CPU measurements.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxgpt.config import ModelConfig
from jaxgpt.lowering.fp8 import E4M3, E5M2, quantize, scaled_dot
from jaxgpt.model.ops import softcap
from jaxgpt.parallel.mesh import shard, splits

# model.loss_chunk=0: the most positions per chunk whose logits stay within this many rows
# (sequences x positions) per device: on a CPU 256 rows, or n_embd if more (the fastest measured,
# docs/benchmarks.md "CPU vs a PyTorch reference"); on a GPU, 8192 rows keep the head's matmuls
# large while a chunk's logits stay a small part of the step's memory.
AUTO_CHUNK_ROWS = {"cpu": 256}
AUTO_CHUNK_ROWS_ACCELERATOR = 8192


def chunk_positions(cfg: ModelConfig, rows: int, T: int, platform: str) -> int:
    """Positions per loss chunk t (a divisor of T) for `model.loss_chunk`, given the sequences each
    device holds (rows) and the platform; a loss_chunk that does not divide a shorter T (evaluation's
    length buckets) falls back to the auto rule."""
    w = _seq_ways(T, T)  # context parallelism: a chunk takes t/w positions on each device
    if cfg.loss_chunk and T % cfg.loss_chunk == 0 and cfg.loss_chunk % w == 0:
        return cfg.loss_chunk
    budget = max(AUTO_CHUNK_ROWS[platform], cfg.n_embd) if platform in AUTO_CHUNK_ROWS else AUTO_CHUNK_ROWS_ACCELERATOR
    limit = max(w, budget * w // max(1, rows))
    return max(t for t in range(w, min(T, limit) + 1, w) if T % t == 0)


def rows_per_device(B: int) -> int:
    """Sequences per device of a batch of B inside jit: B over the batch's mesh axes that are not
    already split by hand (inside the train step's dp shard_map, B is one dp shard's)."""
    return max(1, B // splits("batch"))


def label_logits(x_BTD: jax.Array, table_VD: jax.Array, labels_BT: jax.Array, ops, dtype: jnp.dtype) -> jax.Array:
    """The logit of each position's label [B, T], in fp32: the head's dot product for that one row
    of the table, read by a lookup as the input embedding's is (`ops.lookup`), so no pass over
    [B, T, V] picks it out. As the head's GEMM: operands rounded to the compute dtype, products
    summed in fp32, the sum rounded to the compute dtype (with model.fp8_head, the label's term
    keeps the compute dtype's operands); its gradient (a scatter-add of x into the label rows) is
    the lookup's."""
    rows_BTD = ops.lookup(table_VD, labels_BT, dtype)
    z_BT = jnp.sum(x_BTD.astype(dtype).astype(jnp.float32) * rows_BTD.astype(jnp.float32), axis=-1)
    return softcap(z_BT.astype(dtype).astype(jnp.float32), ops.cfg.logit_softcap)


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


def _unchunk(y_CBt: jax.Array) -> jax.Array:
    """[C, B, t] in `_chunks`' order -> [B, T]."""
    C, B, t = y_CBt.shape
    w = _seq_ways(C * t, t)
    return y_CBt.reshape(C, B, w, t // w).transpose(1, 2, 0, 3).reshape(B, C * t)


def _seq_ways(T: int, t: int) -> int:
    """The devices splitting the positions (cp) where each chunk splits evenly over them, else 1."""
    w = splits("seq")
    return w if T % w == 0 and t % w == 0 else 1


def chunked_cross_entropy(x_BTD: jax.Array, table_VD: jax.Array, labels_BT: jax.Array, ops, dtype: jnp.dtype,
                          weights_BT: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy of the head on final features x [B, T, D] (after ln_f); with per-token
    weights w [B, T], sum(w nats) / sum(w)."""
    B, T, _ = x_BTD.shape
    t = chunk_positions(ops.cfg, rows_per_device(B), T, ops.platform)
    w_CBt = None if weights_BT is None else _chunks(weights_BT.astype(jnp.float32)[..., None], t)[..., 0]
    param_VD, copy_VD = _table(table_VD)
    lse = _head_lse(_chunks(x_BTD, t), param_VD, copy_VD, w_CBt, ops, dtype)
    label_BT = label_logits(x_BTD, table_VD, labels_BT, ops, dtype)
    if weights_BT is None:
        return (lse - jnp.sum(label_BT)) / (B * T)
    w_BT = weights_BT.astype(jnp.float32)
    return (lse - jnp.sum(w_BT * label_BT)) / jnp.maximum(jnp.sum(w_BT), 1e-30)


def token_nats(x_BTD: jax.Array, table_VD: jax.Array, labels_BT: jax.Array, ops, dtype: jnp.dtype) -> jax.Array:
    """fp32 cross-entropy of every position [B, T] (evaluation: no gradient), the head applied a
    chunk at a time like `chunked_cross_entropy`."""
    B, T, _ = x_BTD.shape
    t = chunk_positions(ops.cfg, rows_per_device(B), T, ops.platform)
    head = _Head(*_table(table_VD), ops, dtype)

    @jax.named_scope("head")
    def body(_, x_BtD):
        return None, head.lse(head.logits(x_BtD)[0])

    lse_BT = _unchunk(jax.lax.scan(body, None, _chunks(x_BTD, t))[1])
    return lse_BT - label_logits(x_BTD, table_VD, labels_BT, ops, dtype)


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

    def __init__(self, wte_VD: jax.Array, copy_VD: jax.Array | None, ops, dtype: jnp.dtype):
        cfg = ops.cfg
        vocab_size, self.dtype, self.fp8, self.cap = cfg.vocab_size, dtype, cfg.fp8_head, cfg.logit_softcap
        self.wte_VD = shard(wte_VD.astype(dtype) if copy_VD is None else copy_VD, "vocab", None)  # gathered
        self.online = ops.platform != "cpu"
        self.pin_dwte = pins_dwte(ops.platform, dtype)
        if ops.platform == "cpu" and ops.tp == 1:  # trim: the real rows only
            self.wte_VD = self.wte_VD[:vocab_size]
        # None: no padding columns to mask (a trimmed table, or a vocabulary that needed none)
        V = self.wte_VD.shape[0]
        self.is_real_V = jnp.arange(V) < vocab_size if V > vocab_size else None
        if self.fp8:
            self.wte_q_VD, self.s_wte = quantize(self.wte_VD, E4M3)
            # dx's GEMM contracts V, and cuBLASLt's fp8 GEMMs read only K-major operands: the table
            # V-minor too, once here
            self.wte_q_DV = self.wte_q_VD.T

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
        than a second read, the max alone."""
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_lse(x_CBtD, wte_VD, copy_VD, w_CBt, ops, dtype):
    """The logsumexp of the head's logits summed over every position, weighted by w where given
    (the primal: no gradients). copy_VD: the table's copy in the compute dtype, or None."""
    head = _Head(wte_VD, copy_VD, ops, dtype)

    @jax.named_scope("head")  # names the head's GEMMs in the compiled HLO (jaxgpt.hlo.gemm_layers)
    def body(_, xs):
        x_BtD, w_Bt = xs
        lse_Bt = head.lse(head.logits(x_BtD)[0])
        return None, jnp.sum(lse_Bt if w_Bt is None else w_Bt * lse_Bt, axis=-1)

    return jnp.sum(jax.lax.scan(body, None, (x_CBtD, w_CBt))[1])


def _head_lse_fwd(x_CBtD, wte_VD, copy_VD, w_CBt, ops, dtype):
    """The summed logsumexp and, chunk by chunk, its gradients: e = exp(logits - max) and its row
    sums s, then dx = (e @ wte) w / s and dwte^T += (x w / s)^T e (p = e / s; w = 1 unweighted).
    Same GEMMs as autodiff, no recompute; the gradients are the residuals, so the backward pass
    only scales them."""
    B = x_CBtD.shape[1]
    S = B // rows_per_device(B)  # batch shards: each keeps its own partial dwte through the loop
    param_VD, head = wte_VD, _Head(wte_VD, copy_VD, ops, dtype)

    @jax.named_scope("head")
    def body(dwte_SDV, xs):
        x_BtD, w_Bt = xs
        logits_BtV, x_saved = head.logits(x_BtD)
        m_Bt, total_Bt = head.max_sum(logits_BtV)
        e_BtV, total_Bt = head.exp_weights(logits_BtV, m_Bt, total_Bt)
        dx_BtD, dwte_chunk_SDV = head.grads(e_BtV, (1 if w_Bt is None else w_Bt) / total_Bt, x_saved, S)
        dwte_SDV = dwte_SDV + dwte_chunk_SDV
        lse_Bt = m_Bt + jnp.log(total_Bt)
        lse_B = jnp.sum(lse_Bt if w_Bt is None else w_Bt * lse_Bt, axis=-1)
        return shard(dwte_SDV, "batch", None, "vocab"), (lse_B, dx_BtD.astype(x_BtD.dtype))

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
    return jnp.sum(lse_CB), (dx_CBtD, dwte_VD)


def _table(table_VD) -> tuple[jax.Array, jax.Array | None]:
    """(the fp32 table, its copy in the compute dtype gathered once per step, or None) of a Param,
    an array or a `Precast` (copies.py `table_copies`). Without a copy `_Head` casts the table and
    gathers it once per micro-batch, before the chunk loop."""
    from jaxgpt.lowering.linear import Precast
    w = table_VD.get_value() if hasattr(table_VD, "get_value") else table_VD
    return (w.w, w.c) if isinstance(w, Precast) else (w, None)


def _head_lse_bwd(ops, dtype, residuals, g):
    dx_CBtD, dwte_VD = residuals
    return (g * dx_CBtD).astype(dx_CBtD.dtype), g * dwte_VD, None, None  # the copy: none; the weights: data


_head_lse.defvjp(_head_lse_fwd, _head_lse_bwd)

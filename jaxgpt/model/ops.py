"""The ops every layer computes through, in their reference form: the maths in plain jnp,
differentiated by autodiff, on any device.

A layer never computes a linear map, a norm, an activation, the residual add, attention, the
embedding lookup or the loss itself: it calls `self.ops`, handed to the model when it is built.
That is an `Ops` (these forms), or a lowering with the same methods (jaxgpt/lowering/: epilogue
GEMMs, hand-written backward passes, fp8, flash attention kernels), chosen once per run where the
train step is built (`model.ops`). A lowering must compute what these compute; tests/test_ops.py
holds every one of its forms to them. The arguments a lowering needs beyond the maths are names:
which linear a weight is (`linear`'s name), what a norm's output feeds (`norm`'s before), which
projection a residual add follows (`residual`'s after).

Letters: B batch, T time, D width, H heads, G key/value heads, K head dim, V vocabulary, C chunks,
t positions per chunk.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgpt.config import ModelConfig
from jaxgpt.model.documents import Documents, visible
from jaxgpt.parallel.context import to_device_order
from jaxgpt.parallel.mesh import shard

_TINY = 1e-30


@dataclasses.dataclass(frozen=True)
class Ops:
    """The reference forms for a model of `cfg`. Static: a field of every layer that calls it."""
    cfg: ModelConfig

    def linear(self, name: str, spec: str, x, kernel, bias=None, parts: tuple[str, ...] | None = None):
        """einsum(spec, x, W) + b in x's dtype (the compute dtype), under the named scope `name`
        (a kind of jaxgpt.hlo.BLOCK_LINEARS: the compiled HLO's GEMMs carry it). kernel and bias:
        the layer's Params or arrays (bias None: none), b broadcast over the output's last axes.
        parts: the names of the slices of W along its 'qkv' axis (('q', 'k', 'v')): the tuple of
        their outputs."""
        with jax.named_scope(name):
            y = jnp.einsum(spec, x, kernel[...].astype(x.dtype))
            y = y if bias is None else y + bias[...].astype(y.dtype)
        if parts is None:
            return y
        at = _output_axis(spec, kernel.logical_axes.index("qkv"))
        return tuple(jax.lax.index_in_dim(y, i, at, keepdims=False) for i in range(len(parts)))

    def norm(self, x, scale, bias, rms: bool, before: str | None = None):
        """LayerNorm (rms=False) or RMSNorm of x over its last axis, in fp32, returned in x's dtype:
        (x - mean) / sqrt(var + eps) * scale + bias, eps model.norm_eps (RMS: no mean, no bias);
        scale, bias None where the norm has none. before: what reads the output ('attn', 'mlp',
        'moe', 'head', 'scores')."""
        x32 = x.astype(jnp.float32)
        centred = x32 if rms else x32 - x32.mean(-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.square(centred).mean(-1, keepdims=True) + self.cfg.norm_eps)
        y = y if scale is None else y * scale
        y = y if bias is None else y + bias
        return y.astype(x.dtype)

    def activation(self, kind: str, h, gate=None, into: str = "mlp_out"):
        """model.mlp's nonlinearity of h = x W_in (and gate = x W_gate): GPT-2's tanh GELU, relu(h)^2,
        or silu(gate) h (SwiGLU). into: the linear kind that reads the output."""
        if kind == "swiglu":
            return jax.nn.silu(gate) * h
        if kind == "relu2":
            return jnp.square(jax.nn.relu(h))
        return jax.nn.gelu(h, approximate=True)

    def residual(self, x, y, after: str | None = None):
        """x + y, a block's residual add; after: the linear kind that wrote y (None: no GEMM's)."""
        return x + y

    def embed(self, table_VD, ids_BT, dtype, wpe_TD=None, pos=0, cp: int = 1):
        """The rows of the [V, D] table (a Param or an array) for ids [B, T], plus with learned
        positions wpe's rows pos.. (in context parallelism's device order of `cp` devices), in
        `dtype`. The table is read whole along D (fsdp's shards gathered) and split over tp along
        V, as Megatron's vocab-parallel embedding."""
        x_BTD = shard(table_VD[...], "vocab", None)[ids_BT]
        return (x_BTD if wpe_TD is None else x_BTD + positions(wpe_TD[...], pos, ids_BT.shape[1], cp)).astype(dtype)

    def attention(self, q_BTHK, k_BTGK, v_BTGK, docs: Documents | None = None):
        """softmax(q k^T / sqrt(K) + mask) v, [B, T, H, K], query head h reading key/value head
        h // (H/G). Causal; with `docs`, each query sees the keys of its own document up to its
        position, positions in any order (context parallelism's: K and V are read whole)."""
        q_BTHK, k_BTGK, v_BTGK = (shard(a, "batch", "seq", "act_heads", None) for a in (q_BTHK, k_BTGK, v_BTGK))
        if docs is None:
            return jax.nn.dot_product_attention(q_BTHK, k_BTGK, v_BTGK, is_causal=True, implementation="xla")
        whole = ("batch", None, "act_heads", None)
        k_BTGK, v_BTGK = shard(k_BTGK, *whole), shard(v_BTGK, *whole)
        return jax.nn.dot_product_attention(q_BTHK, k_BTGK, v_BTGK, mask=visible(docs, docs.at_T)[:, None],
                                            implementation="xla")

    def cached_attention(self, q_BTHK, k_BTGK, v_BTGK, kv, pos, docs: Documents | None = None):
        """Decoding: the T new positions from `pos` on attend to the cache kv (k, v [B, S, G, K])
        holding their own keys and values too; (out [B, T, H, K], the updated kv)."""
        k_BSGK = jax.lax.dynamic_update_slice(kv.k, k_BTGK.astype(kv.k.dtype), (0, pos, 0, 0))
        v_BSGK = jax.lax.dynamic_update_slice(kv.v, v_BTGK.astype(kv.v.dtype), (0, pos, 0, 0))
        T, S, dt = q_BTHK.shape[1], k_BSGK.shape[1], q_BTHK.dtype
        if docs is None:  # causal, the slots not written yet hidden
            mask_B1TS = (jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None])[None, None]
        else:
            mask_B1TS = visible(docs, jnp.arange(S, dtype=jnp.int32))[:, None]
        out = jax.nn.dot_product_attention(q_BTHK, k_BSGK.astype(dt), v_BSGK.astype(dt), mask=mask_B1TS,
                                           implementation="xla")
        return out, type(kv)(k_BSGK, v_BSGK)

    def token_nats(self, x_BTD, table_VD, labels_BT, dtype):
        """Cross-entropy in nats of each position's label [B, T], fp32: logsumexp(logits) -
        logit[label], the logits the head's (x @ table^T, the table a Param or an array, operands in
        `dtype`, rounded to it; soft-capped at model.logit_softcap; the vocabulary's padding rows excluded). A chunk of
        `loss_chunk` positions at a time, each recomputed for the backward pass, so that only one
        chunk's [B, t, V] logits exist at a time."""
        B, T, D = x_BTD.shape
        t, table_VD, cfg = self.loss_chunk(B, T), table_VD[...].astype(dtype), self.cfg

        @jax.checkpoint
        def nats(x_BtD, labels_Bt):
            z_BtV = jnp.einsum("btd,vd->btv", x_BtD.astype(dtype), table_VD, preferred_element_type=dtype)
            z_BtV = softcap(z_BtV.astype(jnp.float32), cfg.logit_softcap)
            vocab_V = jnp.arange(z_BtV.shape[-1])
            z_BtV = jnp.where(vocab_V < cfg.vocab_size, z_BtV, -jnp.inf)
            label_Bt = jnp.sum(jnp.where(vocab_V == labels_Bt[..., None], z_BtV, 0.0), axis=-1)
            return jax.nn.logsumexp(z_BtV, axis=-1) - label_Bt

        x_CBtD = x_BTD.reshape(B, T // t, t, D).swapaxes(0, 1)
        labels_CBt = labels_BT.reshape(B, T // t, t).swapaxes(0, 1)
        return jax.lax.map(lambda c: nats(*c), (x_CBtD, labels_CBt)).swapaxes(0, 1).reshape(B, T)

    def cross_entropy(self, x_BTD, table_VD, labels_BT, dtype, weights_BT=None):
        """The training loss of final features x [B, T, D] (after ln_f): `token_nats` averaged over
        the positions, or with per-token weights w [B, T] (SFT's loss mask) sum(w nats) / sum(w)
        (0 where every weight is 0)."""
        nats_BT = self.token_nats(x_BTD, table_VD, labels_BT, dtype)
        if weights_BT is None:
            return jnp.mean(nats_BT)
        w_BT = weights_BT.astype(jnp.float32)
        return jnp.sum(w_BT * nats_BT) / jnp.maximum(jnp.sum(w_BT), _TINY)

    def loss_chunk(self, B: int, T: int) -> int:
        """Positions per chunk of the loss (model.loss_chunk where it divides T, else all of them)."""
        return self.cfg.loss_chunk if self.cfg.loss_chunk and T % self.cfg.loss_chunk == 0 else T


def positions(wpe_TD: jax.Array, pos, T: int, cp: int = 1) -> jax.Array:
    """wpe's rows for positions pos .. pos+T-1, in the device order of `cp` devices (pos 0)."""
    return jax.lax.dynamic_slice_in_dim(wpe_TD, pos, T) if cp == 1 else to_device_order(wpe_TD, cp, axis=0)


def softcap(logits: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(logits / cap) (model.logit_softcap); the identity for cap = 0."""
    return cap * jnp.tanh(logits / cap) if cap else logits


def _output_axis(spec: str, weight_axis: int) -> int:
    """Where einsum(spec)'s output holds the weight's axis `weight_axis`."""
    ins, out = spec.replace(" ", "").split("->")
    return out.index(ins.split(",")[1][weight_axis])


"""GPT-2 in Flax NNX, with GPT-2's parameter layout and logical sharding names on every weight.

Letters: B batch, T time, D model width, H heads, K head dim (D = H*K), F MLP width (4D),
V padded vocabulary, L layers.

Layout. Parameters are stored so that a plain reshape gives Hugging Face GPT-2's tensors
(its `Conv1D` weights are [in, out]):

    ours                               HF GPT-2 (per layer i)
    wte            [V, D]              wte.weight [50257, D] (drop the padding rows)
    wpe            [T, D]              wpe.weight
    blocks.attn.c_attn.kernel [L, D, 3, H, K]   h.i.attn.c_attn.weight [D, 3D]
    blocks.attn.c_proj.kernel [L, H, K, D]      h.i.attn.c_proj.weight [D, D]
    blocks.mlp.c_fc.kernel    [L, D, F]         h.i.mlp.c_fc.weight    [D, F]
    blocks.mlp.c_proj.kernel  [L, F, D]         h.i.mlp.c_proj.weight  [F, D]

QKV keeps its heads as a separate axis so that tensor parallelism splits whole heads (each tp
shard holds q, k and v of its own heads); a flat [D, 3D] split by columns would hand one device
all of q. Blocks are created with `nnx.vmap` and run with `nnx.scan`, so the compiled program
holds one block however deep the model is.

Mixture of Experts (model.moe_experts = E > 0, jaxgpt/moe.py). Every model.moe_every-th block
(N) replaces its MLP by E experts and a router. So that the program still holds one scanned block
per kind, an MoE model stacks n_layer / N groups (`groups`, an `MoEGroup` each: N-1 dense blocks
stacked under `dense` and one MoE block `moe`) and scans over the groups, the dense blocks of a
group by an inner scan. A dense model (E = 0) keeps `blocks` exactly as above, so its parameter
tree, checkpoints and Hugging Face export are unchanged; an MoE model has no GPT-2 counterpart.

Options. `model.fp8` runs the four linear layers of each block through `fp8.fp8_einsum`;
`model.remat` recomputes each block's activations in the backward pass under a
`jax.checkpoint` policy (memory for FLOPs); `model.attention` picks the kernel (attention.py).

Precision. Parameters are fp32. Matmuls run in the compute dtype (bf16 on GPU); LayerNorm,
softmax (see attention.py) and the logits are fp32. The vocabulary is padded to a multiple of
128 for fast matmuls and even tp splits; padded logits are set to -inf so they get no probability
and no gradient.

Initialisation follows GPT-2: normal(0.02) for weights and embeddings, zero biases, unit
LayerNorm scales, and normal(0.02 / sqrt(2L)) for the two projections that write into the
residual stream.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgpt.attention import causal_attention, select_kernel
from jaxgpt.config import ModelConfig
from jaxgpt.fp8 import linear
from jaxgpt.gpu.target import target_device
from jaxgpt.mesh import shard
from jaxgpt.moe import MoEStats, moe_mlp

STD = 0.02

# model.remat -> what the backward pass may keep from the forward pass of a block
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def compute_dtype(name: str) -> jnp.dtype:
    """model.dtype -> the dtype matmuls run in ('auto': bf16 on GPU/TPU, fp32 on CPU)."""
    if name == "auto":
        return jnp.bfloat16 if target_device().platform in ("gpu", "tpu") else jnp.float32
    return jnp.dtype(name)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float | None) -> nnx.Param:
    """A parameter with its logical axes; std=None -> zeros, std=0 -> ones (LayerNorm scale)."""
    if std is None:
        value = jnp.zeros(shape, jnp.float32)
    elif std == 0:
        value = jnp.ones(shape, jnp.float32)
    else:
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, logical_axes=axes)


class KV(NamedTuple):
    """One layer's cached keys and values, [B, S, H, K] (S = seq_len slots)."""
    k: jax.Array
    v: jax.Array


class KVCache(NamedTuple):
    """Keys and values of every layer, [L, B, S, H, K], and the next position to write."""
    k: jax.Array
    v: jax.Array
    pos: jax.Array  # int32 scalar

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, dtype: jnp.dtype) -> KVCache:
        shape = (cfg.n_layer, batch, cfg.seq_len, cfg.n_head, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


class LayerNorm(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.scale = _param(rngs, (d,), ("embed",), 0)
        self.bias = _param(rngs, (d,), ("embed",), None)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x = x_BTD.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...] + self.bias[...]
        return y.astype(x_BTD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        H, K, D = cfg.n_head, cfg.head_dim, cfg.n_embd
        self.c_attn_kernel = _param(rngs, (D, 3, H, K), ("embed", "qkv", "heads", "head_dim"), STD)
        self.c_attn_bias = _param(rngs, (3, H, K), ("qkv", "heads", "head_dim"), None)
        self.c_proj_kernel = _param(rngs, (H, K, D), ("heads", "head_dim", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = _param(rngs, (D,), ("embed",), None)
        self.impl, _ = select_kernel(cfg.attention, compute_dtype(cfg.dtype), cfg.head_dim)
        self.fp8 = cfg.fp8

    def __call__(self, x_BTD: jax.Array, kv: KV | None = None, pos: jax.Array | None = None):
        """Training: x -> y. Decoding (kv given): the T new positions start at `pos`; they attend
        to the cache [B, S, H, K] updated with their own keys/values; returns (y, new kv)."""
        dt = x_BTD.dtype
        qkv_BT3HK = linear("qkv", "btd,dshk->btshk", x_BTD, self.c_attn_kernel[...].astype(dt), self.fp8)
        qkv_BT3HK = qkv_BT3HK + self.c_attn_bias[...].astype(dt)
        qkv_BT3HK = shard(qkv_BT3HK, "batch", "seq", None, "act_heads", None)
        q_BTHK, k_BTHK, v_BTHK = (qkv_BT3HK[:, :, i] for i in range(3))
        if kv is None:
            out_BTHK = causal_attention(q_BTHK, k_BTHK, v_BTHK, impl=self.impl)
        else:
            k_BSHK = jax.lax.dynamic_update_slice(kv.k, k_BTHK.astype(kv.k.dtype), (0, pos, 0, 0))
            v_BSHK = jax.lax.dynamic_update_slice(kv.v, v_BTHK.astype(kv.v.dtype), (0, pos, 0, 0))
            T, S = x_BTD.shape[1], k_BSHK.shape[1]
            visible_TS = jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None]  # causal, and unwritten slots hidden
            out_BTHK = jax.nn.dot_product_attention(q_BTHK, k_BSHK.astype(dt), v_BSHK.astype(dt),
                                                    mask=visible_TS[None, None], implementation="xla")
            kv = KV(k_BSHK, v_BSHK)
        y_BTD = linear("attn_out", "bthk,hkd->btd", out_BTHK, self.c_proj_kernel[...].astype(dt), self.fp8)
        y_BTD = y_BTD + self.c_proj_bias[...].astype(dt)
        return y_BTD if kv is None else (y_BTD, kv)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.n_embd, 4 * cfg.n_embd
        self.c_fc_kernel = _param(rngs, (D, F), ("embed", "mlp"), STD)
        self.c_fc_bias = _param(rngs, (F,), ("mlp",), None)
        self.c_proj_kernel = _param(rngs, (F, D), ("mlp", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = _param(rngs, (D,), ("embed",), None)
        self.fp8 = cfg.fp8

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dt = x_BTD.dtype
        h_BTF = linear("mlp_in", "btd,df->btf", x_BTD, self.c_fc_kernel[...].astype(dt), self.fp8) + self.c_fc_bias[...].astype(dt)
        h_BTF = shard(jax.nn.gelu(h_BTF, approximate=True), "batch", "seq", "act_mlp")
        return linear("mlp_out", "btf,fd->btd", h_BTF, self.c_proj_kernel[...].astype(dt), self.fp8) + self.c_proj_bias[...].astype(dt)


class MoE(nnx.Module):
    """E expert MLPs behind a top-k router (jaxgpt/moe.py); the experts' weights carry `experts`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F, E = cfg.n_embd, 4 * cfg.n_embd, cfg.moe_experts
        self.cfg = cfg
        self.router_kernel = _param(rngs, (D, E), ("embed", "router"), STD)
        self.c_fc_kernel = _param(rngs, (E, D, F), ("experts", "embed", "mlp"), STD)
        self.c_fc_bias = _param(rngs, (E, F), ("experts", "mlp"), None)
        self.c_proj_kernel = _param(rngs, (E, F, D), ("experts", "mlp", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = _param(rngs, (E, D), ("experts", "embed"), None)
        self.fp8 = cfg.fp8

    def __call__(self, x_BTD: jax.Array, drop: bool = True) -> tuple[jax.Array, MoEStats]:
        return moe_mlp(x_BTD, self.router_kernel[...], self.c_fc_kernel[...], self.c_fc_bias[...],
                       self.c_proj_kernel[...], self.c_proj_bias[...], top_k=self.cfg.moe_top_k,
                       capacity_factor=self.cfg.moe_capacity_factor, drop=drop, fp8=self.fp8)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        self.ln_1 = LayerNorm(cfg.n_embd, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln_2 = LayerNorm(cfg.n_embd, rngs)
        self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, rngs)

    def __call__(self, x_BTD: jax.Array, kv: KV | None = None, pos: jax.Array | None = None):
        """x -> x (dense, training); with kv: (x, kv). An MoE block appends its MoEStats: (x, stats)
        or (x, kv, stats)."""
        if kv is None:
            x_BTD = x_BTD + self.attn(self.ln_1(x_BTD))
        else:
            y_BTD, kv = self.attn(self.ln_1(x_BTD), kv, pos)
            x_BTD = x_BTD + y_BTD
        stats = None
        if isinstance(self.mlp, MoE):
            y_BTD, stats = self.mlp(self.ln_2(x_BTD), drop=kv is None)
        else:
            y_BTD = self.mlp(self.ln_2(x_BTD))
        x_BTD = shard(x_BTD + y_BTD, "batch", "seq", "act_embed")
        if stats is None:
            return x_BTD if kv is None else (x_BTD, kv)
        return (x_BTD, stats) if kv is None else (x_BTD, kv, stats)


class MoEGroup(nnx.Module):
    """model.moe_every = N consecutive blocks: N-1 dense ones (stacked, scanned) and an MoE block
    last. An MoE model stacks G = n_layer / N of these and scans over them (GPT docstring)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=cfg.moe_every - 1)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_dense(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.dense = make_dense(rngs) if cfg.moe_every > 1 else None  # one assignment: NNX fixes its kind
        self.moe = Block(cfg, rngs, moe=True)

    def __call__(self, x_BTD: jax.Array, apply_block, kv: KV | None = None, pos: jax.Array | None = None):
        """Training: (x, MoEStats). Decoding (kv: this group's [N, B, S, H, K] cache): (x, kv, stats)."""
        if kv is None:
            if self.dense is not None:
                @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
                def run_dense(x_BTD: jax.Array, block: Block) -> jax.Array:
                    return apply_block(block, x_BTD)

                x_BTD = run_dense(x_BTD, self.dense)
            return apply_block(self.moe, x_BTD)
        parts = []
        if self.dense is not None:
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
            def run_dense_cached(x_BTD: jax.Array, block: Block, kv: KV):
                return block(x_BTD, kv, pos)

            x_BTD, dense_kv = run_dense_cached(x_BTD, self.dense, KV(kv.k[:-1], kv.v[:-1]))
            parts.append(dense_kv)
        x_BTD, moe_kv, stats = self.moe(x_BTD, KV(kv.k[-1], kv.v[-1]), pos)
        parts.append(KV(moe_kv.k[None], moe_kv.v[None]))
        return x_BTD, KV(*(jnp.concatenate(p, axis=0) for p in zip(*parts))), stats


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = _param(rngs, (cfg.padded_vocab, cfg.n_embd), ("vocab", "embed"), STD)
        self.wpe = _param(rngs, (cfg.seq_len, cfg.n_embd), ("pos", "embed"), STD)

        if cfg.moe_experts:
            @nnx.split_rngs(splits=cfg.n_layer // cfg.moe_every)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_groups(rngs: nnx.Rngs) -> MoEGroup:
                return MoEGroup(cfg, rngs)

            self.groups = make_groups(rngs)
        else:
            @nnx.split_rngs(splits=cfg.n_layer)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs)

            self.blocks = make_blocks(rngs)
        self.ln_f = LayerNorm(cfg.n_embd, rngs)

    def __call__(self, tokens_BT: jax.Array, dtype: jnp.dtype = jnp.float32, cache: KVCache | None = None,
                 features_only: bool = False, with_moe_stats: bool = False):
        """Token ids [B, T] -> fp32 logits [B, T, V] (padded vocabulary; padding at -inf).
        With a cache (sampling), the tokens sit at positions cache.pos.. and (logits, cache) returns.
        `features_only`: the final LayerNorm's output [B, T, D] instead, for the chunked loss
        (jaxgpt/loss.py), which applies the head a chunk at a time. `with_moe_stats` (training, MoE
        models): (output, MoEStats averaged over the MoE blocks)."""
        T = tokens_BT.shape[1]
        x_BTD = self.embed(tokens_BT, dtype, 0 if cache is None else cache.pos)
        if cache is not None:
            if self.cfg.moe_experts:
                x_BTD, kv = self._run_groups_cached(x_BTD, KV(cache.k, cache.v), cache.pos)
            else:
                @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
                def run_cached(x_BTD: jax.Array, block: Block, kv: KV):
                    return block(x_BTD, kv, cache.pos)

                x_BTD, kv = run_cached(x_BTD, self.blocks, KV(cache.k, cache.v))
            return self._logits(x_BTD, dtype), KVCache(kv.k, kv.v, cache.pos + T)

        x_BTD, stats = self.run_blocks(x_BTD)
        out = self.ln_f(x_BTD) if features_only else self._logits(x_BTD, dtype)
        if with_moe_stats:
            zero = jnp.zeros((), jnp.float32)
            return out, MoEStats(zero, zero, zero) if stats is None else stats
        return out

    def embed(self, tokens_BT: jax.Array, dtype: jnp.dtype, pos: jax.Array | int = 0) -> jax.Array:
        """Token ids [B, T] at positions pos.. -> the first block's input [B, T, D] in `dtype`."""
        # The lookup reads whole rows: gather the table's fsdp shards first (ZeRO-3), keep vocab on tp.
        wte_VD = shard(self.wte[...], "vocab", None)
        wpe_TD = jax.lax.dynamic_slice_in_dim(self.wpe[...], pos, tokens_BT.shape[1])
        x_BTD = (wte_VD[tokens_BT] + wpe_TD).astype(dtype)
        return shard(x_BTD, "batch", "seq", "act_embed")

    def run_blocks(self, x_BTD: jax.Array) -> tuple[jax.Array, MoEStats | None]:
        """The stacked blocks (training, no cache), however many this module holds: all of them, or
        one pipeline stage's (jaxgpt/pipeline.py). Returns (x, MoEStats averaged over the MoE
        blocks, or None for a dense model)."""
        def apply_block(block: Block, x_BTD: jax.Array) -> jax.Array:
            return block(x_BTD)

        if self.cfg.remat == "auto":
            raise ValueError("model.remat=auto must be resolved before the model runs (jaxgpt.remat.resolve)")
        if self.cfg.remat != "none":
            apply_block = nnx.remat(apply_block, policy=REMAT_POLICIES[self.cfg.remat])

        if self.cfg.moe_experts:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
            def run_groups(x_BTD: jax.Array, group: MoEGroup):
                return group(x_BTD, apply_block)

            x_BTD, stats_G = run_groups(x_BTD, self.groups)
            return x_BTD, MoEStats(*(jnp.mean(s_G) for s_G in stats_G))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run_stack(x_BTD: jax.Array, block: Block) -> jax.Array:
            return apply_block(block, x_BTD)

        return run_stack(x_BTD, self.blocks), None

    def _run_groups_cached(self, x_BTD: jax.Array, kv: KV, pos: jax.Array) -> tuple[jax.Array, KV]:
        """The cached pass of an MoE model: the [L, ...] cache viewed as [G, N, ...] groups of blocks."""
        G, N = self.cfg.n_layer // self.cfg.moe_every, self.cfg.moe_every

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
        def run_cached(x_BTD: jax.Array, group: MoEGroup, kv: KV):
            x_BTD, kv, _ = group(x_BTD, None, kv, pos)
            return x_BTD, kv

        x_BTD, kv = run_cached(x_BTD, self.groups, KV(*(a.reshape(G, N, *a.shape[1:]) for a in kv)))
        return x_BTD, KV(*(a.reshape(G * N, *a.shape[2:]) for a in kv))

    def _logits(self, x_BTD: jax.Array, dtype: jnp.dtype) -> jax.Array:
        return head_logits(self.ln_f(x_BTD), self.wte[...], self.cfg.vocab_size, dtype)


def head_logits(x_BTD: jax.Array, wte_VD: jax.Array, vocab_size: int, dtype: jnp.dtype) -> jax.Array:
    """The tied output head: normalised features [B, T, D] -> fp32 logits [B, T, V], the
    vocabulary padding at -inf (no probability, no gradient)."""
    logits_BTV = jnp.einsum("btd,vd->btv", x_BTD, wte_VD.astype(dtype), preferred_element_type=jnp.float32)
    logits_BTV = shard(logits_BTV, "batch", "seq", "act_vocab")
    is_real_V = jnp.arange(wte_VD.shape[0]) < vocab_size
    return jnp.where(is_real_V, logits_BTV, -jnp.inf)


def param_count(cfg: ModelConfig, include_position: bool = True, active: bool = False) -> int:
    """Parameters of the model (padded vocabulary included), computed without building it.
    `active`: an MoE block counts only the moe_top_k experts a token passes through (and its router)."""
    D, F, L = cfg.n_embd, 4 * cfg.n_embd, cfg.n_layer
    mlp = (D * F + F) + (F * D + D)
    per_block = 2 * 2 * D + (3 * D * D + 3 * D) + (D * D + D) + mlp
    moe_blocks = L // cfg.moe_every if cfg.moe_experts else 0
    experts = cfg.moe_top_k if active else cfg.moe_experts
    moe_extra = moe_blocks * (D * cfg.moe_experts + (experts - 1) * mlp)  # router, and experts beyond one MLP
    return cfg.padded_vocab * D + (cfg.seq_len * D if include_position else 0) + L * per_block + 2 * D + moe_extra

"""GPT-2 in Flax NNX, with GPT-2's parameter layout and logical sharding names on every weight,
and the modern decoder's choices as options.

Letters: B batch, T time, D model width, H heads, G key/value heads, K head dim (D = H*K),
F MLP width (4D by default), V padded vocabulary, L layers.

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

Beyond GPT-2 (each key defaults to GPT-2's choice, which keeps the tree above exactly):
    model.norm=rmsnorm         RMSNorm instead of LayerNorm (`norm_scale=false`: no parameters)
    model.position=rope        rotary q/k (attention.rope) instead of `wpe`, which is then absent
    model.mlp=swiglu|relu2     swiglu adds `mlp.c_gate_kernel` [L, D, F]; F is `model.mlp_hidden`
    model.n_kv_head=G < H      grouped-query attention: `attn.q_kernel` [L, D, H, K] and
                               `attn.kv_kernel` [L, D, 2, G, K] replace `c_attn_kernel`; the KV
                               cache holds G heads
    model.qk_norm              `attn.q_norm`, `attn.k_norm` (RMS over K, before RoPE)
    model.tie_embeddings=false a separate output head `lm_head` [V, D]
    model.bias=false           no biases in linears or norms
    model.logit_softcap=c      logits c * tanh(logits / c)
A Llama-style block: x + attn(rmsnorm(x)) and x + swiglu(rmsnorm(x)), the same pre-norm residual.

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

from jaxgpt.attention import causal_attention, rope, select_kernel
from jaxgpt.config import ModelConfig
from jaxgpt.fp8 import linear
from jaxgpt.gpu.target import target_device
from jaxgpt.mesh import shard
from jaxgpt.moe import Experts, MoEStats, activate, moe_mlp

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


def _plus(y: jax.Array, bias: nnx.Param | None) -> jax.Array:
    return y if bias is None else y + bias[...].astype(y.dtype)


class Norm(nnx.Module):
    """LayerNorm (GPT-2) or RMSNorm over the last axis, in fp32, eps 1e-5. A learned scale unless
    model.norm_scale=false; a bias for LayerNorm with model.bias. `axis` names the normalised
    dimension ('embed', or 'head_dim' for qk-norm, which is always RMS)."""

    def __init__(self, cfg: ModelConfig, d: int, rngs: nnx.Rngs, axis: str = "embed", rms: bool | None = None):
        self.rms = cfg.norm == "rmsnorm" if rms is None else rms
        self.scale = _param(rngs, (d,), (axis,), 0) if cfg.norm_scale else None
        self.bias = _param(rngs, (d,), (axis,), None) if cfg.bias and not self.rms else None

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x = x_BTD.astype(jnp.float32)
        if self.rms:
            y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + 1e-5)
        else:
            mean = x.mean(-1, keepdims=True)
            y = (x - mean) * jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + 1e-5)
        y = y if self.scale is None else y * self.scale[...]
        return _plus(y, self.bias).astype(x_BTD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        H, G, K, D = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.n_embd
        bias = cfg.bias
        if G == H:  # multi-head: GPT-2's fused kernel, its tree unchanged
            self.c_attn_kernel = _param(rngs, (D, 3, H, K), ("embed", "qkv", "heads", "head_dim"), STD)
            self.c_attn_bias = _param(rngs, (3, H, K), ("qkv", "heads", "head_dim"), None) if bias else None
        else:  # grouped-query: q of H heads, k and v of G; each tp shard holds whole groups
            self.q_kernel = _param(rngs, (D, H, K), ("embed", "heads", "head_dim"), STD)
            self.q_bias = _param(rngs, (H, K), ("heads", "head_dim"), None) if bias else None
            self.kv_kernel = _param(rngs, (D, 2, G, K), ("embed", "qkv", "kv_heads", "head_dim"), STD)
            self.kv_bias = _param(rngs, (2, G, K), ("qkv", "kv_heads", "head_dim"), None) if bias else None
        self.grouped = G != H
        if cfg.qk_norm:
            self.q_norm = Norm(cfg, K, rngs, axis="head_dim", rms=True)
            self.k_norm = Norm(cfg, K, rngs, axis="head_dim", rms=True)
        self.qk_norm = cfg.qk_norm
        self.rope_theta = cfg.rope_theta if cfg.position == "rope" else None
        self.c_proj_kernel = _param(rngs, (H, K, D), ("heads", "head_dim", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = _param(rngs, (D,), ("embed",), None) if bias else None
        self.impl, _ = select_kernel(cfg.attention, compute_dtype(cfg.dtype), cfg.head_dim)
        self.fp8 = cfg.fp8

    def _qkv(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, T, H, K], k and v [B, T, G, K]; one GEMM (multi-head) or two (grouped), all named qkv."""
        dt = x_BTD.dtype
        if not self.grouped:
            qkv_BT3HK = _plus(linear("qkv", "btd,dshk->btshk", x_BTD, self.c_attn_kernel[...].astype(dt), self.fp8),
                              self.c_attn_bias)
            qkv_BT3HK = shard(qkv_BT3HK, "batch", "seq", None, "act_heads", None)
            return tuple(qkv_BT3HK[:, :, i] for i in range(3))
        q_BTHK = _plus(linear("qkv", "btd,dhk->bthk", x_BTD, self.q_kernel[...].astype(dt), self.fp8), self.q_bias)
        kv_BT2GK = _plus(linear("qkv", "btd,dsgk->btsgk", x_BTD, self.kv_kernel[...].astype(dt), self.fp8),
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
        y_BTD = linear("attn_out", "bthk,hkd->btd", out_BTHK, self.c_proj_kernel[...].astype(dt), self.fp8)
        y_BTD = _plus(y_BTD, self.c_proj_bias)
        return y_BTD if kv is None else (y_BTD, kv)


class MLP(nnx.Module):
    """model.mlp: gelu or relu2 (in, out), or swiglu (in, gate, out: three GEMMs, the gate's named mlp_gate)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.n_embd, cfg.mlp_width
        self.c_fc_kernel = _param(rngs, (D, F), ("embed", "mlp"), STD)
        self.c_fc_bias = _param(rngs, (F,), ("mlp",), None) if cfg.bias else None
        if cfg.mlp == "swiglu":
            self.c_gate_kernel = _param(rngs, (D, F), ("embed", "mlp"), STD)
            self.c_gate_bias = _param(rngs, (F,), ("mlp",), None) if cfg.bias else None
        self.c_proj_kernel = _param(rngs, (F, D), ("mlp", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = _param(rngs, (D,), ("embed",), None) if cfg.bias else None
        self.kind, self.fp8 = cfg.mlp, cfg.fp8

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dt = x_BTD.dtype
        h_BTF = _plus(linear("mlp_in", "btd,df->btf", x_BTD, self.c_fc_kernel[...].astype(dt), self.fp8), self.c_fc_bias)
        gate_BTF = None
        if self.kind == "swiglu":
            gate_BTF = _plus(linear("mlp_gate", "btd,df->btf", x_BTD, self.c_gate_kernel[...].astype(dt), self.fp8),
                             self.c_gate_bias)
        h_BTF = shard(activate(self.kind, h_BTF, gate_BTF), "batch", "seq", "act_mlp")
        return _plus(linear("mlp_out", "btf,fd->btd", h_BTF, self.c_proj_kernel[...].astype(dt), self.fp8),
                     self.c_proj_bias)


class MoE(nnx.Module):
    """E expert MLPs (of model.mlp's kind) behind a top-k router (jaxgpt/moe.py); the experts'
    weights carry `experts`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F, E = cfg.n_embd, cfg.mlp_width, cfg.moe_experts
        self.cfg = cfg
        self.router_kernel = _param(rngs, (D, E), ("embed", "router"), STD)
        self.c_fc_kernel = _param(rngs, (E, D, F), ("experts", "embed", "mlp"), STD)
        self.c_fc_bias = _param(rngs, (E, F), ("experts", "mlp"), None) if cfg.bias else None
        if cfg.mlp == "swiglu":
            self.c_gate_kernel = _param(rngs, (E, D, F), ("experts", "embed", "mlp"), STD)
            self.c_gate_bias = _param(rngs, (E, F), ("experts", "mlp"), None) if cfg.bias else None
        self.c_proj_kernel = _param(rngs, (E, F, D), ("experts", "mlp", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = _param(rngs, (E, D), ("experts", "embed"), None) if cfg.bias else None
        self.fp8 = cfg.fp8

    def __call__(self, x_BTD: jax.Array, drop: bool = True) -> tuple[jax.Array, MoEStats]:
        value = lambda p: None if p is None else p[...]  # noqa: E731
        swiglu = self.cfg.mlp == "swiglu"
        experts = Experts(self.c_fc_kernel[...], value(self.c_fc_bias),
                          self.c_gate_kernel[...] if swiglu else None, value(self.c_gate_bias) if swiglu else None,
                          self.c_proj_kernel[...], value(self.c_proj_bias))
        return moe_mlp(x_BTD, self.router_kernel[...], experts, mlp=self.cfg.mlp, top_k=self.cfg.moe_top_k,
                       capacity_factor=self.cfg.moe_capacity_factor, drop=drop, fp8=self.fp8)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        self.ln_1 = Norm(cfg, cfg.n_embd, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln_2 = Norm(cfg, cfg.n_embd, rngs)
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
        if cfg.position == "learned":
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
        self.ln_f = Norm(cfg, cfg.n_embd, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.padded_vocab, cfg.n_embd), ("vocab", "embed"), STD)

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
        x_BTD = wte_VD[tokens_BT]
        if self.cfg.position == "learned":
            x_BTD = x_BTD + jax.lax.dynamic_slice_in_dim(self.wpe[...], pos, tokens_BT.shape[1])
        x_BTD = x_BTD.astype(dtype)
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
        head_VD = self.wte[...] if self.cfg.tie_embeddings else self.lm_head[...]
        return head_logits(self.ln_f(x_BTD), head_VD, self.cfg.vocab_size, dtype, self.cfg.logit_softcap)


def head_table(params: dict) -> jax.Array:
    """The output head's [V, D] table in a parameter dict: `lm_head` when untied, else `wte`."""
    return params["lm_head"] if "lm_head" in params else params["wte"]


def softcap(logits: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(logits / cap) (model.logit_softcap); the identity for cap = 0."""
    return cap * jnp.tanh(logits / cap) if cap else logits


def head_logits(x_BTD: jax.Array, wte_VD: jax.Array, vocab_size: int, dtype: jnp.dtype, cap: float = 0.0) -> jax.Array:
    """The output head: normalised features [B, T, D] -> fp32 logits [B, T, V], soft-capped at `cap`
    (0: off), the vocabulary padding at -inf (no probability, no gradient)."""
    logits_BTV = jnp.einsum("btd,vd->btv", x_BTD, wte_VD.astype(dtype), preferred_element_type=jnp.float32)
    logits_BTV = shard(softcap(logits_BTV, cap), "batch", "seq", "act_vocab")
    is_real_V = jnp.arange(wte_VD.shape[0]) < vocab_size
    return jnp.where(is_real_V, logits_BTV, -jnp.inf)


def param_count(cfg: ModelConfig, include_position: bool = True, active: bool = False) -> int:
    """Parameters of the model (padded vocabulary included), computed without building it.
    `active`: an MoE block counts only the moe_top_k experts a token passes through (and its router)."""
    D, F, L, K, b = cfg.n_embd, cfg.mlp_width, cfg.n_layer, cfg.head_dim, int(cfg.bias)
    mats = 3 if cfg.mlp == "swiglu" else 2
    mlp = mats * D * F + b * ((mats - 1) * F + D)
    norm = int(cfg.norm_scale) + b * (cfg.norm == "layernorm")  # parameters per normalised feature
    qkv = (D + b) * (D + 2 * cfg.kv_heads * K)
    per_block = 2 * norm * D + qkv + (D * D + b * D) + mlp + (2 * K * int(cfg.norm_scale) if cfg.qk_norm else 0)
    moe_blocks = L // cfg.moe_every if cfg.moe_experts else 0
    experts = cfg.moe_top_k if active else cfg.moe_experts
    moe_extra = moe_blocks * (D * cfg.moe_experts + (experts - 1) * mlp)  # router, and experts beyond one MLP
    position = cfg.seq_len * D if include_position and cfg.position == "learned" else 0
    head = 0 if cfg.tie_embeddings else cfg.padded_vocab * D
    return cfg.padded_vocab * D + head + position + L * per_block + norm * D + moe_extra

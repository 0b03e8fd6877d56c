"""Transformer blocks: pre-norm residual x + attn(norm(x)), x + mlp(norm(x)); the MoE variant and
the groups an MoE model stacks (gpt.py's docstring: why groups)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgpt.config import ModelConfig
from jaxgpt.model.attention import KV, Attention
from jaxgpt.model.documents import Documents
from jaxgpt.model.layers import MLP, STD, Norm, param, value
from jaxgpt.model.moe import Experts, MoEStats, moe_mlp
from jaxgpt.model.ops import Ops
from jaxgpt.parallel.mesh import shard


class MoE(nnx.Module):
    """E routed expert MLPs (of model.mlp's kind, model.moe_mlp_hidden wide) behind a top-k router
    (jaxgpt/model/moe.py); the experts' weights carry `experts`. With model.moe_shared_experts = S
    every token also passes through `shared`, one dense MLP S expert widths wide (S shared experts
    as one matmul). With model.moe_balance=bias, `router_bias` [E] steers the choice of experts: it
    sits among the parameters so that checkpoints, sampling and evaluation carry it, but it has no
    gradient and no optimizer state; the train step moves it (jaxgpt/step.py, `balance`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ops: Ops):
        D, F, E = cfg.n_embd, cfg.expert_width, cfg.moe_experts
        self.cfg, self.ops = cfg, ops
        self.router_kernel = param(rngs, (D, E), ("embed", "router"), STD)
        self.c_fc_kernel = param(rngs, (E, D, F), ("experts", "embed", "mlp"), STD)
        self.c_fc_bias = param(rngs, (E, F), ("experts", "mlp"), None) if cfg.bias else None
        if cfg.mlp == "swiglu":
            self.c_gate_kernel = param(rngs, (E, D, F), ("experts", "embed", "mlp"), STD)
            self.c_gate_bias = param(rngs, (E, F), ("experts", "mlp"), None) if cfg.bias else None
        self.c_proj_kernel = param(rngs, (E, F, D), ("experts", "mlp", "embed"), STD / math.sqrt(2 * cfg.n_layer))
        self.c_proj_bias = param(rngs, (E, D), ("experts", "embed"), None) if cfg.bias else None
        shared = dataclasses.replace(cfg, mlp_hidden=cfg.moe_shared_experts * F)
        self.shared = MLP(shared, rngs, ops) if cfg.moe_shared_experts else None
        self.router_bias = param(rngs, (E,), ("router",), None) if cfg.moe_balance == "bias" else None

    def __call__(self, x_BTD: jax.Array, drop: bool = True) -> tuple[jax.Array, MoEStats]:
        swiglu = self.cfg.mlp == "swiglu"
        experts = Experts(self.c_fc_kernel[...], value(self.c_fc_bias),
                          self.c_gate_kernel[...] if swiglu else None, value(self.c_gate_bias) if swiglu else None,
                          self.c_proj_kernel[...], value(self.c_proj_bias))
        y_BTD, stats = moe_mlp(x_BTD, self.router_kernel[...], experts, self.ops, mlp=self.cfg.mlp,
                               top_k=self.cfg.moe_top_k, capacity_factor=self.cfg.moe_capacity_factor, drop=drop,
                               dispatch=self.cfg.moe_dispatch, bias_E=value(self.router_bias),
                               norm_topk=self.cfg.moe_norm_topk)
        if self.shared is not None:
            y_BTD = y_BTD + self.shared(x_BTD)
        return y_BTD, stats


class Block(nnx.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)) (or the MoE layer's)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ops: Ops, moe: bool = False):
        self.ln_1 = Norm(cfg, cfg.n_embd, rngs, ops, before="attn")
        self.attn = Attention(cfg, rngs, ops)
        self.ln_2 = Norm(cfg, cfg.n_embd, rngs, ops, before="moe" if moe else "mlp")
        self.mlp = MoE(cfg, rngs, ops) if moe else MLP(cfg, rngs, ops)
        self.ops = ops

    def __call__(self, x_BTD: jax.Array, kv: KV | None = None, pos: jax.Array | None = None,
                 docs: Documents | None = None):
        """x -> x (dense, training); with kv: (x, kv). An MoE block appends its MoEStats: (x, stats)
        or (x, kv, stats). `docs`: model.document_mask's documents (jaxgpt/model/documents.py)."""
        if kv is None:
            y_BTD = self.attn(self.ln_1(x_BTD), docs=docs)
        else:
            y_BTD, kv = self.attn(self.ln_1(x_BTD), kv, pos, docs)
        x_BTD = self.ops.residual(x_BTD, y_BTD, "attn_out")
        stats = None
        if isinstance(self.mlp, MoE):
            y_BTD, stats = self.mlp(self.ln_2(x_BTD), drop=kv is None)
        else:
            y_BTD = self.mlp(self.ln_2(x_BTD))
        x_BTD = self.ops.residual(x_BTD, y_BTD, None if stats is not None else "mlp_out")
        x_BTD = shard(x_BTD, "batch", "seq", "act_embed")
        if stats is None:
            return x_BTD if kv is None else (x_BTD, kv)
        return (x_BTD, stats) if kv is None else (x_BTD, kv, stats)


class MoEGroup(nnx.Module):
    """model.moe_every = N consecutive blocks: N-1 dense ones (stacked, scanned) and an MoE block
    last. An MoE model stacks G = n_layer / N of these and scans over them (GPT docstring)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ops: Ops):
        @nnx.split_rngs(splits=cfg.moe_every - 1)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_dense(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs, ops)

        self.dense = make_dense(rngs) if cfg.moe_every > 1 else None  # one assignment: NNX fixes its kind
        self.moe = Block(cfg, rngs, ops, moe=True)

    def __call__(self, x_BTD: jax.Array, apply_block, kv: KV | None = None, pos: jax.Array | None = None,
                 unroll: int | bool = 1, docs: Documents | None = None):
        """Training: (x, MoEStats), x as `apply_block` takes it (GPT.run_blocks: [B*T, D] rows
        unless cp splits the sequence); `unroll`: the dense blocks' scan's (model.scan_layers).
        Decoding (kv: this group's [N, B, S, H, K] cache): (x, kv, stats)."""
        if kv is None:
            if self.dense is not None:
                @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, unroll=unroll)
                def run_dense(x_BTD: jax.Array, block: Block) -> jax.Array:
                    return apply_block(block, x_BTD)

                x_BTD = run_dense(x_BTD, self.dense)
            return apply_block(self.moe, x_BTD)
        parts = []
        if self.dense is not None:
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
            def run_dense_cached(x_BTD: jax.Array, block: Block, kv: KV):
                return block(x_BTD, kv, pos, docs)

            x_BTD, dense_kv = run_dense_cached(x_BTD, self.dense, KV(kv.k[:-1], kv.v[:-1]))
            parts.append(dense_kv)
        x_BTD, moe_kv, stats = self.moe(x_BTD, KV(kv.k[-1], kv.v[-1]), pos, docs)
        parts.append(KV(moe_kv.k[None], moe_kv.v[None]))
        return x_BTD, KV(*(jnp.concatenate(p, axis=0) for p in zip(*parts))), stats

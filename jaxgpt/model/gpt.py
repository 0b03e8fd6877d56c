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

Mixture of Experts (model.moe_experts = E > 0, jaxgpt/model/moe.py). Every model.moe_every-th block
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

Options. `model.remat` recomputes each block's activations in the backward pass under a
`jax.checkpoint` policy (remat.py: memory for FLOPs); `model.scan_layers=false` unrolls the scan
over the stacked blocks (the parameters stay stacked). Scanned, every activation the backward pass
keeps from a block is written into an [L, ...] stack and read back out of it, a copy each way per
layer and per micro-batch; unrolled, XLA keeps each as its own buffer, and compiles take longer
(docs/benchmarks.md). How each op computes (its kernel, fp8, fused forms: model.ops,
model.attention, model.fp8) is the lowering's, handed in as `ops` (ops.py). The package
docstring lists what each file holds.

Precision. Parameters are fp32. Matmuls run in the compute dtype (bf16 on GPU); LayerNorm,
softmax (see attention.py) and the logits are fp32. The vocabulary is padded to a multiple of
128 for fast matmuls and even tp splits; padded logits are set to -inf so they get no probability
and no gradient.

Initialisation follows GPT-2: normal(0.02) for weights and embeddings, zero biases, unit
LayerNorm scales, and normal(0.02 / sqrt(2L)) for the two projections that write into the
residual stream.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgpt.config import ModelConfig
from jaxgpt.model.attention import KV, KVCache
from jaxgpt.model.blocks import Block, MoEGroup
from jaxgpt.model.documents import Documents, documents, reordered, whole_windows
from jaxgpt.model.layers import STD, Norm, param
from jaxgpt.model.moe import MoEStats
from jaxgpt.model.ops import Ops, softcap
from jaxgpt.model.remat import REMAT_POLICIES
from jaxgpt.parallel.context import balanced_ways, to_device_order, to_window_order, ways as cp_ways
from jaxgpt.parallel.mesh import shard


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ops: Ops | None = None):
        """ops: how each op computes (model/ops.py); default its reference forms."""
        self.cfg, self.ops = cfg, Ops(cfg) if ops is None else ops
        ops = self.ops
        self.wte = param(rngs, (cfg.padded_vocab, cfg.n_embd), ("vocab", "embed"), STD)
        if cfg.position == "learned":
            self.wpe = param(rngs, (cfg.seq_len, cfg.n_embd), ("pos", "embed"), STD)

        if cfg.moe_experts:
            @nnx.split_rngs(splits=cfg.n_layer // cfg.moe_every)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_groups(rngs: nnx.Rngs) -> MoEGroup:
                return MoEGroup(cfg, rngs, ops)

            self.groups = make_groups(rngs)
        else:
            @nnx.split_rngs(splits=cfg.n_layer)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs, ops)

            self.blocks = make_blocks(rngs)
        self.ln_f = Norm(cfg, cfg.n_embd, rngs, ops, before="head")
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.padded_vocab, cfg.n_embd), ("vocab", "embed"), STD)

    def __call__(self, tokens_BT: jax.Array, dtype: jnp.dtype = jnp.float32, cache: KVCache | None = None,
                 features_only: bool = False, with_moe_stats: bool = False):
        """Token ids [B, T] -> fp32 logits [B, T, V] (padded vocabulary; padding at -inf).
        With a cache (sampling), the tokens sit at positions cache.pos.. and (the last position's
        logits [B, 1, V], cache) returns: a prefill never holds [B, T, V].
        `features_only`: the final norm's output [B, T, D] instead, for `loss`, which applies the
        head a chunk at a time. `with_moe_stats` (training, MoE models): (output, MoEStats averaged
        over the MoE blocks)."""
        T = tokens_BT.shape[1]
        x_BTD = self.embed(tokens_BT, dtype, 0 if cache is None else cache.pos)
        docs = self.documents(tokens_BT, cache)
        if cache is not None:
            if self.cfg.moe_experts:
                x_BTD, kv = self._run_groups_cached(x_BTD, KV(cache.k, cache.v), cache.pos, docs)
            else:
                @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
                def run_cached(x_BTD: jax.Array, block: Block, kv: KV):
                    return block(x_BTD, kv, cache.pos, docs)

                x_BTD, kv = run_cached(x_BTD, self.blocks, KV(cache.k, cache.v))
            doc_start = cache.doc_start if docs is None else docs.start_BT[:, -1]
            return self._logits(x_BTD[:, -1:], dtype), KVCache(kv.k, kv.v, cache.pos + T, doc_start)

        x_BTD, stats = self.run_blocks(x_BTD, docs)
        x_BTD = to_window_order(x_BTD, balanced_ways(T))  # from context parallelism's order, if any
        out = self.ln_f(x_BTD) if features_only else self._logits(x_BTD, dtype)
        if with_moe_stats:
            zero = jnp.zeros((), jnp.float32)
            return out, MoEStats(zero, zero, zero, jnp.zeros((0, 0))) if stats is None else stats
        return out

    def embed(self, tokens_BT: jax.Array, dtype: jnp.dtype, pos: jax.Array | int = 0) -> jax.Array:
        """Token ids [B, T] at positions pos.. -> the first block's input [B, T, D] in `dtype`;
        training under context parallelism, in its device order (jaxgpt/parallel/context.py)."""
        cp = balanced_ways(tokens_BT.shape[1]) if isinstance(pos, int) and pos == 0 else 1
        wpe = self.wpe if self.cfg.position == "learned" else None
        x_BTD = self.ops.embed(self.wte, to_device_order(tokens_BT, cp), dtype, wpe, pos, cp)
        return shard(x_BTD, "batch", "seq", "act_embed")

    def documents(self, tokens_BT: jax.Array, cache: KVCache | None = None) -> Documents | None:
        """Where each position's document starts (model.document_mask; jaxgpt/model/documents.py),
        continuing the cache's latest document when decoding; None without document masking.
        Training under context parallelism: always, in its device order (the mask reads them)."""
        if cache is not None:
            return (documents(tokens_BT, cache.pos, cache.doc_start, self.cfg.document_token)
                    if self.cfg.document_mask else None)
        cp = balanced_ways(tokens_BT.shape[1])
        if self.cfg.document_mask:
            return reordered(documents(tokens_BT, separator=self.cfg.document_token), cp)
        return reordered(whole_windows(*tokens_BT.shape), cp) if cp_ways() > 1 else None

    def run_blocks(self, x_BTD: jax.Array, docs: Documents | None = None) -> tuple[jax.Array, MoEStats | None]:
        """The stacked blocks (training, no cache), however many this module holds: all of them, or
        one pipeline stage's (jaxgpt/parallel/pipeline.py). Returns (x, MoEStats averaged over the MoE
        blocks, or None for a dense model). `docs`: model.document_mask's documents of x's rows."""
        def apply_block(block: Block, x_BTD: jax.Array):
            return block(x_BTD, docs=docs)  # a dense block's x; an MoE block's (x, stats)

        if self.cfg.remat == "auto":
            raise ValueError("model.remat=auto must be resolved before the model runs (jaxgpt.remat.resolve)")
        if self.cfg.remat != "none":
            apply_block = nnx.remat(apply_block, policy=REMAT_POLICIES[self.cfg.remat])
        unroll = 1 if self.cfg.scan_layers else True  # True: all of them

        if self.cfg.moe_experts:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), unroll=unroll)
            def run_groups(x: jax.Array, group: MoEGroup):
                return group(x, apply_block, unroll=unroll)

            x_BTD, stats_G = run_groups(x_BTD, self.groups)
            return x_BTD, MoEStats(*(jnp.mean(s_G) for s_G in stats_G[:3]), stats_G.load)  # load: [G, E]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, unroll=unroll)
        def run_stack(x: jax.Array, block: Block) -> jax.Array:
            return apply_block(block, x)

        return run_stack(x_BTD, self.blocks), None

    def _run_groups_cached(self, x_BTD: jax.Array, kv: KV, pos: jax.Array,
                           docs: Documents | None) -> tuple[jax.Array, KV]:
        """The cached pass of an MoE model: the [L, ...] cache viewed as [G, N, ...] groups of blocks."""
        G, N = self.cfg.n_layer // self.cfg.moe_every, self.cfg.moe_every

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
        def run_cached(x_BTD: jax.Array, group: MoEGroup, kv: KV):
            x_BTD, kv, _ = group(x_BTD, None, kv, pos, docs=docs)
            return x_BTD, kv

        x_BTD, kv = run_cached(x_BTD, self.groups, KV(*(a.reshape(G, N, *a.shape[1:]) for a in kv)))
        return x_BTD, KV(*(a.reshape(G * N, *a.shape[2:]) for a in kv))

    def loss(self, x_BTD: jax.Array, labels_BT: jax.Array, dtype: jnp.dtype,
             weights_BT: jax.Array | None = None) -> jax.Array:
        """Next-token cross-entropy of the final features (`features_only`) against labels [B, T],
        fp32: the mean over the positions, or with per-token weights sum(w nats) / sum(w)."""
        return self.ops.cross_entropy(x_BTD, self._head(), labels_BT, dtype, weights_BT)

    def token_nats(self, x_BTD: jax.Array, labels_BT: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """The cross-entropy of each position's label [B, T] (evaluation), fp32."""
        return self.ops.token_nats(x_BTD, self._head(), labels_BT, dtype)

    def _head(self) -> jax.Array:
        return self.wte if self.cfg.tie_embeddings else self.lm_head

    def _logits(self, x_BTD: jax.Array, dtype: jnp.dtype) -> jax.Array:
        return head_logits(self.ln_f(x_BTD), self._head()[...], self.cfg.vocab_size, dtype, self.cfg.logit_softcap)


def head_logits(x_BTD: jax.Array, wte_VD: jax.Array, vocab_size: int, dtype: jnp.dtype, cap: float = 0.0) -> jax.Array:
    """The output head: normalised features [B, T, D] -> fp32 logits [B, T, V], soft-capped at `cap`
    (0: off), the vocabulary padding at -inf (no probability, no gradient)."""
    logits_BTV = jnp.einsum("btd,vd->btv", x_BTD, wte_VD.astype(dtype), preferred_element_type=jnp.float32)
    logits_BTV = shard(softcap(logits_BTV, cap), "batch", "seq", "act_vocab")
    is_real_V = jnp.arange(wte_VD.shape[0]) < vocab_size
    return jnp.where(is_real_V, logits_BTV, -jnp.inf)


def param_count(cfg: ModelConfig, include_position: bool = True, active: bool = False) -> int:
    """Parameters of the model (padded vocabulary included), computed without building it.
    `active`: an MoE block counts only the moe_top_k experts a token passes through (and its router
    and shared experts). moe_balance=bias's routing bias is no parameter (no gradient): not counted."""
    D, F, L, K, b = cfg.n_embd, cfg.mlp_width, cfg.n_layer, cfg.head_dim, int(cfg.bias)
    mats = 3 if cfg.mlp == "swiglu" else 2
    mlp = mats * D * F + b * ((mats - 1) * F + D)
    norm = int(cfg.norm_scale) + b * (cfg.norm == "layernorm")  # parameters per normalised feature
    qkv = (D + b) * (cfg.n_head * K + 2 * cfg.kv_heads * K)
    attn_out = cfg.n_head * K * D + b * D
    per_block = 2 * norm * D + qkv + attn_out + mlp + (2 * K * int(cfg.norm_scale) if cfg.qk_norm else 0)
    moe_blocks = L // cfg.moe_every if cfg.moe_experts else 0
    experts = cfg.moe_top_k if active else cfg.moe_experts
    Fe, S = cfg.expert_width, cfg.moe_shared_experts
    expert = mats * D * Fe + b * ((mats - 1) * Fe + D)
    shared = mats * D * S * Fe + b * ((mats - 1) * S * Fe + D) if S else 0
    moe_extra = moe_blocks * (D * cfg.moe_experts + experts * expert + shared - mlp)  # in place of the dense MLP
    position = cfg.seq_len * D if include_position and cfg.position == "learned" else 0
    head = 0 if cfg.tie_embeddings else cfg.padded_vocab * D
    return cfg.padded_vocab * D + head + position + L * per_block + norm * D + moe_extra

"""Train state, its shardings, and the jitted train and eval steps.

The state is a plain pytree (`TrainState`: step, parameters as a nested dict, optax state) so that
Orbax and `jit` see ordinary arrays. Its shardings are derived, never written by hand:

    parameters       each Param's logical axes (jaxgpt/model/) -> mesh.RULES -> NamedSharding
    optimizer state  `optax.tree_map_params`: every moment takes its parameter's sharding,
                     scalars (the step count) are replicated

The state is created directly in its final sharding (`jit(init, out_shardings=...)`), so no device
ever holds the full model under FSDP. Random init is the same on every layout because JAX's
threefry is partitionable: a value depends on its index, not on which device draws it.

The train step is jitted with explicit in/out shardings and donates the old state, so parameters
and optimizer moments are updated in place. Gradient accumulation scans over micro-batches inside
the same step: micro-batch a holds rows a, a+A, a+2A, ... of the global batch, which keeps each
device's rows on that device (a reshape of the sharded batch axis, no data movement).

One gradient all-reduce per step, not per micro-batch
-----------------------------------------------------
Left to GSPMD, the gradient of a dp-replicated parameter is all-reduced where it is produced,
inside the accumulation loop: A micro-batches cost A all-reduces (gpt2-124m at dp=8 with A=16
moved 9,955 MiB per step instead of ~500). So when dp > 1 the step runs under a `shard_map` that
is manual over `dp` (and ep, and pp, below; fsdp and tp stay automatic inside): each dp shard differentiates with
respect to a dp-*varying* copy of the parameters (`pcast`), so its gradient stays local while it
sums its A micro-batches, and one `pmean` over dp follows the loop. Under fsdp the gradient is
still reduce-scattered per micro-batch over the fsdp axis: ZeRO-3 keeps only a shard of it, as
PyTorch FSDP does. Inside the `shard_map` the activation constraints drop `dp` (`mesh.shard`).

ep (> 1) is manual too, for the same reason: left to GSPMD, the gradients of everything ep
replicates were all-reduced over ep once per micro-batch. Each ep shard holds its E/ep experts
(their spec names ep) and a varying copy of the rest; the MoE layers move tokens by explicit
all-to-alls (jaxgpt/model/moe.py, dropless.py). After the loop the replicated gradients take one
pmean over dp x ep, and an expert's gradient, which the all-to-alls' transposes already summed
over the ep shards' losses, only a pmean over dp and a division by ep (the loss is their mean).

moe_balance=bias: the routing bias sits among the parameters (jaxgpt/model/balance.py) but is
split off before differentiation and the optimizer, and moved after the update from the load.

Pipeline parallelism (pp > 1)
-----------------------------
The same `shard_map` is then manual over pp as well (`manual_layout`): the stacked blocks come in
split over pp (each device its stage's layers), everything else replicated, and the objective is
`pipeline_objective`, which runs the micro-batches through the stages (jaxgpt/parallel/pipeline.py) and
returns this stage's share of the loss. The parameters are made varying over pp too, so after
the accumulation a psum over pp adds up the partial gradients of what every stage uses
(embeddings, ln_f), while a stage's own blocks need no pp reduction. The eval step runs the same
pipeline under a `shard_map` manual over pp only.

Supervised fine-tuning's loss mask
----------------------------------
A fine-tuning batch is a pair (tokens [B, T+1], weights [B, T]): weight 1 where the label is an
assistant token, 0 elsewhere (jaxgpt/chat/); a pretraining batch is the tokens alone, so its
program is the one it always was. The loss is the global sum(w * nats) / sum(w), the same on every
layout: the step scales the weights once to a mean of 1 over the whole batch, and each part (a
micro-batch, a dp/ep shard, a pipeline stage's rows) adds its mean of w * nats over its positions
(`token_loss`), which the reductions above average like the unmasked loss. The fused loss gives a
position of weight 0 exactly zero gradient (jaxgpt/lowering/loss.py).

Evaluation returns sums, not only the mean: the cross-entropy of every val position and, for bits
per byte, the nats and UTF-8 bytes of the positions whose label is text (`val_sums`); every stage
sums the rows whose head it computes and a psum over pp adds them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt import tokenizer
from jaxgpt.config import Config, ModelConfig, pipeline_microbatches
from jaxgpt.copies import copies_once_per_step, from_gemm_pieces, gemm_pieces, table_copies, with_copies
from jaxgpt.lowering import Lowering, choose
from jaxgpt.model import GPT, REMAT_POLICIES
from jaxgpt.model.balance import move_balance, split_balance, with_balance
from jaxgpt.model.documents import window_stats
from jaxgpt.model.moe import MoEStats
from jaxgpt.optim import lr_schedule, make_optimizer
from jaxgpt.parallel import pipeline
from jaxgpt.parallel.context import balanced_ways, to_window_order
from jaxgpt.parallel.mesh import named, shard

MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped")  # what an MoE model adds to the train metrics
DOCUMENT_METRICS = ("docs_per_window", "masked_pairs")  # what model.document_mask adds (model/documents.py)


def _document_metrics(batch_BT1: jax.Array, cfg: ModelConfig) -> dict[str, jax.Array]:
    """model.document_mask's window statistics of the inputs (documents.window_stats); {} without it."""
    return window_stats(batch_BT1[:, :-1], cfg.document_token) if cfg.document_mask else {}


def split_batch(batch) -> tuple[jax.Array, jax.Array | None]:
    """(tokens [B, T+1], loss weights [B, T] or None) of a batch: a pretraining batch is its tokens,
    a fine-tuning one the pair (module docstring)."""
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch, None)


def token_loss(model: GPT, x_BTD: jax.Array, labels_BT: jax.Array, weights_BT: jax.Array | None,
               dtype: jnp.dtype) -> jax.Array:
    """The cross-entropy of these rows as the step averages it: the mean over their positions, or
    with weights (scaled by the step to a mean of 1 over the whole batch) the mean of w * nats."""
    if weights_BT is None:
        return model.loss(x_BTD, labels_BT, dtype)
    share = jnp.sum(weights_BT.astype(jnp.float32)) / weights_BT.size  # sum(w * nats) / sum(w), times this
    return model.loss(x_BTD, labels_BT, dtype, weights_BT) * share


def normalized_weights(batch):
    """A fine-tuning batch with its weights scaled to a mean of 1 (all zero stays zero); a
    pretraining batch as it is."""
    tokens_BT1, w_BT = split_batch(batch)
    if w_BT is None:
        return batch
    total = jnp.sum(w_BT.astype(jnp.float32))
    return tokens_BT1, w_BT.astype(jnp.float32) * (w_BT.size / jnp.where(total > 0, total, 1.0))


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict[str, Any]
    opt_state: optax.OptState


def abstract_model(cfg: Config, ops: Lowering | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph (computing through `ops`, jaxgpt/lowering/; default the reference forms)
    and its parameters as shapes, without allocating anything."""
    model = nnx.eval_shape(lambda: GPT(cfg.model, nnx.Rngs(cfg.train.seed), ops))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert not jax.tree.leaves(rest), "the model holds non-parameter state the train state would lose"
    return graphdef, params


def param_logical_axes(params: nnx.State) -> dict[str, Any]:
    """Nested dict of logical-axis tuples, one per parameter (stacked blocks gain a 'layers' axis)."""
    out: dict[str, Any] = {}
    for path, var in nnx.to_flat_state(params):
        axes = tuple(var.get_metadata()["logical_axes"])
        if path[0] in ("blocks", "groups"):  # created under nnx.vmap: a leading axis per stacking level
            axes = ("layers",) + ("sublayers",) * (var.ndim - len(axes) - 1) + axes
        assert len(axes) == var.ndim, (path, axes, var.shape)
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = axes
    return out


class Setup(NamedTuple):
    """Everything the loop needs that is fixed for a run."""
    graphdef: nnx.GraphDef  # the model, computing through `ops`
    optimizer: optax.GradientTransformation
    shardings: TrainState  # a NamedSharding per leaf of the state
    logical_axes: dict[str, Any]
    ops: Lowering  # how the ops compute on this mesh (jaxgpt/lowering/, model.ops), chosen once here


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def make_setup(cfg: Config, mesh: Mesh, ops: Lowering | None = None) -> Setup:
    """ops: the lowering (default: `choose`'s for cfg on mesh)."""
    ops = choose(cfg.model, mesh) if ops is None else ops
    graphdef, abstract_params = abstract_model(cfg, ops)
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    axes = param_logical_axes(abstract_params)
    param_sh = jax.tree.map(lambda a: named(mesh, a), axes, is_leaf=_is_axes)
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(optimizer.init, split_balance(nnx.to_pure_dict(abstract_params))[0])
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, split_balance(param_sh)[0],
                                   transform_non_params=lambda _: replicated)
    return Setup(graphdef, optimizer, TrainState(replicated, param_sh, opt_sh), axes, ops)


# XLA:CPU spends most of compiling the init in LLVM's -O2 passes over the unrolled threefry rounds
# of every parameter's draw on some CPUs: 2.0-3.1 s for the tests' tiny model on a 2-core AMD EPYC,
# longer than its train step; at -O1 0.5-0.8 s (on a 2-core Intel Xeon 0.5-0.7 s at either level).
# The parameters are bit for bit the same and drawn as fast (tiny, default and gpt2-124m, on both
# CPUs). Only the CPU's init: GPU builds are left as XLA has them. A level the user set in XLA_FLAGS
# is theirs for the init too (the tests compile everything at -O0, tests/conftest.py: the tiny init in
# 0.9 CPU s instead of 1.5 on a 2-core Xeon; its parameters then differ from -O1's by an ulp at most).
_CPU_INIT_OPTIONS = {"xla_backend_optimization_level": 1}


def _init_options(on_cpu: bool) -> dict | None:
    return _CPU_INIT_OPTIONS if on_cpu and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") else None


def _init(cfg: Config, setup: Setup) -> Callable[[], TrainState]:
    def init() -> TrainState:
        model = GPT(cfg.model, nnx.Rngs(cfg.train.seed))
        params = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
        return TrainState(jnp.zeros((), jnp.int32), params, setup.optimizer.init(split_balance(params)[0]))
    return init


def init_state(cfg: Config, setup: Setup) -> TrainState:
    on_cpu = setup.shardings.step.mesh.devices.flat[0].platform == "cpu"
    return jax.jit(_init(cfg, setup), out_shardings=setup.shardings,
                   compiler_options=_init_options(on_cpu))()


def abstract_state(cfg: Config, setup: Setup) -> TrainState:
    """The train state as ShapeDtypeStructs carrying their shardings (restore targets, AOT compiles)."""
    shapes = jax.eval_shape(_init(cfg, setup))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, setup.shardings)


def loss_fn(params: dict, graphdef: nnx.GraphDef, batch_BT1, cfg: ModelConfig, dtype: jnp.dtype) -> jax.Array:
    """Mean next-token cross-entropy (fp32) of windows [B, T+1] (or, a fine-tuning batch, the
    weighted mean), the head applied a chunk at a time."""
    return objective_fn(params, graphdef, normalized_weights(batch_BT1), cfg, dtype)[1]["loss"]


def objective_fn(params: dict, graphdef: nnx.GraphDef, batch, cfg: ModelConfig,
                 dtype: jnp.dtype) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(objective, metrics) of windows [B, T+1]. The objective is the mean next-token cross-entropy
    (fp32, the head applied a chunk at a time), plus for an MoE model the weighted load-balancing
    and router z-losses; metrics['loss'] is the cross-entropy alone (comparable with val_loss and
    dense runs), and an MoE model adds moe_aux_loss, moe_z_loss, moe_dropped and moe_load, each
    MoE layer's share of assignments per expert [G, E] (jaxgpt/model/moe.py). A fine-tuning batch
    (tokens, weights) weighs each position's cross-entropy (`token_loss`)."""
    model = nnx.merge(graphdef, params)
    batch_BT1, weights_BT = split_batch(batch)
    if not cfg.moe_experts:
        x_BTD = model(batch_BT1[:, :-1], dtype, features_only=True)
        loss = token_loss(model, x_BTD, batch_BT1[:, 1:], weights_BT, dtype)
        return loss, {"loss": loss, **_document_metrics(batch_BT1, cfg)}
    x_BTD, stats = model(batch_BT1[:, :-1], dtype, features_only=True, with_moe_stats=True)
    loss = token_loss(model, x_BTD, batch_BT1[:, 1:], weights_BT, dtype)
    aux_coef = cfg.moe_aux_coef if cfg.moe_balance == "aux" else 0.0  # bias: the aux loss is only logged
    objective = loss + aux_coef * stats.aux + cfg.moe_z_coef * stats.z
    return objective, {"loss": loss, **dict(zip(MOE_METRICS, stats[:3], strict=True)), "moe_load": stats.load,
                       **_document_metrics(batch_BT1, cfg)}


def pipeline_objective(params: dict, graphdef: nnx.GraphDef, batch, cfg: Config, dtype: jnp.dtype,
                       stages: int, microbatches: int, block_axes: dict, bubble_fill: float = 0.0
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """objective_fn for one pipeline stage, inside a shard_map manual over pp (jaxgpt/parallel/pipeline.py):
    the stacked blocks hold this stage's chunks, and the result is its share of the objective and
    metrics (the loss of the M/pp micro-batches whose head it computes, scaled by 1/pp; an MoE
    model's losses of its own chunks): the psum over pp is objective_fn's value.
    `block_axes`: the blocks' logical axes, for pipeline.gather_once."""
    x_BTD, labels_BT, weights_BT, stats = pipeline_features(params, graphdef, batch, cfg, dtype, stages,
                                                            microbatches, block_axes, bubble_fill)
    m, batch_BT1 = cfg.model, split_batch(batch)[0]
    loss = token_loss(nnx.merge(graphdef, params), x_BTD, labels_BT, weights_BT, dtype) / stages
    # every stage holds the whole batch: its share of the psum over pp, as the loss's
    metrics = {"loss": loss, **{k: v / stages for k, v in _document_metrics(batch_BT1, m).items()}}
    if stats is None:
        return loss, metrics
    aux_coef = m.moe_aux_coef if m.moe_balance == "aux" else 0.0  # as objective_fn
    objective = loss + aux_coef * stats.aux + m.moe_z_coef * stats.z
    return objective, metrics | dict(zip(MOE_METRICS, stats[:3], strict=True)) | {"moe_load": stats.load}


def stack_key(cfg: ModelConfig) -> str:
    """Where the model keeps its stacked layers: 'blocks', or an MoE model's 'groups' (jaxgpt/model/gpt.py)."""
    return "groups" if cfg.moe_experts else "blocks"


def pipeline_features(params: dict, graphdef: nnx.GraphDef, batch, cfg: Config, dtype: jnp.dtype,
                      stages: int, microbatches: int, block_axes: dict, bubble_fill: float = 0.0
                      ) -> tuple[jax.Array, jax.Array, jax.Array | None, MoEStats | None]:
    """(final features [rows, T, D], their labels [rows, T], a fine-tuning batch's weights [rows, T]
    or None, an MoE model's MoEStats share or None)
    of the rows whose head this stage computes (its M/pp micro-batches), as pipeline_objective's
    loss takes them. The MoE share is this stage's chunks' statistics, summed over the micro-batches
    and scaled so that its psum over pp is objective_fn's mean over every MoE block and sequence:
    each chunk's means (its G/(R*S) groups) / (R*S*M), its load [G/(R*S), E] placed at the chunk's
    rows of the [G, E] whole, / M."""
    S, R, M, key = stages, cfg.pipeline.repeats, microbatches, stack_key(cfg.model)
    if cfg.pipeline.gather_once:  # fsdp: whole (fp32) stage weights for the round; a no-op without fsdp
        whole = lambda x, axes: shard(x, *(None if a == "embed" else a for a in axes))  # noqa: E731
        params = {**params, key: jax.tree.map(whole, params[key], block_axes)}
    model = nnx.merge(graphdef, params)
    batch_BT1, weights_BT = split_batch(batch)
    B, T1 = batch_BT1.shape
    # Micro-batch m holds rows m, m+M, ...: a reshape of the sharded batch axis, as in summed_grads.
    x_MbTD = model.embed(batch_BT1[:, :-1], dtype).reshape(B // M, M, T1 - 1, -1).swapaxes(0, 1)
    tokens_MbT = batch_BT1[:, :-1].reshape(B // M, M, T1 - 1).swapaxes(0, 1)
    G, E = cfg.model.n_layer // cfg.model.moe_every, cfg.model.moe_experts
    totals = MoEStats(*(jnp.zeros((), jnp.float32),) * 3, jnp.zeros((G, E), jnp.float32)) if E else ()

    def run_chunk(chunk: dict, x_bTD: jax.Array, m: jax.Array, r: jax.Array):
        stage = nnx.merge(graphdef, {**params, key: chunk})
        y_bTD, stats = stage.run_blocks(x_bTD, stage.documents(tokens_MbT[m]))
        if stats is None:
            return y_bTD, ()
        first_row = (r * S + jax.lax.axis_index("pp")) * stats.load.shape[0]  # chunk (r, s)'s first group
        load_GE = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((G, E), jnp.float32), stats.load, first_row, 0)
        return y_bTD, MoEStats(*(x / (R * S * M) for x in stats[:3]), load_GE / M)

    y_MbTD, totals = pipeline.run(run_chunk, params[key], x_MbTD, S, R, bubble_fill,
                                  REMAT_POLICIES.get(cfg.model.remat), totals)
    y_nbTD = pipeline.scatter_outputs(y_MbTD)
    def mine(a_BT: jax.Array) -> jax.Array:  # this stage's rows of labels or weights, as its features'
        a_nbT = pipeline.my_share(a_BT.reshape(B // M, M, T1 - 1).swapaxes(0, 1), S)
        return a_nbT.swapaxes(0, 1).reshape(-1, a_nbT.shape[-1])

    # Back to [rows, T, ...] with the (sharded) b axis outermost, as the chunked loss expects.
    y_nbTD = to_window_order(y_nbTD, balanced_ways(T1 - 1), axis=2)  # from context parallelism's order, if any
    x_BTD = model.ln_f(y_nbTD.swapaxes(0, 1).reshape(-1, *y_nbTD.shape[2:]))
    return (x_BTD, mine(batch_BT1[:, 1:]), None if weights_BT is None else mine(weights_BT),
            totals if E else None)


class Layout(NamedTuple):
    """How the step splits the work by hand: the mesh axes its shard_map is manual over, the
    params' specs over them, and the pipeline's micro-batches (1 without pp)."""
    manual: tuple[str, ...]
    param_specs: dict[str, Any]  # P('pp') for the stacked blocks under pp, 'ep' on the experts' axis
    microbatches: int


# the logical axes whose mesh axis the step's shard_map splits by hand, when that axis is manual
_MANUAL_PARAM_AXES = {"layers": "pp", "experts": "ep"}


def _names(spec: P) -> set[str]:
    return {a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())}


def manual_layout(cfg: Config, mesh: Mesh, setup: Setup) -> Layout:
    sizes = dict(mesh.shape)
    manual = tuple(a for a in ("pp", "dp", "ep") if sizes[a] > 1)

    def spec(axes: tuple) -> P:
        entries = [_MANUAL_PARAM_AXES.get(a) if _MANUAL_PARAM_AXES.get(a) in manual else None for a in axes]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    return Layout(manual, jax.tree.map(spec, setup.logical_axes, is_leaf=_is_axes), pipeline_microbatches(cfg, sizes))


def make_train_step(cfg: Config, mesh: Mesh, setup: Setup, bubble_fill: float = 0.0):
    """jit(state, batch [B, T+1]) -> (state, {'loss', 'grad_norm', 'lr'} and an MoE model's
    moe_* metrics), the state donated. `bubble_fill`: see pipeline.run (tests)."""
    A, dtype, m, ops = cfg.train.grad_accum, jnp.dtype(setup.ops.dtype), cfg.model, setup.ops
    S, R = mesh.shape["pp"], cfg.pipeline.repeats
    schedule = lr_schedule(cfg.optimizer, cfg.train.steps)
    layout = manual_layout(cfg, mesh, setup)
    if S > 1:
        objective = functools.partial(pipeline_objective, cfg=cfg, dtype=dtype, stages=S,
                                      microbatches=layout.microbatches, block_axes=setup.logical_axes[stack_key(m)],
                                      bubble_fill=bubble_fill)
    else:
        objective = functools.partial(objective_fn, cfg=m, dtype=dtype)
    # w.r.t. the trainable params only (not moe_balance=bias's routing bias); the aux output is the metrics
    # (`copies`: the block weights' and the tables' copies made before the micro-batch loop, not differentiated)
    def with_both(trainable, bias, copies):
        blocks, tables = copies
        return with_balance(with_copies(trainable, blocks, setup.logical_axes.get("blocks"), tables), bias)

    grad_fn = jax.grad(lambda trainable, bias, copies, *args: objective(with_both(trainable, bias, copies), *args),
                       has_aux=True)
    # block weights quantized (fp8) or cast (bf16) once per step, not per micro-batch, where the lowering
    # says (jaxgpt/copies.py), and their gradients summed inside their GEMMs
    once = ops.copies_once(bool(m.moe_experts))
    in_gemm = ops.grads_in_gemm(A, bool(m.moe_experts))

    def metrics_and_grads(params, bias, batch, copies=None, tables=None):
        grads, metrics = grad_fn(params, bias, (copies, tables), setup.graphdef, batch)
        return metrics, grads

    def summed_grads(params: dict, bias, batch, vary=lambda zeros: zeros) -> tuple[dict, dict]:
        """(metrics, grads) summed over the A micro-batches of `batch`; `vary` gives the zero
        carry the type of the loop's outputs (varying over the manual axes inside the shard_map)."""
        copies = copies_once_per_step(params["blocks"], setup.logical_axes["blocks"], ops, dtype, in_gemm) if once else None
        tables = table_copies(params, ops, dtype)
        if A == 1:
            return metrics_and_grads(params, bias, batch, copies, tables)
        B = split_batch(batch)[0].shape[0]
        micro_ABT1 = jax.tree.map(lambda x: x.reshape(B // A, A, *x.shape[1:]).swapaxes(0, 1), batch)
        # The gradients of the weights whose GEMMs write them in fp32 (the *Fp32Grad copies) are summed
        # per GEMM (per layer, and per q, k and v where those are GEMMs of their own), stacked once
        # after the loop: XLA:GPU then takes each sum into its GEMM (acc + x^T dy; grads_in_gemm).
        axes = setup.logical_axes.get("blocks", {})  # a dense model's (copies are made only for those)

        def split(grads: dict) -> dict:
            return {**grads, "blocks": gemm_pieces(grads["blocks"], copies, axes, ops.qkv_apart)} if copies else grads

        def accumulate(carry, micro_BT1):
            metrics, grads = metrics_and_grads(params, bias, micro_BT1, copies, tables)
            return jax.tree.map(jnp.add, carry, (metrics, split(grads))), None

        names = ["loss", *(MOE_METRICS if m.moe_experts else ()), *(DOCUMENT_METRICS if m.document_mask else ())]
        load = {"moe_load": jnp.zeros((m.n_layer // m.moe_every, m.moe_experts))} if m.moe_experts else {}
        zeros = vary(({k: jnp.zeros((), jnp.float32) for k in names} | load,
                      split(jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params))))
        metrics, grads = jax.lax.scan(accumulate, zeros, micro_ABT1)[0]
        if copies:
            grads = {**grads, "blocks": from_gemm_pieces(grads["blocks"], axes)}
        return metrics, grads

    def mean_grads(params: dict, bias, batch) -> tuple[dict, dict]:
        if not layout.manual:
            return jax.tree.map(lambda x: x / A, summed_grads(params, bias, batch))
        specs, bias_spec = split_balance(layout.param_specs)

        def per_shard(params, bias, local_BT1):
            # Differentiate w.r.t. a copy of the parameters that varies over every manual axis, so
            # each shard's gradient stays local through the accumulation; one reduction after it
            # (see the module docstring): pmean over dp, over ep a pmean of what is replicated over
            # it and, for an expert's weights (split over ep), its gradient as is (the all-to-alls'
            # transposes already summed it over the ep shards) over ep; over pp a psum of the partial
            # gradients of what every stage uses (embeddings, ln_f); a stage's own blocks need none.
            to_varying = lambda tree: jax.tree.map(lambda x: pipeline.vary(x, layout.manual), tree)  # noqa: E731
            metrics, grads = summed_grads(to_varying(params), bias, local_BT1, to_varying)

            def reduce(x, spec=P()):
                if "ep" in _names(spec):
                    x = x / mesh.shape["ep"]
                if mean_over := tuple(a for a in ("dp", "ep") if a in layout.manual and a not in _names(spec)):
                    x = jax.lax.pmean(x, mean_over)  # one all-reduce over dp x ep
                if "pp" in layout.manual and spec == P():
                    x = jax.lax.psum(x, "pp")
                return x / A

            return jax.tree.map(reduce, metrics), jax.tree.map(reduce, grads, specs)

        key = stack_key(m)
        if S > 1:  # the stacked layers and their routing bias rows (moe_balance=bias) in stage-major order
            params = {**params, key: pipeline.to_stage_major(params[key], S, R)}
            bias = None if bias is None else pipeline.to_stage_major(bias, S, R)
        batch_axes = tuple(a for a in ("dp", "ep") if a in layout.manual)
        metrics, grads = jax.shard_map(
            per_shard, mesh=mesh, in_specs=(specs, P() if bias is None else bias_spec, P(batch_axes) if batch_axes else P()),
            out_specs=(P(), specs), axis_names=set(layout.manual))(params, bias, batch)
        if S > 1:
            grads = {**grads, key: pipeline.from_stage_major(grads[key], S, R)}
        return metrics, grads

    def train_step(state: TrainState, batch):
        trainable, bias = split_balance(state.params)
        metrics, grads = mean_grads(trainable, bias, normalized_weights(batch))
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = setup.optimizer.update(grads, state.opt_state, trainable)
        params = optax.apply_updates(trainable, updates)
        load_GE = metrics.pop("moe_load", None)
        if load_GE is not None:
            metrics["moe_load_max"] = jnp.max(load_GE) * m.moe_experts  # the busiest expert's load / the mean
        if bias is not None:
            params = with_balance(params, move_balance(bias, load_GE, m.moe_bias_rate))
        metrics = {"loss": metrics.pop("loss"), "grad_norm": grad_norm, "lr": schedule(state.step), **metrics}
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_sh = named(mesh, ("batch", None))
    replicated = NamedSharding(mesh, P())
    return jax.jit(train_step, in_shardings=(setup.shardings, batch_sh),
                   out_shardings=(setup.shardings, replicated), donate_argnums=0)


def val_sums(model: GPT, x_BTD: jax.Array, labels_BT: jax.Array, bytes_V: jax.Array, dtype: jnp.dtype,
             weights_BT: jax.Array | None = None) -> dict[str, jax.Array]:
    """What one val batch adds up: `nats` (cross-entropy summed over every position), and for bits
    per byte `text_nats` and `text_bytes`, the same sum and the UTF-8 bytes over the positions whose
    label is text (bytes_V > 0; `<|endoftext|>` is a boundary, not text), as nanochat counts them.
    With a fine-tuning batch's weights: each position's nats weighted, `weight` their sum, and only
    the weighted positions' text counted."""
    nats_BT = model.token_nats(x_BTD, labels_BT, dtype)
    bytes_BT = bytes_V[labels_BT]
    if weights_BT is None:
        return {"nats": jnp.sum(nats_BT), "text_nats": jnp.sum(jnp.where(bytes_BT > 0, nats_BT, 0.0)),
                "text_bytes": jnp.sum(bytes_BT)}
    w_BT = weights_BT.astype(jnp.float32)
    bytes_BT = jnp.where(w_BT > 0, bytes_BT, 0)
    return {"nats": jnp.sum(w_BT * nats_BT), "weight": jnp.sum(w_BT),
            "text_nats": jnp.sum(jnp.where(bytes_BT > 0, w_BT * nats_BT, 0.0)), "text_bytes": jnp.sum(bytes_BT)}


def make_eval_step(cfg: Config, mesh: Mesh, setup: Setup):
    """(params, batch [B, T+1] or a fine-tuning batch (tokens, weights)) -> {'loss': mean
    cross-entropy (no MoE auxiliary losses; fine-tuning: the weighted mean), 'text_nats',
    'text_bytes'} (see val_sums, the bytes of data.tokenizer's tokens), replicated; under pp through
    the same pipeline as training."""
    dtype = jnp.dtype(setup.ops.dtype)
    S, R = mesh.shape["pp"], cfg.pipeline.repeats
    table = tokenizer.load(cfg.data.tokenizer).token_bytes(cfg.model.padded_vocab)
    replicated = NamedSharding(mesh, P())
    bytes_V = jax.make_array_from_callback(table.shape, replicated, lambda index: table[index])  # once, any host count

    def sums(params, batch, bytes_V):
        if S == 1:
            batch_BT1, weights_BT = split_batch(batch)
            model = nnx.merge(setup.graphdef, params)
            return val_sums(model, model(batch_BT1[:, :-1], dtype, features_only=True), batch_BT1[:, 1:], bytes_V,
                            dtype, weights_BT)
        layout, key = manual_layout(cfg, mesh, setup), stack_key(cfg.model)

        def per_stage(params, batch, bytes_V):  # each stage sums the rows whose head it computes
            x_BTD, labels_BT, weights_BT, _ = pipeline_features(params, setup.graphdef, batch, cfg, dtype, S,
                                                                layout.microbatches, setup.logical_axes[key])
            return jax.lax.psum(val_sums(nnx.merge(setup.graphdef, params), x_BTD, labels_BT, bytes_V, dtype,
                                         weights_BT), "pp")

        params = {**params, key: pipeline.to_stage_major(params[key], S, R)}
        return jax.shard_map(per_stage, mesh=mesh, in_specs=(layout.param_specs, P(), P()), out_specs=P(),
                             axis_names={"pp"})(params, batch, bytes_V)

    def evaluate(params, batch, bytes_V):
        out = sums(params, batch, bytes_V)
        if "weight" in out:  # fine-tuning: the weighted mean (0 for a batch without assistant tokens)
            weight = out.pop("weight")
            return {"loss": out.pop("nats") / jnp.where(weight > 0, weight, 1.0), **out}
        batch_BT1 = split_batch(batch)[0]
        return {"loss": out.pop("nats") / (batch_BT1.shape[0] * (batch_BT1.shape[1] - 1)), **out}

    step = jax.jit(evaluate, in_shardings=(setup.shardings.params, named(mesh, ("batch", None)), replicated),
                   out_shardings=replicated)
    return lambda params, batch: step(params, batch, bytes_V)

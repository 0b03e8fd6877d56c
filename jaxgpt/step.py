"""Train state, its shardings, and the jitted train and eval steps.

The state is a plain pytree (`TrainState`: step, parameters as a nested dict, optax state) so that
Orbax and `jit` see ordinary arrays. Its shardings are derived, never written by hand:

    parameters       each Param's logical axes (model.py) -> mesh.RULES -> NamedSharding
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
is manual over `dp` only (fsdp and tp stay automatic inside): each dp shard differentiates with
respect to a dp-*varying* copy of the parameters (`pcast`), so its gradient stays local while it
sums its A micro-batches, and one `pmean` over dp follows the loop. Under fsdp the gradient is
still reduce-scattered per micro-batch over the fsdp axis: ZeRO-3 keeps only a shard of it, as
PyTorch FSDP does. Inside the `shard_map` the activation constraints drop `dp` (`mesh.shard`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt.config import Config, ModelConfig
from jaxgpt.loss import chunked_cross_entropy
from jaxgpt.mesh import named
from jaxgpt.model import GPT, compute_dtype
from jaxgpt.optim import lr_schedule, make_optimizer


MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped")  # what an MoE model adds to the train metrics


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict[str, Any]
    opt_state: optax.OptState


def abstract_model(cfg: Config) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its parameters as shapes, without allocating anything."""
    model = nnx.eval_shape(lambda: GPT(cfg.model, nnx.Rngs(cfg.train.seed)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert not jax.tree.leaves(rest), "the model holds non-parameter state the train state would lose"
    return graphdef, params


def param_logical_axes(params: nnx.State) -> dict[str, Any]:
    """Nested dict of logical-axis tuples, one per parameter (stacked blocks gain a 'layers' axis)."""
    out: dict[str, Any] = {}
    for path, var in nnx.to_flat_state(params):
        axes = tuple(var.get_metadata()["logical_axes"])
        if path[0] in ("blocks", "groups"):  # created under nnx.vmap: a leading axis per stacking level
            axes = ("layers",) * (var.ndim - len(axes)) + axes
        assert len(axes) == var.ndim, (path, axes, var.shape)
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = axes
    return out


class Setup(NamedTuple):
    """Everything the loop needs that is fixed for a run."""
    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    shardings: TrainState  # a NamedSharding per leaf of the state
    logical_axes: dict[str, Any]


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def make_setup(cfg: Config, mesh: Mesh) -> Setup:
    graphdef, abstract_params = abstract_model(cfg)
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    axes = param_logical_axes(abstract_params)
    param_sh = jax.tree.map(lambda a: named(mesh, a), axes, is_leaf=_is_axes)
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(optimizer.init, nnx.to_pure_dict(abstract_params))
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, param_sh,
                                   transform_non_params=lambda _: replicated)
    return Setup(graphdef, optimizer, TrainState(replicated, param_sh, opt_sh), axes)


def init_state(cfg: Config, setup: Setup) -> TrainState:
    def init() -> TrainState:
        model = GPT(cfg.model, nnx.Rngs(cfg.train.seed))
        params = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
        return TrainState(jnp.zeros((), jnp.int32), params, setup.optimizer.init(params))
    return jax.jit(init, out_shardings=setup.shardings)()


def abstract_state(cfg: Config, setup: Setup) -> TrainState:
    """The train state as ShapeDtypeStructs carrying their shardings (restore targets, AOT compiles)."""
    shapes = jax.eval_shape(lambda: init_state(cfg, setup))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, setup.shardings)


def loss_fn(params: dict, graphdef: nnx.GraphDef, batch_BT1: jax.Array, cfg: ModelConfig,
            dtype: jnp.dtype) -> jax.Array:
    """Mean next-token cross-entropy (fp32) of windows [B, T+1], the head applied a chunk at a time."""
    return objective_fn(params, graphdef, batch_BT1, cfg, dtype)[1]["loss"]


def objective_fn(params: dict, graphdef: nnx.GraphDef, batch_BT1: jax.Array, cfg: ModelConfig,
                 dtype: jnp.dtype) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(objective, metrics) of windows [B, T+1]. The objective is the mean next-token cross-entropy
    (fp32, the head applied a chunk at a time), plus for an MoE model the weighted load-balancing
    and router z-losses; metrics['loss'] is the cross-entropy alone (comparable with val_loss and
    dense runs), and an MoE model adds moe_aux_loss, moe_z_loss and moe_dropped (jaxgpt/moe.py)."""
    model = nnx.merge(graphdef, params)
    if not cfg.moe_experts:
        x_BTD = model(batch_BT1[:, :-1], dtype, features_only=True)
        loss = chunked_cross_entropy(x_BTD, params["wte"], batch_BT1[:, 1:], cfg, dtype)
        return loss, {"loss": loss}
    x_BTD, stats = model(batch_BT1[:, :-1], dtype, features_only=True, with_moe_stats=True)
    loss = chunked_cross_entropy(x_BTD, params["wte"], batch_BT1[:, 1:], cfg, dtype)
    objective = loss + cfg.moe_aux_coef * stats.aux + cfg.moe_z_coef * stats.z
    return objective, {"loss": loss, **dict(zip(MOE_METRICS, stats, strict=True))}


def make_train_step(cfg: Config, mesh: Mesh, setup: Setup):
    """jit(state, batch [B, T+1]) -> (state, {'loss', 'grad_norm', 'lr'} and an MoE model's
    moe_* metrics), the state donated."""
    A, dtype = cfg.train.grad_accum, compute_dtype(cfg.model.dtype)
    schedule = lr_schedule(cfg.optimizer, cfg.train.steps)
    grad_fn = jax.grad(objective_fn, has_aux=True)  # w.r.t. params; the aux output is the metrics

    def metrics_and_grads(params, batch_BT1):
        grads, metrics = grad_fn(params, setup.graphdef, batch_BT1, cfg.model, dtype)
        return metrics, grads

    def summed_grads(params: dict, batch_BT1: jax.Array, vary=lambda zeros: zeros) -> tuple[dict, dict]:
        """(metrics, grads) summed over the A micro-batches of `batch_BT1`; `vary` gives the zero
        carry the type of the loop's outputs (dp-varying inside the shard_map below)."""
        if A == 1:
            return metrics_and_grads(params, batch_BT1)
        B, T1 = batch_BT1.shape
        micro_ABT1 = batch_BT1.reshape(B // A, A, T1).swapaxes(0, 1)

        def accumulate(carry, micro_BT1):
            return jax.tree.map(jnp.add, carry, metrics_and_grads(params, micro_BT1)), None

        names = ["loss", *(MOE_METRICS if cfg.model.moe_experts else ())]
        zeros = vary(({k: jnp.zeros((), jnp.float32) for k in names},
                      jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)))
        return jax.lax.scan(accumulate, zeros, micro_ABT1)[0]

    def mean_grads(params: dict, batch_BT1: jax.Array) -> tuple[dict, dict]:
        if mesh.shape["dp"] == 1:
            return jax.tree.map(lambda x: x / A, summed_grads(params, batch_BT1))

        def per_dp_shard(params, local_BT1):
            # Differentiate w.r.t. a dp-varying copy of the parameters so each shard's gradient
            # stays local through the accumulation; one pmean after it (see the module docstring).
            vary = lambda tree: jax.lax.pcast(tree, "dp", to="varying")  # noqa: E731
            summed = summed_grads(vary(params), local_BT1, vary)
            return jax.tree.map(lambda x: jax.lax.pmean(x, "dp") / A, summed)

        return jax.shard_map(per_dp_shard, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P(),
                             axis_names={"dp"})(params, batch_BT1)

    def train_step(state: TrainState, batch_BT1: jax.Array):
        metrics, grads = mean_grads(state.params, batch_BT1)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = setup.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": metrics.pop("loss"), "grad_norm": grad_norm, "lr": schedule(state.step), **metrics}
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_sh = named(mesh, ("batch", None))
    replicated = NamedSharding(mesh, P())
    return jax.jit(train_step, in_shardings=(setup.shardings, batch_sh),
                   out_shardings=(setup.shardings, replicated), donate_argnums=0)


def make_eval_step(cfg: Config, mesh: Mesh, setup: Setup):
    """jit(params, batch [B, T+1]) -> mean cross-entropy (no MoE auxiliary losses)."""
    dtype = compute_dtype(cfg.model.dtype)
    return jax.jit(lambda params, batch: loss_fn(params, setup.graphdef, batch, cfg.model, dtype),
                   in_shardings=(setup.shardings.params, named(mesh, ("batch", None))),
                   out_shardings=NamedSharding(mesh, P()))

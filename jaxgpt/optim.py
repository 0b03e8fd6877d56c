"""The optimizer: AdamW, or Muon for the blocks' matrices with AdamW for the rest.

Both come with linear warmup + cosine decay and global-norm clipping of the whole gradient.

AdamW (`optimizer.name=adamw`). Decay applies to weight matrices and embeddings (parameters named
`*kernel`, `wte`, `wpe`, `lm_head`), never to biases or norm scales. The decision is made by name
rather than by rank because the scanned blocks stack every parameter along a leading layer axis:
a stacked LayerNorm scale is 2-D but is still not a matrix.

Muon (`optimizer.name=muon`, Keller Jordan's modded-nanogpt optimizer; optax's `scale_by_muon`).
The update of each hidden weight matrix is its Nesterov momentum, orthogonalised by 5 Newton-Schulz
iterations (all singular values pushed towards 1), scaled by sqrt(max(1, fan_out / fan_in)) and
`optimizer.muon_lr`. Which parameters, and how each is a matrix (`MUON_AXES`): the blocks' linear
kernels, whose stacked [L, ...] (and MoE [E, ...]) axes are batch axes, so every layer and every
expert is orthogonalised on its own. QKV is three matrices (q, k, v: the `qkv` axis is a batch axis
too), each [D, H*K]; attention-out is [H*K, D]. Everything else takes AdamW with its own
`optimizer.lr` and decay mask: embeddings and the output head (not hidden matrices: one row per
token), norms, biases, and the MoE router (small, and its logits feed a softmax, not a residual).
The state is one step count and two parameter-shaped trees (`MuonAdamWState`): first moments for
every parameter, second moments for AdamW's, so that `optax.tree_map_params` (jaxgpt/step.py) gives
every moment its parameter's sharding. Muon's matrices need no second moment, but their slot in
`nu` holds zeros of the full shape: `optax.partition`'s MaskedNodes do not match the parameter
tree in `tree_map_params`, Orbax refuses to save zero-size arrays, and a smaller placeholder would
not split over the mesh. So Muon's optimizer memory is AdamW's for now (a step.py that maps over
MaskedNodes would let optax.partition drop it). The numerics are optax's `scale_by_muon` and
`scale_by_adam`, applied to the two groups of leaves.

Sharding (fsdp, tp). The orthogonalisation needs the whole matrix: X X^T contracts over every
column. jaxgpt neither gathers the matrix by hand nor writes a distributed Newton-Schulz: the
optimizer runs inside the jitted step on the sharded momentum, and XLA's SPMD partitioner splits
the iteration's matmuls like any other (X X^T of an X split [D/fsdp, F/tp] is a local matmul plus
an all-reduce over tp of a [D/fsdp, D] block, gathered over fsdp where the next product needs it).
The result is exact whatever the layout (tests/test_modern.py: Muon under dp x fsdp x tp matches one
device) and the collectives are in the compiled step for anyone to count (docs/design.md lists
them for the test model). The alternatives: gathering every matrix whole on every device repeats
all the Newton-Schulz FLOPs on each of them; assigning whole matrices to devices round-robin
(Moonlight, Dion) is the scalable way and is not built. Under pp each stage holds its own layers,
and the layer axis is a batch axis, so Muon adds no pp communication.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, MuonState, scale_by_muon

from jaxgpt.config import OptimizerConfig

# (module, parameter) -> (reduction axes, output axes) of the matrix, counted from the end of the
# unstacked shape; all other axes (layers, experts, q/k/v) are batch axes.
MUON_AXES: dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]] = {
    ("attn", "c_attn_kernel"): ((-4,), (-2, -1)),   # [D, 3, H, K]
    ("attn", "q_kernel"): ((-3,), (-2, -1)),        # [D, H, K]
    ("attn", "kv_kernel"): ((-4,), (-2, -1)),       # [D, 2, G, K]
    ("attn", "c_proj_kernel"): ((-3, -2), (-1,)),   # [H, K, D]
    ("mlp", "c_fc_kernel"): ((-2,), (-1,)),         # [(E,) D, F]
    ("mlp", "c_gate_kernel"): ((-2,), (-1,)),       # [(E,) D, F]
    ("mlp", "c_proj_kernel"): ((-2,), (-1,)),       # [(E,) F, D]
}


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def _names(path) -> tuple[str, str]:
    keys = [str(getattr(k, "key", k)) for k in path]
    return (keys[-2] if len(keys) > 1 else "", keys[-1])


def decay_mask(params):
    def is_matrix(path, _):
        name = _names(path)[1]
        return name.endswith("kernel") or name in ("wte", "wpe", "lm_head")
    return jax.tree_util.tree_map_with_path(is_matrix, params)


def muon_labels(params):
    """'muon' or 'adamw' per parameter."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "muon" if _names(path) in MUON_AXES else "adamw", params)


class MuonAdamWState(NamedTuple):
    """Muon's and AdamW's state in parameter-shaped trees, so `optax.tree_map_params` gives every
    moment its parameter's sharding (optax.partition's MaskedNodes would not match the parameters)."""
    count: jax.Array  # int32: updates applied
    mu: Any  # first moments: Muon's Nesterov momentum on its matrices, AdamW's m elsewhere
    nu: Any  # AdamW's second moments; zeros, never updated, on Muon's matrices (see the module docstring)


def muon_adamw(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """Muon (optax's scale_by_muon: Nesterov momentum, 5 Newton-Schulz steps) on MUON_AXES'
    matrices, scaled by sqrt(max(1, fan_out / fan_in)), decayed by muon_weight_decay, at muon_lr;
    optax's AdamW (scale_by_adam, the decay mask, lr) on everything else. One step count."""
    adam_lr, muon_lr = lr_schedule(cfg, total_steps), lr_schedule(dataclasses.replace(cfg, lr=cfg.muon_lr), total_steps)
    adam = optax.scale_by_adam(b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps)
    ns_coeffs = jnp.asarray((3.4445, -4.7750, 2.0315))  # scale_by_muon's default quintic

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731 - two trees: mu and nu are donated apart
        return MuonAdamWState(jnp.zeros((), jnp.int32), zeros(), zeros())

    def update(grads, state, params):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
        is_muon = [_names(path) in MUON_AXES for path, _ in leaves]
        pick = lambda tree, want: [x for x, m in zip(treedef.flatten_up_to(tree), is_muon) if m == want]  # noqa: E731
        g_m, g_a = pick(grads, True), pick(grads, False)
        dims = [MuonDimensionNumbers(*MUON_AXES[_names(path)]) for (path, _), m in zip(leaves, is_muon) if m]
        u_m, muon_state = scale_by_muon(beta=cfg.muon_momentum, weight_dimension_numbers=dims).update(
            g_m, MuonState(state.count, pick(state.mu, True), ns_coeffs))
        u_a, adam_state = adam.update(g_a, optax.ScaleByAdamState(state.count, pick(state.mu, False),
                                                                   pick(state.nu, False)))
        p_m, p_a = pick(params, True), pick(params, False)
        decay = [d for d, m in zip(treedef.flatten_up_to(decay_mask(params)), is_muon) if not m]
        u_m = [-muon_lr(state.count) * (_width_scale(u, d) + cfg.muon_weight_decay * p)
               for u, d, p in zip(u_m, dims, p_m)]
        u_a = [-adam_lr(state.count) * (u + cfg.weight_decay * p if d else u) for u, p, d in zip(u_a, p_a, decay)]

        def merge(muon_part, adam_part):
            it_m, it_a = iter(muon_part), iter(adam_part)
            return treedef.unflatten([next(it_m) if m else next(it_a) for m in is_muon])

        nu = merge(pick(state.nu, True), adam_state.nu)
        return merge(u_m, u_a), MuonAdamWState(muon_state.count, merge(muon_state.mu, adam_state.mu), nu)

    return optax.GradientTransformation(init, update)


def _width_scale(update: jax.Array, dims: MuonDimensionNumbers) -> jax.Array:
    """Muon's width scaling, sqrt(max(1, fan_out / fan_in)) (optax's scale_by_shape, not public)."""
    size = lambda axes: math.prod(update.shape[a] for a in axes)  # noqa: E731
    return update * math.sqrt(max(1.0, size(dims.output_axis) / size(dims.reduction_axis)))


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    if cfg.name == "muon":
        opt = muon_adamw(cfg, total_steps)
    else:
        opt = optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                          weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt)
    return opt

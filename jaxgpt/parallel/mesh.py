"""The device mesh and the one sharding table.

Mesh axes
---------
    pp    pipeline parallelism: the stacked blocks' `layers` axis is split into pp stages of
          consecutive layers; micro-batches flow from stage to stage (jaxgpt/parallel/pipeline.py).
    dp    data parallel: the batch is split, parameters are replicated, gradients all-reduced.
    fsdp  ZeRO-3: the batch is split *and* every parameter (so its gradient and its AdamW moments)
          is split along its `embed` dimension; XLA all-gathers a weight just before use and
          reduce-scatters its gradient.
    cp    context parallelism: every activation's sequence dimension is split, an early and a late
          chunk of the window on each device (causal load balancing); attention gathers K and V
          over cp, parameters are replicated like under dp (jaxgpt/parallel/context.py).
    ep    expert parallelism: the experts of a Mixture-of-Experts block (`experts`) are split, each
          device holding E/ep whole experts; everywhere else ep splits the batch like dp, so no
          device idles outside the MoE layers (jaxgpt/model/moe.py: how tokens reach their experts).
          With a dense model ep is just one more batch axis.
    tp    Megatron tensor parallelism: attention heads, the MLP hidden units and the vocabulary are
          split, so QKV / MLP-in are column-parallel and attention-out / MLP-out row-parallel.
          Under grouped-query attention the key/value heads are split too, never replicated: shard
          i's query heads read exactly shard i's kv heads, so attention stays local, and a layout
          whose tp does not divide model.n_kv_head is refused before compiling.

The device order is (pp, dp, fsdp, cp, ep, tp): tp varies fastest, then ep, then cp, so the axes that
talk inside every layer (tp's all-reduces, ep's all-to-alls, cp's K/V gathers) take neighbouring
devices, and pp, which only passes activations between neighbouring stages, varies slowest and so
spans hosts first.

Auto, not Explicit, axes
------------------------
`jax.make_mesh` makes Explicit axes by default since JAX 0.10 (sharding in types: every op must
be told how its output is sharded). jaxgpt uses `AxisType.Auto`, the GSPMD style: we annotate
parameters (via `jit` in/out shardings) and a few activations (`shard` below), and XLA's sharding
propagation chooses the rest and inserts the all-reduces, all-gathers and reduce-scatters. The
model code stays free of per-op sharding arguments, one table decides the layout, and the tests
read the compiled HLO to check that XLA chose the collectives each layout implies.

The table
---------
Parameters and activations carry *logical* axis names; `RULES` maps each to mesh axes. Parameter
names and activation names differ on purpose: a parameter's `embed` dimension is split over fsdp
(ZeRO-3) while an activation's batch dimension already uses fsdp, so its `act_embed` stays whole.
Likewise tokens sorted to their experts ([E, G, C, D] in moe.py) are split over ep by `experts`,
so their groups use `expert_batch`, the batch axes without ep.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxgpt.config import MeshConfig

MESH_AXES = MeshConfig.AXES  # ("pp", "dp", "fsdp", "cp", "ep", "tp")

RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "vocab": "tp",          # rows of the tied embedding / output head
    "embed": "fsdp",        # the model width D of every weight: ZeRO-3
    "heads": "tp",          # attention heads in QKV and attention-out
    "kv_heads": "tp",       # key/value heads of grouped-query attention: tp must divide them (config.validate)
    "mlp": "tp",            # MLP hidden units F
    "pos": None,            # rows of the position embedding
    "qkv": None,            # the 3 of q, k, v
    "head_dim": None,
    "layers": "pp",         # the stacked-layers axis of the scanned blocks: pipeline stages
    "sublayers": None,      # a second stacking level (the dense blocks inside an MoE group)
    "experts": "ep",        # the E experts of an MoE block (their weights, and tokens sorted to them)
    "router": None,         # the router's E outputs: every device scores every expert
    # activations
    "batch": ("dp", "fsdp", "ep"),
    "expert_batch": ("dp", "fsdp"),  # token groups once sorted to their experts (ep is on `experts`)
    "seq": "cp",            # context parallelism: each device a (load-balanced) share of the window
    "act_embed": None,
    "act_heads": "tp",
    "act_mlp": "tp",
    "act_vocab": "tp",
}


def logical_to_spec(axes: Sequence[str | None]) -> P:
    """('batch', 'seq', 'act_embed') -> P(('dp', 'fsdp', 'ep'), None, None), refusing double use of an axis."""
    used: dict[str, str] = {}
    spec = []
    for name in axes:
        mesh_axes = RULES[name] if name is not None else None
        for m in (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes or ():
            if m in used:
                raise ValueError(f"logical axes {used[m]!r} and {name!r} both map to mesh axis {m!r}")
            used[m] = name
        spec.append(mesh_axes)
    return P(*spec)


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A pp x dp x fsdp x cp x ep x tp mesh of Auto axes (see the module docstring); axes missing from `sizes` are 1."""
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    if devices is None:
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def shard(x: jax.Array, *logical_axes: str | None) -> jax.Array:
    """Constrain an activation's sharding inside jit (needs `jax.set_mesh`); a no-op without a mesh.

    Inside a `shard_map` that is manual over some axes (the train step's per-dp-shard gradient
    accumulation), those axes are already split by hand and are left out of the constraint."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(logical_axes)
    if manual := set(mesh.manual_axes):
        spec = P(*(_without(entry, manual) for entry in spec))
    return jax.lax.with_sharding_constraint(x, spec)


def splits(logical: str) -> int:
    """How many ways the current mesh splits a logical axis, leaving out the axes a `shard_map`
    already splits by hand (as `shard` does); 1 without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    kept = _without(RULES[logical], set(mesh.manual_axes))
    return int(np.prod([mesh.shape[a] for a in ((kept,) if isinstance(kept, str) else kept or ())]))


def manual_size(axis: str) -> int:
    """The size of mesh axis `axis` where a `shard_map` splits it by hand around this code (ep inside
    the train step: jaxgpt/model/moe.py then moves tokens with explicit all-to-alls); 1 otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape[axis] if not mesh.empty and axis in mesh.manual_axes else 1


def _without(entry: str | tuple[str, ...] | None, axes: set[str]) -> str | tuple[str, ...] | None:
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in axes)
    return kept or None


def named(mesh: Mesh, logical_axes: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes))

"""Run a function on each device's own shard: a `shard_map` manual over every automatic mesh axis.

Why. cuDNN fused attention is a custom call that XLA's SPMD partitioner cannot split by itself;
JAX attaches a `custom_partitioning` callback that tells it how. That callback reads the operands'
shardings as full-mesh `NamedSharding`s, and inside a partially manual `shard_map` (the train
step's per-shard gradient accumulation, jaxgpt/step.py, manual over dp and ep only) it is handed
shardings it cannot read (`get_num_ways_dim_sharded` asserts, or a `GSPMDSharding` has no
`.spec`), so XLA:GPU refuses to compile dp=8 and dp x fsdp steps. Attention needs no partitioning
logic at all: every (batch row, head) is independent. So `per_shard` runs it under a `shard_map`
that is manual over every mesh axis still automatic in the context: each device calls the kernel on
its own [B/(dp*fsdp), T, H/tp, K] block, and no custom partitioner is ever asked.

The specs come from logical axes through `mesh.RULES` (`'batch'` -> dp, fsdp; `'act_heads'` -> tp),
never from axis names written here, so axes added to the table later are split the same way:
    - axes already manual in the context (dp inside the train step's shard_map) are dropped, they
      are split already;
    - a mesh axis that no logical axis names (pp, for activations) is manual too: replicated over
      it when it is larger than 1 (each of its devices computes the same block), put on the first
      dimension when it has size 1 (see below);
    - an axis that does not divide its dimension (a batch of 1 when sampling on fsdp=8) is left
      out of the spec, so that dimension is replicated rather than refused.
With no mesh in the context (one device, or no `jax.set_mesh`) the function is called directly.

The gradient is the shard_map's transpose: the cotangents come back with the same specs, so no
collective is added (the parameters' gradient reductions stay where step.py puts them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from jaxgpt.parallel.mesh import logical_to_spec


def spec_for(shape: Sequence[int], logical_axes: Sequence[str | None], mesh, manual: set[str]) -> P:
    """The PartitionSpec of an array with these logical axes on `mesh`, minus the axes in `manual`
    and minus any axis that would split its dimension unevenly (module docstring)."""
    entries = []
    for size, entry in zip(shape, logical_to_spec(logical_axes), strict=True):
        kept, ways = [], 1
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            if axis in manual or size % (ways * mesh.shape[axis]):
                continue
            kept.append(axis)
            ways *= mesh.shape[axis]
        entries.append(tuple(kept) if len(kept) > 1 else (kept[0] if kept else None))
    return P(*entries)


def per_shard(fn: Callable[..., jax.Array], logical_axes: Sequence[str | None],
              *args: jax.Array, arg_axes: Sequence[Sequence[str | None]] | None = None) -> jax.Array:
    """fn(*args) computed block by block: every arg and the result have `logical_axes` (one name per
    dimension), or each arg its own entry of `arg_axes` (the result still `logical_axes`), and fn
    must treat the blocks independently along the named dimensions."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(*args)
    manual = set(mesh.manual_axes)
    free = frozenset(mesh.axis_names) - manual
    if not free:
        return fn(*args)
    spec = spec_for(args[0].shape, logical_axes, mesh, manual)
    named_axes = {a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())}
    # A size-1 axis no logical axis names (pp without pipelining) is put on the first dimension, which
    # it splits 1 way: left replicated, its cotangents lose their manual-axis types inside the dp
    # shard_map (XLA:GPU compile of dp=8), and left automatic, the cuDNN partitioner fails.
    unnamed = [a for a in mesh.axis_names if a in free and a not in named_axes and mesh.shape[a] == 1]

    def with_unnamed(spec: P) -> P:
        first = spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()
        return P((*first, *unnamed), *spec[1:]) if unnamed else spec

    spec = with_unnamed(spec)
    in_specs = (spec,) * len(args) if arg_axes is None else tuple(
        with_unnamed(spec_for(a.shape, axes, mesh, manual)) for a, axes in zip(args, arg_axes, strict=True))
    # check_vma=False: with the check on, cuDNN attention inside the train step's dp shard_map fails
    # to lower (JAX 0.10.2). Differentiating through this shard_map inside a partially manual one
    # then works for a custom_vjp kernel such as cuDNN's (tests/test_gpu_compile.py), not for a
    # plain function, whose cotangents lose their manual-axis types (tests/test_manual.py).
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec,
                         axis_names=set(free), check_vma=False)(*args)

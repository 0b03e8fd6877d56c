"""Context parallelism (the `cp` mesh axis): the sequence split over devices, causally load-balanced.

Under cp every activation's `seq` dimension is split over the cp devices (mesh.RULES), so each
holds T/cp positions of every row: its share of the activations, the MLPs' and projections' work,
and the logits. Attention is the one place positions meet: each device's queries need the keys
and values of every earlier position, so K and V are all-gathered over cp before attention (one
[B, T, G, K] all-gather each per layer forward; their gradients reduce-scatter back), while the
queries, the scores and the output stay split. Parameters are replicated over cp, as over dp, and
their gradients are all-reduced over it.

Causal load balancing. With the window cut into cp contiguous pieces, the device holding the last
piece would attend over all T keys and the first over T/cp: a kernel that skips masked blocks
leaves the early devices idle. So the window is cut into 2*cp chunks of C = T/(2*cp) positions and
device j holds chunks j and 2*cp-1-j (an early and a late one: every device then has the same
number of unmasked (query, key) blocks, 2*cp+1 chunk pairs). cp=2, T=8:

    window order   0 1 | 2 3 | 4 5 | 6 7        chunks 0 1 2 3
    device order   0 1 6 7 | 2 3 4 5            device 0: chunks 0, 3; device 1: chunks 1, 2

The model runs in device order from the embedding to the last block (`to_device_order` of the
positions gives each index's absolute position, which the position embedding, RoPE and the
attention mask read)
and returns to window order before the final norm (`to_window_order`), so the loss, evaluation
and sampling see the window as it was. Both reorderings move one [B, T, ...] array per forward.
A window that 2*cp does not divide keeps the window order (still split over cp; correct, not
balanced); config.validate refuses that for training.

The attention kernels (jaxgpt/model/attention.py) take the mask from the positions: XLA's as a
boolean [B, 1, T/cp, T] mask per device, cuDNN's flash attention per device on its own queries
against the gathered keys, the mask as its bias operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgpt.parallel.mesh import splits


def ways() -> int:
    """How many devices split the sequence here: the cp axis's size under a mesh, else 1."""
    return splits("seq")


def balanced_ways(T: int) -> int:
    """The cp devices a window of T is reordered for under the current mesh (module docstring), or
    1 where it keeps its order (no cp, or 2*cp does not divide T)."""
    cp = ways()
    return cp if cp > 1 and T % (2 * cp) == 0 else 1


def to_device_order(x: jax.Array, cp: int, axis: int = 1) -> jax.Array:
    """x with its `axis` (the window's positions) rearranged into the device order of `cp` devices
    (1: as is): the 2*cp chunks as [cp, 2] (chunk j, then chunk 2*cp-1-j), by reshapes and one
    reversal rather than a gather, which XLA's partitioner handles on any mesh (a gather along the
    cp-split axis inside the dp shard_map with tp beside it aborted it)."""
    if cp == 1:
        return x
    chunks = x.reshape(*x.shape[:axis], 2 * cp, -1, *x.shape[axis + 1:])
    early, late = jnp.split(chunks, 2, axis=axis)  # [.., cp, C, ..] each
    return jnp.stack([early, jnp.flip(late, axis=axis)], axis=axis + 1).reshape(x.shape)


def to_window_order(x: jax.Array, cp: int, axis: int = 1) -> jax.Array:
    """The inverse of `to_device_order`."""
    if cp == 1:
        return x
    pairs = x.reshape(*x.shape[:axis], cp, 2, -1, *x.shape[axis + 1:])
    early, late = (jnp.take(pairs, i, axis=axis + 1) for i in (0, 1))
    return jnp.concatenate([early, jnp.flip(late, axis=axis)], axis=axis).reshape(x.shape)

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

The model runs in device order from the embedding to the last block (`device_order` gives the
absolute position of each index, which the position embedding, RoPE and the attention mask read)
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
import numpy as np

from jaxgpt.parallel.mesh import splits


def ways() -> int:
    """How many devices split the sequence here: the cp axis's size under a mesh, else 1."""
    return splits("seq")


def balanced_order(T: int, cp: int) -> np.ndarray:
    """[T] int32: the window position held at each index of device order (module docstring)."""
    chunks = np.arange(T, dtype=np.int32).reshape(2 * cp, T // (2 * cp))
    return np.concatenate([np.concatenate([chunks[j], chunks[2 * cp - 1 - j]]) for j in range(cp)])


def device_order(T: int) -> np.ndarray | None:
    """The position of each index in device order for a window of T under the current mesh, or
    None where the window keeps its order (no cp, or 2*cp does not divide T)."""
    cp = ways()
    return balanced_order(T, cp) if cp > 1 and T % (2 * cp) == 0 else None


def to_device_order(x: jax.Array, order: np.ndarray | None, axis: int = 1) -> jax.Array:
    """x with its `axis` (the window's positions) rearranged into device order."""
    return x if order is None else jnp.take(x, order, axis=axis)


def to_window_order(x: jax.Array, order: np.ndarray | None, axis: int = 1) -> jax.Array:
    """The inverse of `to_device_order`."""
    return x if order is None else jnp.take(x, np.argsort(order).astype(np.int32), axis=axis)

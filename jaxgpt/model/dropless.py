"""Dropless dispatch (model.moe_dispatch=dropless): every token reaches all of its top-k experts.

Letters: N tokens on this device (B x T), K choices, M = N x K assignments, E experts, L = E / ep
experts held by one device, P the ep peers, R = P x M receive-buffer rows, D model width.

On one device (or ep = 1). The M assignments, token-major (m = n K + k), are sorted by expert with
a stable argsort, so within an expert earlier tokens come first; the rows of x are gathered into
that order [M, D] and the E group sizes counted. The expert MLP then runs as grouped GEMMs
(`jax.lax.ragged_dot`: the rows of group e times expert e's weights; moe.py's `expert_mlp`), the
rows are put back in token-major order [N, K, D], and the combine is the router-weighted sum over
K. Nothing is dropped and no capacity slot is computed empty: the expert work is exactly M rows.

Over ep, inside the train step's shard_map manual over ep (jaxgpt/step.py). Device j holds experts
jL .. (j+1)L - 1, so after the sort the rows for peer d are one contiguous run (send_P[d] rows).
The group sizes travel first (an all-to-all of the [P, L] counts), then the rows, into a receive
buffer [P, M, D]: chunk s holds what peer s sent, sorted by expert, the rest of the chunk empty.
A second stable sort by local expert (empty rows get id L: last, in no group) groups the buffer
for ragged_dot; the outputs are unsorted, sent back by the reverse exchange and unsorted to token
order. The buffer is sized for the worst case (every assignment of every peer to one device), as
the load is only known at run time: that is what keeps the dispatch dropless without a capacity.

The exchange. On GPU it is `jax.lax.ragged_all_to_all`, which moves only the filled rows (send_P
of them per peer). XLA:CPU has no ragged all-to-all ("unimplemented"), so there
`jax.lax.all_to_all` moves the whole zero-padded [P, M, D] buffer: the same received buffer, value
for value, so CPU tests compare layouts through the same code (`lax.platform_dependent` picks the
branch for the platform compiled for). Both are differentiable (the transpose of either exchange
is the reverse one). XLA:CPU also lowers ragged_dot densely (a masked [E, M, D] operand): exact,
but E times the FLOPs, which is why the dropless path is slower than capacity on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgpt.parallel.mesh import manual_size
from jaxgpt.parallel.pipeline import varying_axes

# expert_fn(rows [M', D] grouped by expert, group sizes [G], group id per row [M'] (G: no group)) -> [M', D]
ExpertFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def dropless(x_ND: jax.Array, weight_NK: jax.Array, expert_NK: jax.Array, expert_fn: ExpertFn,
             n_experts: int) -> jax.Array:
    """sum_k weight[n, k] * expert_{expert[n, k]}(x[n]) for every token n: [N, D]."""
    N, K = expert_NK.shape
    expert_M = expert_NK.reshape(N * K)
    order_M = jnp.argsort(expert_M, stable=True)
    x_MD = x_ND[order_M // K]
    sizes_E = jnp.bincount(expert_M, length=n_experts).astype(jnp.int32)
    ep = manual_size("ep")
    if ep == 1:
        y_MD = expert_fn(x_MD, sizes_E, expert_M[order_M])
    else:
        y_MD = _over_ep(x_MD, sizes_E, expert_fn, ep)
    y_NKD = jnp.zeros_like(y_MD).at[order_M].set(y_MD).reshape(N, K, -1)
    return jnp.einsum("nkd,nk->nd", y_NKD, weight_NK.astype(y_NKD.dtype))


def _zeros_like(x_XD: jax.Array, rows: int) -> jax.Array:
    """A zero [rows, D] buffer typed as varying over the manual axes x varies over (ragged_all_to_all's
    result takes its output buffer's type, and platform_dependent's branches must agree)."""
    zeros = jnp.zeros((rows, x_XD.shape[1]), x_XD.dtype)
    return jax.lax.pcast(zeros, tuple(varying_axes(x_XD)), to="varying") if varying_axes(x_XD) else zeros


def _over_ep(x_MD: jax.Array, sizes_E: jax.Array, expert_fn: ExpertFn, ep: int) -> jax.Array:
    """The expert outputs [M, D] of rows sorted by (global) expert, the experts split over ep."""
    M, (E,) = x_MD.shape[0], sizes_E.shape
    L = E // ep
    send_P = jnp.sum(sizes_E.reshape(ep, L), axis=1)
    offset_P = jnp.cumsum(send_P) - send_P  # where each peer's run starts in x_MD
    counts_PL = jax.lax.all_to_all(sizes_E.reshape(ep, L), "ep", 0, 0, tiled=True)  # row s: from peer s
    recv_P = jnp.sum(counts_PL, axis=1)
    # each sorted row's peer and place in that peer's chunk (for the dense exchange)
    # (comparison sums, not jnp.searchsorted, which refuses mixing ep-varying and invariant operands)
    peer_M = jnp.sum(jnp.arange(M)[:, None] >= jnp.cumsum(send_P)[None, :], axis=1)
    place_M = jnp.arange(M) - offset_P[jnp.minimum(peer_M, ep - 1)]
    me = jax.lax.axis_index("ep")

    def there_dense(x_MD):
        buffer_PMD = jnp.zeros((ep, M, x_MD.shape[1]), x_MD.dtype).at[peer_M, place_M].set(x_MD, mode="drop")
        return jax.lax.all_to_all(buffer_PMD.reshape(ep * M, -1), "ep", 0, 0, tiled=True)

    def there_ragged(x_MD):
        return jax.lax.ragged_all_to_all(x_MD, _zeros_like(x_MD, ep * M), offset_P, send_P,
                                         jnp.full((ep,), me * M, jnp.int32), recv_P, axis_name="ep")

    def back_dense(y_RD):
        back_PMD = jax.lax.all_to_all(y_RD, "ep", 0, 0, tiled=True).reshape(ep, M, -1)
        return back_PMD[jnp.minimum(peer_M, ep - 1), jnp.minimum(place_M, M - 1)]

    def back_ragged(y_RD):
        their_offset_P = jax.lax.all_to_all(offset_P, "ep", 0, 0, tiled=True)  # where my rows sat on peer s
        return jax.lax.ragged_all_to_all(y_RD, _zeros_like(y_RD, M),
                                         jnp.arange(ep, dtype=jnp.int32) * M, recv_P, their_offset_P, send_P,
                                         axis_name="ep")

    recv_RD = jax.lax.platform_dependent(x_MD, cpu=there_dense, default=there_ragged)
    # group the receive buffer by local expert: chunk s is sorted already, empty rows go last (id L)
    ends_PL = jnp.cumsum(counts_PL, axis=1)
    local_PM = jnp.sum(jnp.arange(M)[None, :, None] >= ends_PL[:, None, :], axis=-1)
    local_R = local_PM.reshape(ep * M)
    order_R = jnp.argsort(local_R, stable=True)
    y_sorted_RD = expert_fn(recv_RD[order_R], jnp.sum(counts_PL, axis=0), local_R[order_R])
    y_RD = jnp.zeros_like(y_sorted_RD).at[order_R].set(y_sorted_RD)
    return jax.lax.platform_dependent(y_RD, cpu=back_dense, default=back_ragged)

"""Mixture of Experts: top-k routing, capacity-based or dropless dispatch, expert parallelism over `ep`.

Letters: G groups (one per sequence), S tokens per group (S = T), E experts, C slots per expert
and group, K the top-k choices, D model width, F expert MLP width (model.moe_mlp_hidden, by
default the dense MLP's; each expert is the dense MLP's kind, so with model.mlp=swiglu a gated MLP
of three matmuls). Shared experts (model.moe_shared_experts) are a dense MLP in blocks.py.

Routing. The router is a [D, E] matmul in fp32; softmax over E, the top K experts per token, their
probabilities renormalised to sum to 1 (the combine weights; model.moe_norm_topk=false keeps them
as they are, Qwen3-MoE's norm_topk_prob=false). Each expert then takes at most
C = min(S, ceil(K * S * moe_capacity_factor / E)) tokens *per group*; assignments past that are
dropped (the token's residual stream passes the layer unchanged for that expert). Priority is
choice-major, as in GShard: every token's first choice is placed before any second choice, and
within a choice earlier tokens first, by a cumsum over the [K*S, E] one-hot mask.

Why per group, and why groups are sequences. Capacity and the losses below are computed per
sequence, so they do not depend on how the batch is split: a sequence is routed the same on one
device and on dp=2 x ep=4, which is what lets tests/test_moe.py compare layouts to 1e-4. The
losses are means over groups, so micro-batches and dp shards average to the global value.

Two dispatches (model.moe_dispatch). `capacity`, the default and this module: dense one-hot
einsums into C slots per expert (GShard/Switch/MaxText's "dropping" path), what GSPMD partitions
well and what runs anywhere. `dropless` (jaxgpt/model/dropless.py): the assignments sorted by
expert, the experts as grouped GEMMs (`jax.lax.ragged_dot`, `expert_mlp` below), nothing dropped;
with C = S both compute the same function (tests/test_moe_dropless.py).

    dispatch  x_EGCD = einsum('gsec,gsd->egcd', dispatch_GSEC, x_GSD)
    experts   y_EGCD = MLP_e(x_EGCD) with weights [E, D, F], [E, F, D] split over ep
    combine   y_GSD  = einsum('gsec,egcd->gsd', combine_GSEC, y_EGCD)

Collectives (read from the compiled step, asserted by tests/test_moe.py). Inside the train step
ep is a manual axis of its shard_map (jaxgpt/step.py), like dp: each device holds its [G, S, D]
groups and E/ep experts, so the dispatched [E, G, C, D] slots go to the experts' devices by an
explicit `all_to_all` over ep (E split, G gathered: [E/ep, G x ep, C, D]) and come back by the
reverse one: two all-to-alls per MoE block forward, and their two transposes backward, each
moving about K * capacity_factor times the device's [G, S, D] tokens. The router, the gating and
the capacity cumsum are local to a group, so they talk to nobody. The expert weights are never
gathered over ep (each device holds E/ep whole experts, and their AdamW moments likewise), and
their gradients need no reduction over ep (the all-to-alls' transposes bring every device's
cotangents to the expert's owner); under fsdp their `embed` dimension is gathered like any
weight, under tp their F is split Megatron-style (one all-reduce after the second matmul).
Where ep is not manual (evaluation, sampling: plain jit) GSPMD partitions the same einsums,
turning the re-splits of `experts` / `expert_batch` into its own all-to-alls.

Routing bias (model.moe_balance=bias, DeepSeek-V3). `bias_E` is added to the probabilities to
choose the top K, not to weight them, under stop_gradient; the train step moves it against the
load (`MoEStats.load`: each expert's share of the assignments, before capacity).

Losses (returned per layer, averaged over layers by the model, added to the objective by
jaxgpt/step.py with model.moe_aux_coef and model.moe_z_coef):
    aux      Switch load balancing per group: E * sum_e f_e * P_e, f_e the fraction of the group's
             K*S assignments that chose e (before capacity), P_e the mean router probability of e;
             1 when the load is uniform.
    z        ST-MoE router z-loss: mean over tokens of logsumexp(router logits)^2.
    dropped  the fraction of the K*S assignments past their expert's capacity (a metric, no gradient).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgpt.model.dropless import dropless
from jaxgpt.model.ops import Ops
from jaxgpt.parallel.mesh import manual_size, shard


class MoEStats(NamedTuple):
    """Per-layer fp32 means of the load-balancing loss, z-loss and dropped fraction, and the load:
    the share of the top-k assignments each expert got, [E] (sums to 1; before any drop)."""
    aux: jax.Array
    z: jax.Array
    dropped: jax.Array
    load: jax.Array


def capacity(top_k: int, group_size: int, n_experts: int, factor: float) -> int:
    """Token slots per expert and group; never more than the group (a token picks an expert once)."""
    return max(1, min(group_size, math.ceil(top_k * group_size * factor / n_experts)))


def _top_k(probs_GSE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` as k argmax passes (k is small): XLA partitions a reduction over E along the
    groups, while it all-gathers top_k's operand over ep inside the train step's dp shard_map."""
    values, indices = [], []
    for _ in range(k):
        index_GS = jnp.argmax(probs_GSE, axis=-1)
        is_max_GSE = jnp.arange(probs_GSE.shape[-1]) == index_GS[..., None]
        values.append(jnp.sum(jnp.where(is_max_GSE, probs_GSE, 0.0), axis=-1))
        indices.append(index_GS)
        probs_GSE = jnp.where(is_max_GSE, -jnp.inf, probs_GSE)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def select(logits_GSE: jax.Array, top_k: int, bias_E: jax.Array | None = None, norm_topk: bool = True
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(probs_GSE, weight_GSK, expert_GSK): the top-k experts per token and their router
    probabilities, renormalised to sum to 1 (`norm_topk`, model.moe_norm_topk) or as they are.
    With a routing bias (model.moe_balance=bias) the experts are chosen by probability + bias but
    weighted by probability alone (DeepSeek-V3): the bias steers the load without entering the
    function the experts compute."""
    probs_GSE = jax.nn.softmax(logits_GSE, axis=-1)
    if bias_E is None:
        weight_GSK, expert_GSK = _top_k(probs_GSE, top_k)
    else:
        expert_GSK = _top_k(probs_GSE + jax.lax.stop_gradient(bias_E), top_k)[1]
        weight_GSK = jnp.take_along_axis(probs_GSE, expert_GSK, axis=-1)
    if norm_topk:
        weight_GSK = weight_GSK / jnp.sum(weight_GSK, axis=-1, keepdims=True)
    return probs_GSE, weight_GSK, expert_GSK


def _stats(logits_GSE: jax.Array, probs_GSE: jax.Array, chosen_GKSE: jax.Array, dropped: jax.Array) -> MoEStats:
    fraction_GE = jnp.mean(jnp.sum(chosen_GKSE.astype(jnp.float32), axis=1), axis=1) / chosen_GKSE.shape[1]
    E = probs_GSE.shape[-1]
    aux = jnp.mean(E * jnp.sum(fraction_GE * jnp.mean(probs_GSE, axis=1), axis=-1))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_GSE, axis=-1)))
    load_E = jax.lax.stop_gradient(jnp.mean(fraction_GE, axis=0))
    return MoEStats(aux, z, jax.lax.stop_gradient(dropped), load_E)


def route(logits_GSE: jax.Array, top_k: int, slots: int, bias_E: jax.Array | None = None, norm_topk: bool = True
          ) -> tuple[jax.Array, jax.Array, MoEStats]:
    """fp32 router logits -> (dispatch_GSEC in {0, 1}, combine_GSEC router weights, stats)."""
    G, S, E = logits_GSE.shape
    probs_GSE, weight_GSK, expert_GSK = select(logits_GSE, top_k, bias_E, norm_topk)
    # choice-major priority: all first choices, then all second choices, ...
    chosen_GKSE = jax.nn.one_hot(expert_GSK.swapaxes(1, 2), E, dtype=jnp.int32)
    before_GKSE = jnp.cumsum(chosen_GKSE.reshape(G, top_k * S, E), axis=1).reshape(G, top_k, S, E) - 1
    slot_GKS = jnp.sum(before_GKSE * chosen_GKSE, axis=-1)  # the slot each assignment takes in its expert
    kept_GKS = slot_GKS < slots
    slot_GKSC = jax.nn.one_hot(jnp.where(kept_GKS, slot_GKS, slots), slots, dtype=jnp.float32)  # dropped: all 0
    chosen_f = chosen_GKSE.astype(jnp.float32)
    dispatch_GSEC = jnp.einsum("gkse,gksc->gsec", chosen_f, slot_GKSC)
    combine_GSEC = jnp.einsum("gkse,gksc,gsk->gsec", chosen_f, slot_GKSC, weight_GSK)
    dropped = 1.0 - jnp.mean(kept_GKS.astype(jnp.float32))
    return dispatch_GSEC, combine_GSEC, _stats(logits_GSE, probs_GSE, chosen_GKSE, dropped)


class Experts(NamedTuple):
    """The E expert MLPs' weights; a bias or the gate (model.mlp=swiglu only) may be None."""
    fc_EDF: jax.Array
    fc_bias_EF: jax.Array | None
    gate_EDF: jax.Array | None
    gate_bias_EF: jax.Array | None
    proj_EFD: jax.Array
    proj_bias_ED: jax.Array | None


def _plus(y: jax.Array, bias_EX: jax.Array | None) -> jax.Array:
    return y if bias_EX is None else y + bias_EX.astype(y.dtype)[:, None, None, :]


def _rows(bias_EX: jax.Array | None, y_MX: jax.Array, expert_M: jax.Array) -> jax.Array:
    """y plus each row's expert's bias (rows of no group, id E, get none)."""
    if bias_EX is None:
        return y_MX
    return y_MX + jnp.take(bias_EX.astype(y_MX.dtype), expert_M, axis=0, mode="fill", fill_value=0)


def expert_mlp(x_MD: jax.Array, sizes_E: jax.Array, expert_M: jax.Array, w: Experts, mlp: str, ops: Ops) -> jax.Array:
    """The experts on rows grouped by expert (dropless dispatch): grouped GEMMs, `jax.lax.ragged_dot`."""
    dt = x_MD.dtype
    h_MF = _rows(w.fc_bias_EF, jax.lax.ragged_dot(x_MD, w.fc_EDF.astype(dt), sizes_E), expert_M)
    gate_MF = None if w.gate_EDF is None else _rows(
        w.gate_bias_EF, jax.lax.ragged_dot(x_MD, w.gate_EDF.astype(dt), sizes_E), expert_M)
    h_MF = ops.activation(mlp, h_MF, gate_MF, into="expert_out")
    return _rows(w.proj_bias_ED, jax.lax.ragged_dot(h_MF, w.proj_EFD.astype(dt), sizes_E), expert_M)


def moe_mlp(x_BTD: jax.Array, router_DE: jax.Array, w: Experts, ops: Ops, *, mlp: str = "gelu", top_k: int,
            capacity_factor: float, drop: bool = True, dispatch: str = "capacity",
            bias_E: jax.Array | None = None, norm_topk: bool = True) -> tuple[jax.Array, MoEStats]:
    """The MoE feed-forward of normalised features [B, T, D]: each sequence is a group. `drop=False`
    (sampling) gives every expert room for the whole group, so no assignment is dropped and a
    prompt decodes the same token by token as at once. Each expert is an MLP of kind `mlp`
    (swiglu: three matmuls, the gate's named expert_gate). `dispatch`: capacity (the einsums
    above) or dropless (jaxgpt/model/dropless.py); `bias_E`: the routing bias of moe_balance=bias;
    `norm_topk`: model.moe_norm_topk (`select`)."""
    dt = x_BTD.dtype
    B, T, D = x_BTD.shape
    E = router_DE.shape[-1]
    logits_GSE = jnp.einsum("gsd,de->gse", x_BTD.astype(jnp.float32), router_DE.astype(jnp.float32))
    logits_GSE = shard(logits_GSE, "batch", "seq", "router")
    if dispatch == "dropless":
        probs_GSE, weight_GSK, expert_GSK = select(logits_GSE, top_k, bias_E, norm_topk)
        chosen_GKSE = jax.nn.one_hot(expert_GSK.swapaxes(1, 2), E, dtype=jnp.int32)
        stats = _stats(logits_GSE, probs_GSE, chosen_GKSE, jnp.zeros((), jnp.float32))
        expert_fn = functools.partial(expert_mlp, w=w, mlp=mlp, ops=ops)
        y_ND = dropless(x_BTD.reshape(B * T, D), weight_GSK.reshape(B * T, top_k), expert_GSK.reshape(B * T, top_k),
                        expert_fn, E)
        return shard(y_ND.reshape(B, T, D), "batch", "seq", "act_embed"), stats
    slots = capacity(top_k, T, E, capacity_factor) if drop else T
    dispatch_GSEC, combine_GSEC, stats = route(logits_GSE, top_k, slots, bias_E, norm_topk)
    dispatch_GSEC = shard(dispatch_GSEC.astype(dt), "batch", "seq", "router", None)
    combine_GSEC = shard(combine_GSEC.astype(dt), "batch", "seq", "router", None)
    # batch-split groups -> expert-split experts: the all-to-all over ep (GSPMD's, or ours where
    # the train step's shard_map splits ep by hand: then each device holds E/ep experts' weights)
    x_EGCD = shard(jnp.einsum("gsec,gsd->egcd", dispatch_GSEC, x_BTD), "experts", "expert_batch", None, "act_embed")
    if manual_ep := manual_size("ep") > 1:
        x_EGCD = jax.lax.all_to_all(x_EGCD, "ep", 0, 1, tiled=True)  # [E/ep, G x ep, C, D]
    h_EGCF = _plus(ops.linear("expert_in", "egcd,edf->egcf", x_EGCD, w.fc_EDF), w.fc_bias_EF)
    gate_EGCF = None if w.gate_EDF is None else _plus(
        ops.linear("expert_gate", "egcd,edf->egcf", x_EGCD, w.gate_EDF), w.gate_bias_EF)
    h_EGCF = ops.activation(mlp, h_EGCF, gate_EGCF, into="expert_out")
    h_EGCF = shard(h_EGCF, "experts", "expert_batch", None, "act_mlp")
    y_EGCD = _plus(ops.linear("expert_out", "egcf,efd->egcd", h_EGCF, w.proj_EFD), w.proj_bias_ED)
    if manual_ep:
        y_EGCD = jax.lax.all_to_all(y_EGCD, "ep", 1, 0, tiled=True)  # back to [E, G, C, D]
    y_EGCD = shard(y_EGCD, "experts", "expert_batch", None, "act_embed")
    # and back: the second all-to-all
    y_BTD = shard(jnp.einsum("gsec,egcd->gsd", combine_GSEC, y_EGCD), "batch", "seq", "act_embed")
    return y_BTD, stats

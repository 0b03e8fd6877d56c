"""DeepSeek-V3's auxiliary-loss-free balancing (model.moe_balance=bias): where the routing bias
lives and how a step moves it.

The bias [G, E] (one row per MoE block, stacked like the blocks) is an `nnx.Param` of the MoE
block, `router_bias`, so that everything that reads parameters (checkpoints, resume, sampling,
evaluation, resharding) carries it with no extra plumbing. It is not trained: the train step
splits it off (`split_balance`) before taking gradients and before the optimizer (so it has no
AdamW moments and no weight decay), routes with it under stop_gradient (moe.select), and puts it
back moved against the step's load (`move_balance`, `with_balance`). The same split applied to
the parameters' shardings or logical axes gives the optimizer state's. A model without the bias
passes through unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# moe_balance=bias's routing bias [G, E]: kept among the parameters, moved by the step, not the optimizer
BALANCE_PATH = ("groups", "moe", "mlp", "router_bias")


def split_balance(tree: dict) -> tuple[dict, Any]:
    """(tree without the routing bias, the bias or None) for any tree shaped like the parameters."""
    node = tree
    for key in BALANCE_PATH[:-1]:
        node = node.get(key, {}) if isinstance(node, dict) else {}
    if BALANCE_PATH[-1] not in node:
        return tree, None
    return with_balance(tree, None), node[BALANCE_PATH[-1]]


def with_balance(tree: dict, bias: Any) -> dict:
    """`tree` with the routing bias set to `bias` (None: removed), other nodes shared, not copied."""
    def put(node: dict, path: tuple[str, ...]) -> dict:
        if path[0] not in node and bias is None:
            return node  # nothing to remove (a model without the bias)
        out = dict(node)
        if len(path) == 1:
            out.pop(path[0], None)
            return out if bias is None else {**out, path[0]: bias}
        out[path[0]] = put(node[path[0]], path[1:])
        return out
    return put(tree, BALANCE_PATH)


def move_balance(bias_GE: jax.Array, load_GE: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's routing bias rises by `rate` when
    its share of the step's assignments is below the mean 1/E, falls by as much when above."""
    return bias_GE + rate * jnp.sign(1.0 / load_GE.shape[-1] - load_GE)

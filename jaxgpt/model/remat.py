"""`model.remat=auto`: the cheapest recompute policy whose compiled train step fits the device.

Policies from least to most recompute (REMAT_POLICIES):

    none            keep every activation the backward pass needs
    dots            keep matmul outputs, recompute the elementwise work between them
    dots_no_batch   keep only the weight matmuls' outputs (not batched ones such as attention scores)
    full            keep only each block's input; recompute the whole block

`resolve` compiles the real train step (jaxgpt.plan.plan, nothing runs) with each policy in that
order and takes the first whose per-device total (XLA's memory analysis: arguments + outputs -
donated + temporaries + code) is within the device's memory. It is a compile, not a guess, so it is
as right as XLA's own memory plan; it costs one compile per policy tried, before training starts.
On a GPU the memory is the allocator's limit; on a CPU it is the host memory the process can
still allocate, shared by its local devices (`jaxgpt.plan.memory_per_device`, the figure the
train step is checked against before it runs). Where neither is known there is nothing to fit
and `auto` means `none`, said so at start-up. (`python -m jaxgpt.plan` on CPU devices fits nothing
unless --device-memory-gib is given: its fake devices stand for GPUs, not this host.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxgpt.config import Config
from jaxgpt.errors import UserError

ORDER = ("none", "dots", "dots_no_batch", "full")

# model.remat -> what the backward pass may keep from the forward pass of a block
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
GIB = 2**30


def with_remat(cfg: Config, policy: str) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=policy))


def resolve(cfg: Config, memory_bytes: int | None,
            plan_fn: Callable[[Config], dict[str, Any]]) -> tuple[Config, str, dict[str, Any] | None]:
    """(cfg with a concrete model.remat, why, the chosen policy's plan or None if none was compiled).

    plan_fn(cfg) compiles cfg's train step and returns jaxgpt.plan.plan's dict (with 'fits')."""
    if cfg.model.remat != "auto":
        return cfg, f"model.remat={cfg.model.remat}", None
    if memory_bytes is None:
        return with_remat(cfg, "none"), "auto: the device's memory is unknown, so none", None
    tried = []
    for policy in ORDER:
        candidate = with_remat(cfg, policy)
        p = plan_fn(candidate)
        tried.append(f"{policy} {p['memory']['peak'] / GIB:.1f} GiB")
        if p["fits"]:
            return candidate, (f"auto: {policy}, the least recompute that fits {memory_bytes / GIB:.1f} GiB "
                               f"per device (compiled: {', '.join(tried)})"), p
    raise UserError(f"model.remat=auto: no remat policy fits {memory_bytes / GIB:.1f} GiB per device "
                    f"({', '.join(tried)}); raise train.grad_accum or use more devices")

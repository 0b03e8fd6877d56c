"""`model.remat=auto`: the cheapest recompute policy whose compiled train step fits the device.

Policies from least to most recompute (REMAT_POLICIES):

    none            keep every activation the backward pass needs
    dots            keep matmul outputs, recompute the elementwise work between them
    dots_no_batch   keep only the weight matmuls' outputs (not batched ones such as attention scores)
    attention       keep each block's input and its fused attention kernel's outputs; recompute the
                    rest of the block, but never the attention forward
    full            keep only each block's input; recompute the whole block

Every policy but `full` keeps what a fused attention kernel's forward returns (cuDNN's or tokamax's:
its output [B, T, H, K] and its per-row softmax statistics [B, H, T]), so that the backward never
runs that forward again. At long contexts it is the costliest kernel to recompute (a large share
of a block's forward FLOPs, at about half the GEMMs' FLOP rate; docs/benchmarks.md) and among the
cheapest to keep (one [B, T, D] activation). torchtitan's selective activation checkpointing
saves its scaled-dot-product-attention outputs for the same reason. With the XLA attention (a CPU,
or model.attention=xla) there is no such kernel: `attention` then recomputes as `full` does, and
the dots policies keep its einsums' outputs as they keep any other matmul's.

A kernel is recognised by the primitive JAX binds for its forward: `dot_product_attention_fwd_wrapper`
for cuDNN's (jax.nn.dot_product_attention), and for tokamax's the `remat_opt` of its custom VJP
(optimize_remat=True) around a Pallas kernel (a `pallas_call`, or Mosaic GPU's `mpmd_map`).

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
import jax.extend.core as jex_core

from jaxgpt.config import Config
from jaxgpt.errors import UserError

ORDER = ("none", "dots", "dots_no_batch", "attention", "full")

# The name of every fp8 per-tensor scale (jaxgpt/lowering/fp8.py `quantize`). Every policy keeps these
# scalars: a block recomputed in the backward pass then casts its activations with the forward's
# scales instead of reading each one again for its amax.
SCALE = "fp8_scale"

_CUDNN_FORWARD = "dot_product_attention_fwd_wrapper"
_KERNELS = {"pallas_call", "mpmd_map"}  # a Pallas kernel; Mosaic GPU's (tokamax's on JAX 0.12) is an mpmd_map


def _calls_kernel(jaxpr: Any) -> bool:
    return any(e.primitive.name in _KERNELS or any(_calls_kernel(j) for j in jex_core.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


def attention_kernel(prim: Any, *_, **params) -> bool:
    """A remat policy: keep the outputs of a fused attention kernel's forward (cuDNN's, tokamax's)."""
    if prim.name == _CUDNN_FORWARD:
        return True
    return prim.name == "remat_opt" and _calls_kernel(params["fwd_jaxpr"])


_FP8_SCALES = jax.checkpoint_policies.save_only_these_names(SCALE)


def _keeping(*policies: Callable) -> Callable:
    """A policy that keeps what any of `policies` keeps, and always fp8's per-tensor scales."""
    def keep(prim: Any, *avals, **params) -> bool:
        return any(p(prim, *avals, **params) for p in (_FP8_SCALES, *policies))
    return keep


# model.remat -> what the backward pass may keep from the forward pass of a block
REMAT_POLICIES = {
    "full": _keeping(),
    "attention": _keeping(attention_kernel),
    "dots": _keeping(jax.checkpoint_policies.checkpoint_dots, attention_kernel),
    "dots_no_batch": _keeping(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, attention_kernel),
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

"""model.attention=mosaic: tokamax's Pallas Mosaic GPU flash attention (issue 40 item 2).

tokamax (github.com/openxla/tokamax, the kernel library JAX 0.12 points to in place of the
deprecated `jax.experimental.pallas.ops.gpu.attention`) writes flash attention for NVIDIA GPUs in
Pallas's Mosaic GPU dialect: separate kernels for sm80, sm90 (Hopper: warpgroup MMAs, TMA loads,
producer and consumer warpgroups, as FlashAttention-3) and sm100, forward and backward, causal,
with grouped-query heads taken as they are. It is an optional dependency (the cuda12, cuda13 and
gpu-compile extras; tokamax needs Python >= 3.12 and JAX >= 0.11.1).

Two things tokamax decides from JAX's *default* device, not from the arrays' (which are tracers
here): whether Mosaic GPU runs at all, and which of its kernels to trace (sm80 / sm90 / sm100). In
a run on a GPU that is the GPU; a deviceless compile (`jaxgpt.plan --target h100`, where the
default device is the CPU) sets the compile-only GPU as the default device around its trace
(jaxgpt.plan.lower_step).

With no autotuning cache entry for a shape tokamax takes its heuristic block sizes and logs one
"Autotuning cache miss" warning per call and shape; that line is dropped (`_QuietCacheMiss`).
Tuning is for a GPU session (scripts/attention_bench.py, scripts/gpu_checks.sh's attention group).

Where it runs (jaxgpt.config.validate refuses the rest before compiling):
- plain causal attention: document masking and cp would pass tokamax's kernels masks and offsets
  of their own;
- layouts whose train step has no manual shard_map: one GPU, fsdp, tp (pp, dp and ep of 1).
  Mosaic GPU's kernels take no arrays with manual-axis types (JAX 0.12: "mpmd_map does not support
  Refs with varying manual axis types"), and under the per-device shard_map that drops them
  (jaxgpt/parallel/manual.py) tokamax's backward returns gradients without the dp the primals vary
  over inside the step's dp shard_map, which JAX refuses. fsdp splits the batch like dp does.

Letters: B batch, T time, H query heads, G key/value heads, K head dim.
"""

from __future__ import annotations

import importlib.util
import logging

import jax


def unavailable_reason() -> str | None:
    """Why tokamax's Mosaic GPU attention cannot be imported here, or None."""
    if importlib.util.find_spec("tokamax") is None:
        return ('it needs tokamax (Python >= 3.12: pip install -e ".[cuda12]", or ".[gpu-compile]" to '
                'compile for a GPU this machine lacks)')
    return None


class _QuietCacheMiss(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Autotuning cache miss")


_QUIET = _QuietCacheMiss()


def attend(q_BTHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(K) + causal mask) v on one device's rows and heads: [B, T, H, K]."""
    import tokamax

    logging.getLogger("absl").addFilter(_QUIET)  # tokamax's lines go through absl's logger (once: a set)
    return tokamax.dot_product_attention(q_BTHK, k_BTGK, v_BTGK, is_causal=True, implementation="mosaic")

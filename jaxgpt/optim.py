"""AdamW with warmup + cosine decay, global-norm clipping, and weight decay on matrices only.

Decay applies to weight matrices and embeddings (parameters named `*kernel`, `wte`, `wpe`), never
to biases or LayerNorm scales. The decision is made by name rather than by rank because the
scanned blocks stack every parameter along a leading layer axis: a stacked LayerNorm scale is
2-D but is still not a matrix.
"""

from __future__ import annotations

import jax
import optax

from jaxgpt.config import OptimizerConfig


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def decay_mask(params):
    def is_matrix(path, _):
        name = jax.tree_util.keystr(path[-1:], simple=True)
        return name.endswith("kernel") or name in ("wte", "wpe")
    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw

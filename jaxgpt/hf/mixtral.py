"""Hugging Face Mixtral interop: a Llama-shaped Mixture-of-Experts model as transformers'
`MixtralForCausalLM` (for convert.py).

Which models. Llama's (llama.py: RMSNorm with a scale, RoPE, SwiGLU, no QK-norm or soft-capping;
any grouped-query heads, rope_theta, tied or untied head) with model.moe_experts = E experts in
every block (moe_every=1), no shared experts, no biases and the Switch auxiliary loss for balance
(moe_balance=aux: DeepSeek's routing bias changes which experts a token picks, which Mixtral's
router cannot). moe_top_k is num_experts_per_tok, the experts' width (moe_mlp_hidden, or the
dense MLP's) is intermediate_size. `blockers` names what else the class cannot hold.

Routing is the same function on both sides: router logits in fp32, softmax over the E experts,
the top k, their probabilities renormalised to sum to 1 as the combine weights
(`MixtralTopKRouter`; jaxgpt/model/moe.py). Mixtral never drops a token, so a model exported from
a run with model.moe_dispatch=capacity gives transformers' logits exactly where no expert
overflowed its capacity; `jaxgpt.sample` (whose decoding passes drop nothing) and dropless
training always agree with it.

Layout: the attention, norms, embeddings and head are Llama's (llama.py's table); each block's MoE
layer, under "model.layers.i.block_sparse_moe.", is the Hub's checkpoint format, which
transformers 4 loads as it is and 5 converts on load (and writes back on save_pretrained):

    ours (groups.moe.mlp, stacked on L)      HF (per layer i and expert e)
    router_kernel  [L, D, E]                  gate.weight            [E, D]
    c_gate_kernel  [L, E, D, F]               experts.e.w1.weight    [F, D]  silu(x w1) * (x w3), then w2
    c_fc_kernel    [L, E, D, F]               experts.e.w3.weight    [F, D]
    c_proj_kernel  [L, E, F, D]               experts.e.w2.weight    [D, F]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt import files
from jaxgpt.config import ModelConfig
from jaxgpt.hf import llama

ARCHITECTURE = "MixtralForCausalLM"
_MOE = "block_sparse_moe"
_STACK = ("groups", "moe")  # where an MoE model keeps its blocks (jaxgpt/model/gpt.py), with moe_every=1

# model.* key -> (Mixtral's value, why Mixtral cannot hold another); Llama's besides
_MIXTRAL = {"moe_every": (1, "every Mixtral block is MoE"),
            "moe_shared_experts": (0, "Mixtral has no shared experts"),
            "bias": (False, "Mixtral's linears have no biases"),
            "moe_balance": ("aux", "Mixtral's router has no balancing bias"),
            "moe_norm_topk": (True, "Mixtral renormalises its top-k router weights")}


def blockers(m: ModelConfig) -> list[str]:
    """The model.* settings Mixtral cannot hold, each as 'model.key=value (why)' (empty: a Mixtral)."""
    return llama.blockers(m) + [f"model.{k}={getattr(m, k)} ({why})" for k, (v, why) in _MIXTRAL.items()
                                if getattr(m, k) != v]


def experts(router: str, expert: str, names: dict[str, str]) -> llama.Mlp:
    """The mapping of a layer's router and experts (Mixtral's, Qwen3-MoE's): `router` the router's
    tensor name, `expert` the format of an expert's (e and w filled in), `names` our gate, in and
    out kernels' HF names (w)."""
    def expert_names(m: ModelConfig, w: str) -> list[str]:
        return [expert.format(e=e, w=w) for e in range(m.moe_experts)]

    def tensors(f: dict, m: ModelConfig) -> dict[str, np.ndarray]:
        out = {router: f["router_kernel"].swapaxes(1, 2)}
        for ours, w in names.items():
            torch_LEoi = f[ours].swapaxes(2, 3)
            out |= {name: torch_LEoi[:, e] for e, name in enumerate(expert_names(m, w))}
        return out

    def shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
        D, E, F = m.n_embd, m.moe_experts, m.expert_width
        out = {router: (E, D)}
        for ours, w in names.items():
            out |= dict.fromkeys(expert_names(m, w), (D, F) if ours == "c_proj_kernel" else (F, D))
        return out

    def params(hf: dict[str, np.ndarray], m: ModelConfig) -> dict:
        def stacked(w: str) -> np.ndarray:  # E x [L, out, in] -> our [L, E, in, out]
            return np.stack([hf[name] for name in expert_names(m, w)], axis=1).swapaxes(2, 3)

        return {"router_kernel": hf[router].swapaxes(1, 2), **{ours: stacked(w) for ours, w in names.items()}}

    return llama.Mlp(tensors, shapes, params)


MOE = experts(f"{_MOE}.gate.weight", _MOE + ".experts.{e}.{w}.weight",
              {"c_gate_kernel": "w1", "c_fc_kernel": "w3", "c_proj_kernel": "w2"})


def to_hf(params: dict, model_cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our nested params -> {HF MixtralForCausalLM name: fp32 array}, vocabulary padding removed."""
    return llama.to_hf(params, model_cfg, MOE, _STACK)


def from_hf(tensors: dict[str, np.ndarray], model_cfg: ModelConfig) -> dict:
    """{HF name: array} (MixtralForCausalLM's, or MixtralModel's without "model.") -> our nested params (fp32)."""
    return llama.from_hf(tensors, model_cfg, MOE, _STACK)


def hf_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """A config.json that transformers.MixtralConfig (4.x and 5.x) reads as this model."""
    m = model_cfg
    cfg = {k: v for k, v in llama.hf_config(m).items() if k not in ("attention_bias", "mlp_bias")}
    return cfg | {"architectures": [ARCHITECTURE], "model_type": "mixtral", "intermediate_size": m.expert_width,
                  "num_local_experts": m.moe_experts, "num_experts_per_tok": m.moe_top_k,
                  "router_aux_loss_coef": m.moe_aux_coef, "router_jitter_noise": 0.0, "sliding_window": None}


# config.json key -> (our key, MixtralConfig's default)
_SIZES = {"num_hidden_layers": ("model.n_layer", 32), "num_attention_heads": ("model.n_head", 32),
          "hidden_size": ("model.n_embd", 4096), "intermediate_size": ("model.moe_mlp_hidden", 14336),
          "max_position_embeddings": ("model.seq_len", 4096 * 32), "vocab_size": ("model.vocab_size", 32000),
          "num_local_experts": ("model.moe_experts", 8), "num_experts_per_tok": ("model.moe_top_k", 2)}
# The config.json keys we read, with their JSON types (MixtralConfig's own).
CONFIG_SHAPE = {k: v for k, v in llama.CONFIG_SHAPE.items() if k not in ("attention_bias", "mlp_bias")} | {
    "sliding_window": (int, type(None)), "router_aux_loss_coef": files.NUMBER} | {key: int for key in _SIZES}


def model_overrides(hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the model.* keys it implies, the architecture keys included."""
    return llama.model_overrides(hf_cfg, _SIZES, eps_default=1e-5) | {f"model.{k}": v for k, (v, _) in _MIXTRAL.items()}


def check_config(hf_cfg: dict[str, Any], m: ModelConfig, source: Path) -> None:
    """UserError (one line) unless config.json describes exactly the Mixtral that `m` is."""
    llama.check_config(hf_cfg, m, source, model_overrides, "Mixtral",
                       [("sliding_window", hf_cfg.get("sliding_window"), None)])

"""Hugging Face Qwen3 interop: transformers' `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` (for convert.py).

Which models. Qwen3 is Llama's decoder (llama.py: RMSNorm with a scale, RoPE, SwiGLU, grouped-query
attention, tied or untied head) with QK-norm: each head's queries and keys RMS-normalised over the
head dim before RoPE, with a learned [K] scale shared by the heads (`q_norm`, `k_norm`), which is
jaxgpt's model.qk_norm with model.norm_scale. Its linears have no biases (attention_bias=true
would leave the MLP without them, which model.bias cannot say), its head_dim is its own
(Qwen3-0.6B: 128 with hidden_size 1024 and 16 heads: model.head_size) and its rms_norm_eps 1e-6
(model.norm_eps). Qwen3-MoE puts experts in every block (decoder_sparse_step 1, no mlp_only_layers:
every released model), no shared experts, the top-k router's weights renormalised or not as
norm_topk_prob says (model.moe_norm_topk), each expert moe_intermediate_size wide.

Layout: Llama's table (llama.py) plus, per layer i under "model.layers.i.",

    ours (blocks stacked on L)        HF
    blocks.attn.q_norm.scale [L, K]    self_attn.q_norm.weight [K]
    blocks.attn.k_norm.scale [L, K]    self_attn.k_norm.weight [K]

and for Qwen3-MoE the Hub's checkpoint format (transformers 5 fuses the experts on load and splits
them again on save_pretrained):

    ours (groups.moe.mlp, stacked on L)   HF
    router_kernel  [L, D, E]               mlp.gate.weight                [E, D]
    c_gate_kernel  [L, E, D, F]            mlp.experts.e.gate_proj.weight [F, D]
    c_fc_kernel    [L, E, D, F]            mlp.experts.e.up_proj.weight   [F, D]
    c_proj_kernel  [L, E, F, D]            mlp.experts.e.down_proj.weight [D, F]

Routing is the same function on both sides: router logits in fp32, softmax over the experts, the
top k, renormalised where norm_topk_prob (jaxgpt/model/moe.py `select`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt import files
from jaxgpt.config import ModelConfig
from jaxgpt.hf import llama, mixtral

# model.* key -> (Qwen3's value, why Qwen3 cannot hold another)
_QWEN3 = {"norm": ("rmsnorm", "Qwen3's norms are RMSNorm"),
          "norm_scale": (True, "Qwen3's RMSNorms have a learned scale"),
          "position": ("rope", "Qwen3 has rotary positions, no position table"),
          "mlp": ("swiglu", "Qwen3's MLP is SwiGLU"),
          "qk_norm": (True, "Qwen3 normalises each head's queries and keys"),
          "bias": (False, "Qwen3's MLP has no biases"),
          "logit_softcap": (0.0, "Qwen3 does not cap its logits")}
_MOE = {"moe_every": (1, "every Qwen3-MoE block is MoE here (decoder_sparse_step 1)"),
        "moe_shared_experts": (0, "Qwen3-MoE has no shared experts"),
        "moe_balance": ("aux", "Qwen3-MoE's router has no balancing bias")}


def _blockers(m: ModelConfig, table: dict) -> list[str]:
    return [f"model.{k}={getattr(m, k)} ({why})" for k, (v, why) in table.items() if getattr(m, k) != v]


def blockers(m: ModelConfig) -> list[str]:
    """The model.* settings Qwen3 cannot hold, each as 'model.key=value (why)' (empty: a Qwen3)."""
    return _blockers(m, _QWEN3)


def moe_blockers(m: ModelConfig) -> list[str]:
    """The model.* settings Qwen3-MoE cannot hold (empty: a Qwen3-MoE)."""
    return _blockers(m, _QWEN3) + _blockers(m, _MOE)


ARCHITECTURE = "Qwen3ForCausalLM"
to_hf, from_hf = llama.to_hf, llama.from_hf


def hf_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """A config.json that transformers.Qwen3Config reads as this model."""
    m = model_cfg
    cfg = {k: v for k, v in llama.hf_config(m).items() if k != "mlp_bias"}
    return cfg | {"architectures": [ARCHITECTURE], "model_type": "qwen3", "attention_bias": False,
                  "use_sliding_window": False, "sliding_window": None}


# config.json key -> (our key, Qwen3Config's default)
_SIZES = {"num_hidden_layers": ("model.n_layer", 32), "num_attention_heads": ("model.n_head", 32),
          "hidden_size": ("model.n_embd", 4096), "intermediate_size": ("model.mlp_hidden", 22016),
          "max_position_embeddings": ("model.seq_len", 32768), "vocab_size": ("model.vocab_size", 151936)}
CONFIG_SHAPE = {k: v for k, v in llama.CONFIG_SHAPE.items() if k != "mlp_bias"} | {
    "use_sliding_window": bool, "sliding_window": (int, type(None))} | {key: int for key in _SIZES}


def model_overrides(hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the model.* keys it implies, the architecture keys included."""
    out = llama.model_overrides(hf_cfg, _SIZES, _QWEN3)
    out["model.head_size"] = hf_cfg.get("head_dim") or 128  # Qwen3Config's default, whatever the width
    if out["model.head_size"] * out["model.n_head"] == out["model.n_embd"]:
        out["model.head_size"] = 0
    return out


def _fixed(hf_cfg: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return [("use_sliding_window", hf_cfg.get("use_sliding_window", False), False),
            ("attention_bias", hf_cfg.get("attention_bias", False), False)]


def check_config(hf_cfg: dict[str, Any], m: ModelConfig, source: Path) -> None:
    """UserError (one line) unless config.json describes exactly the Qwen3 that `m` is."""
    llama.check_config(hf_cfg, m, source, model_overrides, "Qwen3", _fixed(hf_cfg))


# --- Qwen3-MoE ----------------------------------------------------------------------------------

MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"


MOE = mixtral.experts("mlp.gate.weight", "mlp.experts.{e}.{w}.weight",
                      {"c_gate_kernel": "gate_proj", "c_fc_kernel": "up_proj", "c_proj_kernel": "down_proj"})
_STACK = ("groups", "moe")  # an MoE model's blocks with moe_every=1 (jaxgpt/model/gpt.py)


class Moe:
    """The Qwen3-MoE Format's functions (convert.py reads them off a module or a class alike)."""
    ARCHITECTURE = MOE_ARCHITECTURE
    _SIZES = {"num_hidden_layers": ("model.n_layer", 24), "num_attention_heads": ("model.n_head", 32),
              "hidden_size": ("model.n_embd", 2048), "max_position_embeddings": ("model.seq_len", 32768),
              "vocab_size": ("model.vocab_size", 151936), "moe_intermediate_size": ("model.moe_mlp_hidden", 768),
              "num_experts": ("model.moe_experts", 128), "num_experts_per_tok": ("model.moe_top_k", 8)}  # Qwen3MoeConfig's
    CONFIG_SHAPE = CONFIG_SHAPE | {"moe_intermediate_size": int, "num_experts": int, "num_experts_per_tok": int,
                                   "norm_topk_prob": bool, "decoder_sparse_step": int, "mlp_only_layers": list,
                                   "router_aux_loss_coef": files.NUMBER}

    @staticmethod
    def to_hf(params: dict, model_cfg: ModelConfig) -> dict[str, np.ndarray]:
        return llama.to_hf(params, model_cfg, MOE, _STACK)

    @staticmethod
    def from_hf(tensors: dict[str, np.ndarray], model_cfg: ModelConfig) -> dict:
        return llama.from_hf(tensors, model_cfg, MOE, _STACK)

    @staticmethod
    def hf_config(model_cfg: ModelConfig) -> dict[str, Any]:
        """A config.json that transformers.Qwen3MoeConfig reads as this model."""
        m = model_cfg
        return hf_config(m) | {"architectures": [MOE_ARCHITECTURE], "model_type": "qwen3_moe",
                               "intermediate_size": m.mlp_width, "moe_intermediate_size": m.expert_width,
                               "num_experts": m.moe_experts, "num_experts_per_tok": m.moe_top_k,
                               "norm_topk_prob": m.moe_norm_topk, "decoder_sparse_step": 1, "mlp_only_layers": [],
                               "router_aux_loss_coef": m.moe_aux_coef}

    @staticmethod
    def model_overrides(hf_cfg: dict[str, Any]) -> dict[str, Any]:
        out = llama.model_overrides(hf_cfg, Moe._SIZES, _QWEN3 | _MOE)  # no dense MLP: every block is MoE
        out["model.moe_norm_topk"] = hf_cfg.get("norm_topk_prob", False)
        head = hf_cfg.get("head_dim") or out["model.n_embd"] // out["model.n_head"]
        out["model.head_size"] = 0 if head * out["model.n_head"] == out["model.n_embd"] else head
        return out

    @staticmethod
    def check_config(hf_cfg: dict[str, Any], m: ModelConfig, source: Path) -> None:
        fixed = _fixed(hf_cfg) + [("decoder_sparse_step", hf_cfg.get("decoder_sparse_step", 1), 1),
                                  ("mlp_only_layers", hf_cfg.get("mlp_only_layers") or [], [])]
        llama.check_config(hf_cfg, m, source, Moe.model_overrides, "Qwen3-MoE", fixed)


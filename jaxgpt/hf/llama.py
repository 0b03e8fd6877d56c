"""Hugging Face Llama interop: the modern decoder as transformers' `LlamaForCausalLM` (for convert.py).

Which models. A jaxgpt model is Llama-shaped when model.norm=rmsnorm with a learned scale,
model.position=rope and model.mlp=swiglu, without QK-norm or logit soft-capping; n_kv_head
(num_key_value_heads: grouped-query attention), mlp_hidden (intermediate_size), rope_theta,
tie_embeddings (tie_word_embeddings) and bias (attention_bias = mlp_bias: biases on q, k, v, o and
gate, up, down; RMSNorm has none either way) are free. `blockers` names what Llama cannot hold
(parameter-free norms, relu2 or GELU with RoPE, learned positions with RMSNorm, QK-norm,
soft-capped logits), for classes.architecture's one-line refusal. A Llama-shaped model with
experts is Mixtral's (mixtral.py), which reuses this module's mapping with its own MLP (`Mlp`).

Layout. torch's `nn.Linear` keeps its weight as [out, in]; ours are [in, out] with heads as axes,
so each HF tensor is one layer's slice reshaped to [in, out] and transposed:

    ours (blocks stacked on L)                HF (per layer i, under "model.layers.i.")
    wte                       [Vp, D]         model.embed_tokens.weight        [V, D]  first V rows
    lm_head (untied only)     [Vp, D]         lm_head.weight                   [V, D]  absent when tied
    ln_f.scale                [D]             model.norm.weight                [D]
    blocks.ln_1.scale         [L, D]          input_layernorm.weight           [D]
    blocks.ln_2.scale         [L, D]          post_attention_layernorm.weight  [D]
    blocks.attn.c_attn_kernel [L, D, 3, H, K] self_attn.{q,k,v}_proj.weight    [H*K, D]  (G = H)
    blocks.attn.q_kernel      [L, D, H, K]    self_attn.q_proj.weight          [H*K, D]  (G < H)
    blocks.attn.kv_kernel     [L, D, 2, G, K] self_attn.{k,v}_proj.weight      [G*K, D]  (G < H)
    blocks.attn.c_proj_kernel [L, H, K, D]    self_attn.o_proj.weight          [D, H*K]
    blocks.mlp.c_gate_kernel  [L, D, F]       mlp.gate_proj.weight             [F, D]
    blocks.mlp.c_fc_kernel    [L, D, F]       mlp.up_proj.weight               [F, D]
    blocks.mlp.c_proj_kernel  [L, F, D]       mlp.down_proj.weight             [D, F]
    *_bias (model.bias=true)  likewise        *.bias                           [out]

RoPE convention. transformers' Llama rotates the feature pairs (i, i + K/2) of each head
(`rotate_half`: [x1, x2] -> [-x2, x1], cos and sin repeated over both halves). Meta's original
checkpoints rotate adjacent pairs (2i, 2i + 1), which is why HF's convert_llama_weights_to_hf.py
permutes the rows of q_proj and k_proj. jaxgpt's `attention.rope` rotates (i, i + K/2) with the
same frequencies theta^(-2i/K), so q and k rows cross over in order, unpermuted. tests/test_hf.py
holds this to an independent NumPy rotate-half RoPE and checks that Meta's permutation breaks the
logits, so a swapped convention cannot pass.

The rest agrees as well: RMSNorm in fp32 with rms_norm_eps (model.norm_eps), a head_dim of its own
(model.head_size) where config.json gives one, attention scaled by 1/sqrt(K), silu(gate) * up. Not
held, refused on import with the key named: rope scaling (Llama 3.1+'s `llama3`, linear, dynamic:
jaxgpt's RoPE has no frequency scaling), another hidden_act. config.json carries rope_theta twice:
as `rope_theta` (transformers 4) and in transformers 5's `rope_parameters`. The export writes the
run's tokenizer beside the weights, and bos/eos are its (convert.py; GPT-2's: <|endoftext|> both).
Qwen3 (qwen3.py) is this mapping with QK-norm's two [K] scales per layer.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxgpt import files
from jaxgpt.config import Config, ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.hf.weights import Tensors
from jaxgpt.tokenizer import EOT_ID  # GPT-2's <|endoftext|>: bos and eos (an export sets the run's tokenizer's)

ARCHITECTURE = "LlamaForCausalLM"

# model.* key -> (Llama's value, why Llama cannot hold another)
_LLAMA = {"norm": ("rmsnorm", "Llama's norms are RMSNorm"),
          "norm_scale": (True, "Llama's RMSNorms have a learned scale"),
          "position": ("rope", "Llama has rotary positions, no position table"),
          "mlp": ("swiglu", "Llama's MLP is SwiGLU"),
          "qk_norm": (False, "Llama has no QK-norm"),
          "logit_softcap": (0.0, "Llama does not cap its logits")}


def blockers(m: ModelConfig) -> list[str]:
    """The model.* settings Llama cannot hold, each as 'model.key=value (why)' (empty: a Llama)."""
    return [f"model.{k}={getattr(m, k)} ({why})" for k, (v, why) in _LLAMA.items() if getattr(m, k) != v]


class Mlp(NamedTuple):
    """How each layer's MLP maps (Llama's dense SwiGLU here; Mixtral's experts in mixtral.py)."""
    tensors: Callable[[dict, ModelConfig], dict[str, np.ndarray]]  # our stacked MLP -> {HF name in a layer: [L, ...]}
    shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]  # {HF name in a layer: its shape}
    params: Callable[[dict[str, np.ndarray], ModelConfig], dict]  # {HF name in a layer: [L, ...]} -> our stacked MLP


def _linear(w_L_in_out: np.ndarray, n_in: int) -> np.ndarray:
    """Our [L, in..., out...] kernel -> torch's [L, out, in]."""
    return w_L_in_out.reshape(w_L_in_out.shape[0], n_in, -1).swapaxes(1, 2)


def _ours(x_L_out_in: np.ndarray, *shape: int) -> np.ndarray:
    """torch's [L, ..., out, in] -> our [L, ..., in, *shape] (shape: how `out` splits; default whole)."""
    x = x_L_out_in.swapaxes(-1, -2)
    return x.reshape(*x.shape[:-1], *(shape or (x.shape[-1],)))


def _dense_tensors(f: dict, m: ModelConfig) -> dict[str, np.ndarray]:
    out = {"mlp.gate_proj.weight": _linear(f["c_gate_kernel"], m.n_embd),
           "mlp.up_proj.weight": _linear(f["c_fc_kernel"], m.n_embd),
           "mlp.down_proj.weight": _linear(f["c_proj_kernel"], m.mlp_width)}
    if m.bias:
        out |= {"mlp.gate_proj.bias": f["c_gate_bias"], "mlp.up_proj.bias": f["c_fc_bias"],
                "mlp.down_proj.bias": f["c_proj_bias"]}
    return out


def _dense_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    D, F = m.n_embd, m.mlp_width
    shapes = {"mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
    if m.bias:
        shapes |= {"mlp.gate_proj.bias": (F,), "mlp.up_proj.bias": (F,), "mlp.down_proj.bias": (D,)}
    return shapes


def _dense_params(hf: dict[str, np.ndarray], m: ModelConfig) -> dict:
    mlp = {"c_gate_kernel": _ours(hf["mlp.gate_proj.weight"]), "c_fc_kernel": _ours(hf["mlp.up_proj.weight"]),
           "c_proj_kernel": _ours(hf["mlp.down_proj.weight"])}
    if m.bias:
        mlp |= {"c_gate_bias": hf["mlp.gate_proj.bias"], "c_fc_bias": hf["mlp.up_proj.bias"],
                "c_proj_bias": hf["mlp.down_proj.bias"]}
    return mlp


DENSE = Mlp(_dense_tensors, _dense_shapes, _dense_params)


def _layer_tensors(blocks: dict, m: ModelConfig, mlp: Mlp) -> dict[str, np.ndarray]:
    """Our stacked blocks -> {name under model.layers.i: [L, ...HF shape]}."""
    a, D, H, K, L = blocks["attn"], m.n_embd, m.n_head, m.head_dim, m.n_layer
    if m.kv_heads == m.n_head:
        q, k, v = (a["c_attn_kernel"][:, :, i] for i in range(3))
        qb, kb, vb = (a["c_attn_bias"][:, i] for i in range(3)) if m.bias else (None,) * 3
    else:
        q, k, v = a["q_kernel"], a["kv_kernel"][:, :, 0], a["kv_kernel"][:, :, 1]
        qb, kb, vb = (a["q_bias"], a["kv_bias"][:, 0], a["kv_bias"][:, 1]) if m.bias else (None,) * 3
    out = {"input_layernorm.weight": blocks["ln_1"]["scale"],
           "post_attention_layernorm.weight": blocks["ln_2"]["scale"],
           **({"self_attn.q_norm.weight": a["q_norm"]["scale"], "self_attn.k_norm.weight": a["k_norm"]["scale"]}
              if m.qk_norm else {}),
           "self_attn.q_proj.weight": _linear(q, D), "self_attn.k_proj.weight": _linear(k, D),
           "self_attn.v_proj.weight": _linear(v, D), "self_attn.o_proj.weight": _linear(a["c_proj_kernel"], H * K)}
    if m.bias:
        out |= {"self_attn.q_proj.bias": qb.reshape(L, -1), "self_attn.k_proj.bias": kb.reshape(L, -1),
                "self_attn.v_proj.bias": vb.reshape(L, -1), "self_attn.o_proj.bias": a["c_proj_bias"]}
    return out | mlp.tensors(blocks["mlp"], m)


def _layer_shapes(m: ModelConfig, mlp: Mlp) -> dict[str, tuple[int, ...]]:
    """{name under model.layers.i: its HF shape}."""
    D, H, G, K = m.n_embd, m.n_head, m.kv_heads, m.head_dim
    shapes = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
              **({"self_attn.q_norm.weight": (K,), "self_attn.k_norm.weight": (K,)} if m.qk_norm else {}),
              "self_attn.q_proj.weight": (H * K, D), "self_attn.k_proj.weight": (G * K, D),
              "self_attn.v_proj.weight": (G * K, D), "self_attn.o_proj.weight": (D, H * K)}
    if m.bias:
        shapes |= {"self_attn.q_proj.bias": (H * K,), "self_attn.k_proj.bias": (G * K,),
                   "self_attn.v_proj.bias": (G * K,), "self_attn.o_proj.bias": (D,)}
    return shapes | mlp.shapes(m)


def to_hf(params: dict, model_cfg: ModelConfig, mlp: Mlp = DENSE, stack: tuple[str, ...] = ("blocks",)
          ) -> dict[str, np.ndarray]:
    """Our nested params -> {HF LlamaForCausalLM name: fp32 array}, vocabulary padding removed.
    `mlp` and `stack` (where the [L, ...] blocks are in our tree) are Mixtral's in mixtral.py."""
    m = model_cfg
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    blocks = functools.reduce(operator.getitem, stack, params)
    blocks = jax.tree.map(lambda x: np.asarray(x, np.float32), blocks)
    out = {"model.embed_tokens.weight": f32(np.asarray(params["wte"])[: m.vocab_size]),
           "model.norm.weight": f32(params["ln_f"]["scale"])}
    if not m.tie_embeddings:
        out["lm_head.weight"] = f32(np.asarray(params["lm_head"])[: m.vocab_size])
    for name, stacked in _layer_tensors(blocks, m, mlp).items():
        for i in range(m.n_layer):
            out[f"model.layers.{i}.{name}"] = f32(stacked[i])
    return out


def from_hf(tensors: dict[str, np.ndarray], model_cfg: ModelConfig, mlp: Mlp = DENSE,
            stack: tuple[str, ...] = ("blocks",)) -> dict:
    """{HF name: array} (LlamaForCausalLM's, or LlamaModel's without "model.") -> our nested params (fp32)."""
    m = model_cfg
    D, H, G, K, pad = m.n_embd, m.n_head, m.kv_heads, m.head_dim, m.padded_vocab - m.vocab_size
    # older exports also saved each layer's RoPE frequencies (a buffer, computed from rope_theta)
    w = Tensors({k.removeprefix("model."): v for k, v in tensors.items()
                 if not re.fullmatch(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", k)},
                "layers", m.n_layer)
    take = w.take

    def vocab(x_VD: np.ndarray) -> np.ndarray:
        return np.concatenate([x_VD, np.zeros((pad, D), np.float32)])

    wte_VD = w.take_embedding("embed_tokens.weight", m.vocab_size, D)
    params: dict[str, Any] = {"wte": vocab(wte_VD), "ln_f": {"scale": take("norm.weight", (D,))}}
    head = w.get("lm_head.weight")
    if m.tie_embeddings:
        if head is not None:
            if not np.array_equal(np.asarray(head, np.float32), wte_VD):
                raise UserError("lm_head.weight differs from embed_tokens.weight but model.tie_embeddings=true; "
                                "set model.tie_embeddings=false")
            take("lm_head.weight", head.shape)
    else:
        if head is None:
            raise UserError("tensor lm_head.weight is missing but model.tie_embeddings=false; "
                            "set model.tie_embeddings=true")
        params["lm_head"] = vocab(take("lm_head.weight", (m.vocab_size, D)))
    hf = {name: np.stack([take(f"layers.{i}.{name}", shape) for i in range(m.n_layer)])
          for name, shape in _layer_shapes(m, mlp).items()}
    w.finish()

    L = m.n_layer
    attn: dict[str, np.ndarray] = {"c_proj_kernel": _ours(hf["self_attn.o_proj.weight"]).reshape(L, H, K, D)}
    q, k, v = (_ours(hf["self_attn.q_proj.weight"], H, K), _ours(hf["self_attn.k_proj.weight"], G, K),
               _ours(hf["self_attn.v_proj.weight"], G, K))
    bias = {n: hf[f"self_attn.{n}_proj.bias"] for n in "qkv"} if m.bias else {}
    if G == H:
        attn["c_attn_kernel"] = np.stack([q, k, v], axis=2)
        if m.bias:
            attn["c_attn_bias"] = np.stack([bias[n].reshape(L, H, K) for n in "qkv"], axis=1)
    else:
        attn |= {"q_kernel": q, "kv_kernel": np.stack([k, v], axis=2)}
        if m.bias:
            attn |= {"q_bias": bias["q"].reshape(L, H, K),
                     "kv_bias": np.stack([bias[n].reshape(L, G, K) for n in "kv"], axis=1)}
    if m.bias:
        attn["c_proj_bias"] = hf["self_attn.o_proj.bias"]
    if m.qk_norm:  # Qwen3's: one [K] scale for every head's queries, one for its keys
        attn |= {"q_norm": {"scale": hf["self_attn.q_norm.weight"]}, "k_norm": {"scale": hf["self_attn.k_norm.weight"]}}
    blocks = {"ln_1": {"scale": hf["input_layernorm.weight"]}, "ln_2": {"scale": hf["post_attention_layernorm.weight"]},
              "attn": attn, "mlp": mlp.params(hf, m)}
    for key in reversed(stack):
        blocks = {key: blocks}
    return params | blocks


def hf_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """A config.json that transformers.LlamaConfig (4.x and 5.x) reads as this model."""
    m = model_cfg
    return {"architectures": [ARCHITECTURE], "model_type": "llama", "vocab_size": m.vocab_size,
            "hidden_size": m.n_embd, "intermediate_size": m.mlp_width, "num_hidden_layers": m.n_layer,
            "num_attention_heads": m.n_head, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
            "hidden_act": "silu", "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
            "attention_bias": m.bias, "mlp_bias": m.bias, "attention_dropout": 0.0,
            "tie_word_embeddings": m.tie_embeddings, "bos_token_id": EOT_ID, "eos_token_id": EOT_ID, "dtype": "float32"}


# config.json key -> (our key, LlamaConfig's default)
_SIZES = {"num_hidden_layers": ("model.n_layer", 32), "num_attention_heads": ("model.n_head", 32),
          "hidden_size": ("model.n_embd", 4096), "intermediate_size": ("model.mlp_hidden", 11008),
          "max_position_embeddings": ("model.seq_len", 2048), "vocab_size": ("model.vocab_size", 32000)}
# The config.json keys we read, with their JSON types (LlamaConfig's own).
CONFIG_SHAPE = {"model_type": str, "hidden_act": str, "rms_norm_eps": files.NUMBER, "head_dim": (int, type(None)),
                "num_key_value_heads": (int, type(None)), "rope_theta": files.NUMBER,
                "rope_parameters": (dict, type(None)), "rope_scaling": (dict, type(None)), "attention_bias": bool,
                "mlp_bias": bool, "tie_word_embeddings": bool} | {key: int for key in _SIZES}


def _rope(hf_cfg: dict[str, Any]) -> tuple[float, str]:
    """(rope_theta, rope type) from transformers 5's rope_parameters or 4's rope_theta + rope_scaling."""
    params = hf_cfg.get("rope_parameters") or {}
    scaling = hf_cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf_cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    return theta, kind


def model_overrides(hf_cfg: dict[str, Any], sizes: dict[str, tuple[str, Any]] = _SIZES, fixed: dict = _LLAMA,
                    eps_default: float = 1e-6) -> dict[str, Any]:
    """config.json -> the model.* keys it implies, the architecture keys included (`sizes`: the
    config.json key -> (our key, the class's default) table, `fixed`: the architecture keys the
    class fixes, and its rms_norm_eps default; Mixtral's and Qwen3's in mixtral.py and qwen3.py)."""
    ours = {key: hf_cfg.get(name, default) for name, (key, default) in sizes.items()}
    kv = hf_cfg.get("num_key_value_heads") or ours["model.n_head"]
    head_dim = hf_cfg.get("head_dim") or ours["model.n_embd"] // ours["model.n_head"]
    return ours | {"model.n_kv_head": kv, "model.rope_theta": _rope(hf_cfg)[0],
                   "model.head_size": 0 if head_dim * ours["model.n_head"] == ours["model.n_embd"] else head_dim,
                   "model.norm_eps": float(hf_cfg.get("rms_norm_eps", eps_default)),
                   "model.tie_embeddings": hf_cfg.get("tie_word_embeddings", False),
                   "model.bias": hf_cfg.get("attention_bias", False)} | {
        f"model.{k}": v for k, (v, _) in fixed.items()}


def check_config(hf_cfg: dict[str, Any], m: ModelConfig, source: Path,
                 overrides: Callable[[dict[str, Any]], dict[str, Any]] = model_overrides,
                 name: str = "Llama", fixed: Sequence[tuple[str, Any, Any]] = ()) -> None:
    """UserError (one line) unless config.json describes exactly the Llama (or, with another class's
    `overrides` and `fixed` (key, value there, the one value jaxgpt holds), the Mixtral or Qwen3)
    that `m` is."""
    theta, kind = _rope(hf_cfg)
    fixed = [("hidden_act", hf_cfg.get("hidden_act", "silu"), "silu"), ("rope_type", kind, "default"),
             ("mlp_bias", hf_cfg.get("mlp_bias", False), hf_cfg.get("attention_bias", False)), *fixed]
    for key, have, want in fixed:
        if have != want:
            raise UserError(f"{source}: {key}={have!r} is not supported (jaxgpt's {name} has {want!r}"
                            + (", as attention_bias: one model.bias for both)" if key == "mlp_bias" else ")"))
    widths = {"model.n_kv_head": m.kv_heads, "model.mlp_hidden": m.mlp_width, "model.moe_mlp_hidden": m.expert_width,
              "model.head_size": 0 if m.head_dim * m.n_head == m.n_embd else m.head_dim}
    wrong = []
    for key, want in overrides(hf_cfg).items():
        have = widths.get(key, getattr(m, key.removeprefix("model.")))
        if (want < have) if key == "model.seq_len" else (want != have):  # a shorter context is the same model
            wrong.append((key, want, have))
    if wrong:
        raise UserError(f"{source} does not match the model config ("
                        + ", ".join(f"{key}={have} vs {want} there" for key, want, have in wrong)
                        + "); override with " + " ".join(f"{key}={want}" for key, want, _ in wrong))

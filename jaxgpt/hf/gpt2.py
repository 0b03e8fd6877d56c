"""Hugging Face GPT-2 interop: jaxgpt's GPT-2 as transformers' `GPT2LMHeadModel` (for convert.py).

Our parameters (jaxgpt/model/gpt.py) are stored so that every HF `GPT2LMHeadModel` tensor is a plain
row-major reshape of one layer's slice; nothing is transposed. HF's `Conv1D` weights are [in, out]:

    ours (blocks stacked on L)                HF (per layer i; "transformer." prefix optional)
    wte                  [Vp, D]              wte.weight            [V, D]  first V rows; lm_head tied
    wpe                  [T, D]               wpe.weight            [T, D]
    blocks.ln_1.scale    [L, D]               h.i.ln_1.weight       [D]     (bias alike; ln_2, ln_f)
    blocks.attn.c_attn_kernel [L, D, 3, H, K] h.i.attn.c_attn.weight [D, 3D] columns q|k|v, heads inside
    blocks.attn.c_attn_bias   [L, 3, H, K]    h.i.attn.c_attn.bias   [3D]
    blocks.attn.c_proj_kernel [L, H, K, D]    h.i.attn.c_proj.weight [D, D]  rows head-major
    blocks.mlp.c_fc_kernel    [L, D, F]       h.i.mlp.c_fc.weight    [D, F]
    blocks.mlp.c_proj_kernel  [L, F, D]       h.i.mlp.c_proj.weight  [F, D]

The functions agree with GPT-2 on everything else: LayerNorm eps 1e-5, GELU with the tanh
approximation (`gelu_new`), attention scaled by 1/sqrt(K), tied input/output embedding. The
vocabulary padding (jaxgpt/model/gpt.py) is dropped on export and zero-filled on import; padded logits are
-inf, so those rows never matter. On import a longer position table than `model.seq_len` is cut
to its first T rows (positions are absolute, so a prefix is the same model on shorter contexts).
HF's causal-mask buffers (`h.i.attn.bias`, `masked_bias`) are ignored.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt import files
from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.hf.weights import Tensors
from jaxgpt.tokenizer import EOT_ID

ARCHITECTURE = "GPT2LMHeadModel"


def _layer_table(m: ModelConfig) -> dict[str, tuple[tuple[str, str], tuple[int, ...], tuple[int, ...]]]:
    """HF name inside h.{i} -> (our path under blocks, HF shape, our per-layer shape)."""
    D, F, H, K = m.n_embd, 4 * m.n_embd, m.n_head, m.head_dim
    table = {f"{ln}.{hf}": ((ln, ours), (D,), (D,)) for ln in ("ln_1", "ln_2")
             for hf, ours in (("weight", "scale"), ("bias", "bias"))}
    return table | {
        "attn.c_attn.weight": (("attn", "c_attn_kernel"), (D, 3 * D), (D, 3, H, K)),
        "attn.c_attn.bias": (("attn", "c_attn_bias"), (3 * D,), (3, H, K)),
        "attn.c_proj.weight": (("attn", "c_proj_kernel"), (D, D), (H, K, D)),
        "attn.c_proj.bias": (("attn", "c_proj_bias"), (D,), (D,)),
        "mlp.c_fc.weight": (("mlp", "c_fc_kernel"), (D, F), (D, F)),
        "mlp.c_fc.bias": (("mlp", "c_fc_bias"), (F,), (F,)),
        "mlp.c_proj.weight": (("mlp", "c_proj_kernel"), (F, D), (F, D)),
        "mlp.c_proj.bias": (("mlp", "c_proj_bias"), (D,), (D,)),
    }


def to_hf(params: dict, model_cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our nested params -> {HF GPT2LMHeadModel name: fp32 array}, vocabulary padding removed."""
    def f32(x) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x, np.float32))

    out = {"transformer.wte.weight": f32(np.asarray(params["wte"])[: model_cfg.vocab_size]),
           "transformer.wpe.weight": f32(params["wpe"]),
           "transformer.ln_f.weight": f32(params["ln_f"]["scale"]),
           "transformer.ln_f.bias": f32(params["ln_f"]["bias"])}
    for name, ((group, key), hf_shape, _) in _layer_table(model_cfg).items():
        stacked = np.asarray(params["blocks"][group][key], np.float32)
        for i in range(model_cfg.n_layer):
            out[f"transformer.h.{i}.{name}"] = f32(stacked[i].reshape(hf_shape))
    return out


def from_hf(tensors: dict[str, np.ndarray], model_cfg: ModelConfig) -> dict:
    """{HF name: array} (with or without the "transformer." prefix) -> our nested params (fp32 numpy)."""
    m = model_cfg
    w = Tensors({k.removeprefix("transformer."): v for k, v in tensors.items()
                 if not re.fullmatch(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias", k)}, "h", m.n_layer)
    take = w.take
    wte_VD = w.take_embedding("wte.weight", m.vocab_size, m.n_embd)
    wpe = w.get("wpe.weight")
    if wpe is not None and wpe.ndim == 2 and wpe.shape[0] > m.seq_len:
        w.put("wpe.weight", wpe[: m.seq_len])  # a shorter context: keep the first positions
    params: dict[str, Any] = {
        "wte": np.concatenate([wte_VD, np.zeros((m.padded_vocab - m.vocab_size, m.n_embd), np.float32)]),
        "wpe": take("wpe.weight", (m.seq_len, m.n_embd), f" (model.seq_len={m.seq_len} is longer than the table)"),
        "ln_f": {"scale": take("ln_f.weight", (m.n_embd,)), "bias": take("ln_f.bias", (m.n_embd,))},
        "blocks": {"ln_1": {}, "ln_2": {}, "attn": {}, "mlp": {}},
    }
    for name, ((group, key), hf_shape, our_shape) in _layer_table(m).items():
        params["blocks"][group][key] = np.stack(
            [take(f"h.{i}.{name}", hf_shape).reshape(our_shape) for i in range(m.n_layer)])
    head = w.get("lm_head.weight")
    if head is not None:
        if not np.array_equal(np.asarray(head, np.float32), wte_VD):
            raise UserError("lm_head.weight differs from wte.weight: only GPT-2's tied output head is supported")
        take("lm_head.weight", head.shape)
    w.finish()
    return params


def hf_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """A config.json that transformers.GPT2Config reads as this model (no dropout, as we train)."""
    m = model_cfg
    return {"architectures": [ARCHITECTURE], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_positions": m.seq_len, "n_embd": m.n_embd, "n_layer": m.n_layer, "n_head": m.n_head,
            "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True,
            "bos_token_id": EOT_ID, "eos_token_id": EOT_ID, "dtype": "float32"}  # "torch_dtype" before transformers 4.56


# config.json key -> (our key, GPT2Config's default)
_SIZES = {"n_layer": ("model.n_layer", 12), "n_head": ("model.n_head", 12), "n_embd": ("model.n_embd", 768),
          "n_positions": ("model.seq_len", 1024), "vocab_size": ("model.vocab_size", 50257)}
# GPT2Config options our GPT-2 has one value of: key -> (GPT2Config's default, the values we accept)
_FIXED = {"activation_function": ("gelu_new", ("gelu_new", "gelu_pytorch_tanh")),  # both are tanh GELU
          "layer_norm_epsilon": (1e-5, (1e-5,)), "scale_attn_weights": (True, (True,)),
          "scale_attn_by_inverse_layer_idx": (False, (False,)), "tie_word_embeddings": (True, (True,))}


def model_overrides(hf_cfg: dict[str, Any]) -> dict[str, int]:
    """config.json -> the model.* keys it implies ({'model.n_layer': 12, ...})."""
    return {ours: hf_cfg.get(key, default) for key, (ours, default) in _SIZES.items()}


def check_config(hf_cfg: dict[str, Any], m: ModelConfig, source: Path) -> None:
    if m.beyond_gpt2():
        raise UserError(f"{source} describes a GPT-2 but the model config sets {', '.join(m.beyond_gpt2())}; "
                        f"drop those keys")
    fixed = _FIXED | {"n_inner": (None, (None, 4 * hf_cfg.get("n_embd", 768)))}
    for key, (default, allowed) in fixed.items():
        if hf_cfg.get(key, default) not in allowed:
            raise UserError(f"{source}: {key}={hf_cfg[key]!r} is not supported (jaxgpt's GPT-2 has {allowed[0]!r})")
    wrong = []
    for key, (ours, default) in _SIZES.items():
        have, want = hf_cfg.get(key, default), getattr(m, ours.removeprefix("model."))
        # a longer position table is fine: from_hf keeps its first seq_len rows
        if have < want if key == "n_positions" else have != want:
            wrong.append((key, have, ours, want))
    if wrong:
        raise UserError(f"{source} does not match the model config ("
                        + ", ".join(f"{key} {have} vs {ours}={want}" for key, have, ours, want in wrong)
                        + "); override with " + " ".join(f"{ours}={have}" for _, have, ours, _ in wrong))


# The config.json keys we read, with their JSON types (GPT2Config's own types).
CONFIG_SHAPE = {"model_type": str, "activation_function": str, "layer_norm_epsilon": files.NUMBER,
                 "scale_attn_weights": bool, "scale_attn_by_inverse_layer_idx": bool, "tie_word_embeddings": bool,
                 "n_inner": (int, type(None))} | {key: int for key in _SIZES}

"""Issue 61 item 2: Qwen3 and Qwen3-MoE. The mapping is exact both ways, and the exported tensors run
through an independent NumPy Qwen3ForCausalLM / Qwen3MoeForCausalLM (QK-norm with its [K] scales, a
head_dim of its own, rms_norm_eps 1e-6, norm_topk_prob) give our logits; with torch installed,
transformers' classes do too (run by hand: the CI has no torch)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config
from safetensors.numpy import save_file
from test_hf import ATOL, _assert_same_but_padding, _perturbed, _rope_hf, _silu, _tokens

from jaxgpt.errors import UserError
from jaxgpt.hf import CONFIG, WEIGHTS, architecture, load_dir, qwen3

# Qwen3's shape in small: grouped-query heads 16 wide on a 32-wide model (head_dim != n_embd / n_head, as
# Qwen3-0.6B's 128 on 1024 with 16 heads), its eps, a theta of its own, its own tokenizer's vocabulary.
QWEN3 = ["model.n_embd=32", "model.n_head=4", "model.n_kv_head=2", "model.head_size=16", "model.norm=rmsnorm",
         "model.position=rope", "model.mlp=swiglu", "model.mlp_hidden=48", "model.bias=false", "model.qk_norm=true",
         "model.norm_eps=1e-6", "model.rope_theta=1000000.0", "model.vocab_size=387", "model.document_token=384"]
QWEN3_MOE = [*QWEN3, "model.moe_experts=4", "model.moe_top_k=2", "model.moe_mlp_hidden=24", "model.moe_norm_topk=false",
             "model.moe_capacity_factor=2.0", "model.tie_embeddings=false"]


def _rms(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def _qwen3_moe(p: dict, m_BTD: np.ndarray, c: dict) -> np.ndarray:
    """transformers' Qwen3MoeSparseMoeBlock: softmax router, top k, renormalised only if norm_topk_prob."""
    probs_BTE = np.exp(m_BTD @ p["mlp.gate.weight"].T)
    probs_BTE /= probs_BTE.sum(-1, keepdims=True)
    top_BTK = np.argsort(-probs_BTE, axis=-1, kind="stable")[..., :c["num_experts_per_tok"]]
    weights_BTK = np.take_along_axis(probs_BTE, top_BTK, -1)
    if c["norm_topk_prob"]:
        weights_BTK /= weights_BTK.sum(-1, keepdims=True)
    out_BTD = np.zeros_like(m_BTD)
    for e in range(c["num_experts"]):
        g, u, d = (p[f"mlp.experts.{e}.{w}_proj.weight"] for w in ("gate", "up", "down"))
        out_BTD += (weights_BTK * (top_BTK == e)).sum(-1, keepdims=True) * ((_silu(m_BTD @ g.T) * (m_BTD @ u.T)) @ d.T)
    return out_BTD


def _dense(p: dict, m_BTD: np.ndarray, c: dict) -> np.ndarray:
    return (_silu(m_BTD @ p["mlp.gate_proj.weight"].T) * (m_BTD @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T


def qwen3_logits(t: dict[str, np.ndarray], c: dict, tokens_BT: np.ndarray) -> np.ndarray:
    """Qwen3's forward pass (transformers' Qwen3ForCausalLM, or Qwen3MoeForCausalLM) from HF's tensors and
    config.json alone, in float64: q and k RMS-normalised per head with their [K] scales, then RoPE."""
    t = {k.removeprefix("model."): v.astype(np.float64) for k, v in t.items()}
    B, T = tokens_BT.shape
    H, G, K, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    mlp = _qwen3_moe if c["model_type"] == "qwen3_moe" else _dense
    future_TT = np.triu(np.ones((T, T), bool), 1)
    x_BTD = t["embed_tokens.weight"][tokens_BT]
    for i in range(c["num_hidden_layers"]):
        p = {k.removeprefix(f"layers.{i}."): v for k, v in t.items() if k.startswith(f"layers.{i}.")}
        a_BTD = _rms(x_BTD, p["input_layernorm.weight"], eps)
        q_BHTK, k_BGTK, v_BGTK = ((a_BTD @ p[f"self_attn.{n}_proj.weight"].T).reshape(B, T, -1, K).transpose(0, 2, 1, 3)
                                  for n in "qkv")
        q_BHTK = _rope_hf(_rms(q_BHTK, p["self_attn.q_norm.weight"], eps), c["rope_theta"])
        k_BGTK = _rope_hf(_rms(k_BGTK, p["self_attn.k_norm.weight"], eps), c["rope_theta"])
        k_BHTK, v_BHTK = (np.repeat(z, H // G, axis=1) for z in (k_BGTK, v_BGTK))
        s_BHTT = np.where(future_TT, -np.inf, q_BHTK @ k_BHTK.transpose(0, 1, 3, 2) / np.sqrt(K))
        w_BHTT = np.exp(s_BHTT - s_BHTT.max(-1, keepdims=True))
        w_BHTT /= w_BHTT.sum(-1, keepdims=True)
        x_BTD = x_BTD + (w_BHTT @ v_BHTK).transpose(0, 2, 1, 3).reshape(B, T, H * K) @ p["self_attn.o_proj.weight"].T
        x_BTD = x_BTD + mlp(p, _rms(x_BTD, p["post_attention_layernorm.weight"], eps), c)
    head_VD = t.get("lm_head.weight", t["embed_tokens.weight"])
    return _rms(x_BTD, t["norm.weight"], eps) @ head_VD.T


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    cfg = tiny_config(*(QWEN3 if request.param == "dense" else QWEN3_MOE))
    fmt = qwen3 if request.param == "dense" else qwen3.Moe
    return cfg, fmt, *_perturbed(cfg)


def test_round_trip_exact_and_numpy_qwen3_gives_our_logits(model, tmp_path):
    cfg, fmt, graphdef, params = model
    m = cfg.model
    assert architecture(m) == ("qwen3" if fmt is qwen3 else "qwen3_moe")
    tensors, c = fmt.to_hf(params, m), fmt.hf_config(m)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (4 * 16, 32)  # H * head_dim != n_embd
    assert tensors["model.layers.1.self_attn.q_norm.weight"].shape == (16,)
    _assert_same_but_padding(fmt.from_hf(tensors, m), params, m.vocab_size)
    tokens_BT = _tokens(cfg)
    ours_BTV = np.asarray(nnx.merge(graphdef, params)(tokens_BT))[..., : m.vocab_size]
    ref_BTV = qwen3_logits(tensors, c, tokens_BT)
    assert ref_BTV.std() > 0.3
    np.testing.assert_allclose(ours_BTV, ref_BTV, rtol=0, atol=ATOL)
    # each of Qwen3's own choices shows: no QK-norm, Llama's eps, or (MoE) renormalised top-k moves the logits
    off = [{"rms_norm_eps": 1e-2}] + ([{"norm_topk_prob": True}] if fmt is not qwen3 else [])
    for change in off:
        assert np.abs(qwen3_logits(tensors, c | change, tokens_BT) - ours_BTV).max() > 100 * ATOL, change
    # config.json back to the same model.* keys, and load_dir through the directory
    save_file(tensors, tmp_path / WEIGHTS)
    (tmp_path / CONFIG).write_text(json.dumps(c))
    _assert_same_but_padding(load_dir(tmp_path, m), params, m.vocab_size)
    implied = fmt.model_overrides(c)
    assert all(getattr(m, k.removeprefix("model.")) == v for k, v in implied.items()), implied
    (tmp_path / CONFIG).write_text(json.dumps(c | {"use_sliding_window": True}))
    with pytest.raises(UserError, match="use_sliding_window=True is not supported"):
        load_dir(tmp_path, m)


@pytest.mark.parametrize("keys, line", [
    ([*QWEN3, "model.bias=true"], "nor can Qwen3ForCausalLM, for model.bias=True (Qwen3's MLP has no biases)"),
    ([*QWEN3_MOE, "model.moe_every=2", "model.n_layer=2"], "nor can Qwen3MoeForCausalLM, for model.moe_every=2"),
])
def test_what_qwen3_cannot_hold_is_one_line(keys, line):
    with pytest.raises(UserError) as e:
        architecture(tiny_config(*keys).model)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_transformers_qwen3_gives_our_logits(model, tmp_path):
    """By hand (torch): transformers' own Qwen3 classes on the export."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, fmt, graphdef, params = model
    save_file(fmt.to_hf(params, cfg.model), tmp_path / WEIGHTS, metadata={"format": "pt"})
    (tmp_path / CONFIG).write_text(json.dumps(fmt.hf_config(cfg.model)))
    cls = transformers.Qwen3ForCausalLM if fmt is qwen3 else transformers.Qwen3MoeForCausalLM
    hf_model = cls.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens_BT = _tokens(cfg)
    with torch.no_grad():
        theirs_BTV = hf_model(torch.as_tensor(tokens_BT)).logits.numpy()
    ours_BTV = np.asarray(nnx.merge(graphdef, params)(tokens_BT))[..., : cfg.model.vocab_size]
    print(f"max |ours - transformers {cls.__name__}| = {np.abs(ours_BTV - theirs_BTV).max():.2e}")
    np.testing.assert_allclose(ours_BTV, theirs_BTV, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory):
    """An HF Qwen3 directory with its own tokenizer (built here), `hf import`ed as a run, exported back."""
    from helpers import qwen_tokenizer

    from jaxgpt import hf

    tmp = tmp_path_factory.mktemp("qwen3")
    cfg = tiny_config(*QWEN3)
    graphdef, params = _perturbed(cfg)
    qwen_tokenizer(tmp / "source")
    save_file(qwen3.to_hf(params, cfg.model), tmp / "source" / WEIGHTS)
    (tmp / "source" / CONFIG).write_text(json.dumps(qwen3.hf_config(cfg.model)))
    assert hf.main(["import", str(tmp / "source"), str(tmp / "run"), "model.loss_chunk=8"]) == 0
    assert hf.export(tmp / "run", tmp / "out") == 0
    return cfg, graphdef, params, tmp


def test_an_imported_qwen3_keeps_its_tokenizer_and_exports_it(qwen3_dirs):
    from transformers import AutoTokenizer

    from jaxgpt import tokenizer
    from jaxgpt.hf import restore_params

    cfg, _, params, tmp = qwen3_dirs
    restored, run_cfg, _ = restore_params(tmp / "run")
    assert run_cfg.data.tokenizer == str(tmp / "run" / "tokenizer") and run_cfg.model.document_token == 384
    _assert_same_but_padding(restored, params, cfg.model.vocab_size)
    assert (tmp / "out" / "tokenizer.json").read_bytes() == (tmp / "source" / "tokenizer.json").read_bytes()
    auto = AutoTokenizer.from_pretrained(tmp / "out")
    assert auto("ROMEO: héllo", add_special_tokens=False).input_ids == \
        tokenizer.load(str(tmp / "source")).encode_special("ROMEO: héllo")


def test_transformers_qwen3_greedy_text_is_jaxgpt_samples(qwen3_dirs, capsys):
    """By hand (torch): Qwen3ForCausalLM + AutoTokenizer on the export, logits to 1e-5 and greedy
    `generate` == `python -m jaxgpt.sample --temperature 0` on the imported run."""
    from test_hf import _transformers_matches

    hf_model = _transformers_matches(qwen3_dirs, "Qwen3ForCausalLM", capsys)
    assert type(hf_model.model.layers[0].self_attn).__name__ == "Qwen3Attention"

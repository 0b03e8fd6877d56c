"""Hugging Face GPT-2 interop: the layout mapping is exact, and the exported tensors *are* GPT-2.

The second claim is checked against an independent NumPy GPT-2 written from HF's layout (and,
where torch and transformers are installed, against `GPT2LMHeadModel` itself)."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, read_metrics, run_cli, tiny_config
from safetensors.numpy import save_file

from jaxgpt.cli import EXIT_USER_ERROR
from jaxgpt.errors import UserError
from jaxgpt.hf import (CONFIG, EXPORT_FILES, GENERATION_CONFIG, WEIGHTS, export, from_hf, hf_config, load_dir,
                       restore_params, to_hf)
from jaxgpt.model import GPT
from jaxgpt.train import train

# Our fp32 forward (XLA:CPU, different summation order, rsqrt, tanh) against a float64 reference:
# logits here are O(1) sums over D=32..128 terms through 2 layers, so fp32 rounding leaves errors
# around 1e-6; 1e-4 is well clear of that yet far below any layout mistake (which moves logits by
# O(0.1): a transposed head, a swapped q/k, a wrong GELU or eps all fail it).
ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    """The tiny model with every parameter perturbed, so biases and LayerNorms are not trivial."""
    cfg = tiny_config()
    graphdef, state = nnx.split(GPT(cfg.model, nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(state)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [np.asarray(x + 0.1 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]
    return cfg, graphdef, jax.tree.unflatten(tree, leaves)


def _flat(params: dict) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def _assert_same_but_padding(got: dict, want: dict, vocab_size: int) -> None:
    got, want = _flat(got), _flat(want)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == np.float32 and got[name].shape == want[name].shape, name
        if name == "wte":
            np.testing.assert_array_equal(got[name][:vocab_size], want[name][:vocab_size])
            assert not got[name][vocab_size:].any(), "padding rows are imported as zeros"
        else:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_round_trip_is_exact(model):
    cfg, _, params = model
    tensors = to_hf(params, cfg.model)
    m = cfg.model
    assert len(tensors) == 4 + 12 * m.n_layer
    assert tensors["transformer.wte.weight"].shape == (m.vocab_size, m.n_embd)
    assert tensors["transformer.h.1.attn.c_attn.weight"].shape == (m.n_embd, 3 * m.n_embd)
    assert tensors["transformer.h.1.mlp.c_proj.weight"].shape == (4 * m.n_embd, m.n_embd)
    _assert_same_but_padding(from_hf(tensors, m), params, m.vocab_size)
    # the original gpt2 repo's names: no "transformer." prefix, causal-mask buffers, a tied lm_head
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    bare |= {"h.0.attn.bias": np.tril(np.ones((1, 1, 32, 32))), "lm_head.weight": bare["wte.weight"]}
    _assert_same_but_padding(from_hf(bare, m), params, m.vocab_size)


def _gelu_new(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b


def _hf_gpt2_logits(t: dict[str, np.ndarray], n_head: int, tokens_BT: np.ndarray) -> np.ndarray:
    """GPT-2's forward pass from HF's tensors alone, in float64."""
    t = {k.removeprefix("transformer."): v.astype(np.float64) for k, v in t.items()}
    B, T = tokens_BT.shape
    D = t["wte.weight"].shape[1]
    H, K = n_head, D // n_head
    x_BTD = t["wte.weight"][tokens_BT] + t["wpe.weight"][:T]
    future_TT = np.triu(np.ones((T, T), bool), 1)
    for i in range(sum(k.endswith(".ln_1.weight") for k in t)):
        p = {k.removeprefix(f"h.{i}."): v for k, v in t.items() if k.startswith(f"h.{i}.")}
        a_BTD = _layer_norm(x_BTD, p["ln_1.weight"], p["ln_1.bias"])
        qkv_BT3D = a_BTD @ p["attn.c_attn.weight"] + p["attn.c_attn.bias"]
        q_BHTK, k_BHTK, v_BHTK = (z.reshape(B, T, H, K).transpose(0, 2, 1, 3) for z in np.split(qkv_BT3D, 3, -1))
        s_BHTT = np.where(future_TT, -np.inf, q_BHTK @ k_BHTK.transpose(0, 1, 3, 2) / np.sqrt(K))
        w_BHTT = np.exp(s_BHTT - s_BHTT.max(-1, keepdims=True))
        w_BHTT /= w_BHTT.sum(-1, keepdims=True)
        y_BTD = (w_BHTT @ v_BHTK).transpose(0, 2, 1, 3).reshape(B, T, D)
        x_BTD = x_BTD + y_BTD @ p["attn.c_proj.weight"] + p["attn.c_proj.bias"]
        m_BTD = _layer_norm(x_BTD, p["ln_2.weight"], p["ln_2.bias"])
        h_BTF = _gelu_new(m_BTD @ p["mlp.c_fc.weight"] + p["mlp.c_fc.bias"])
        x_BTD = x_BTD + h_BTF @ p["mlp.c_proj.weight"] + p["mlp.c_proj.bias"]
    x_BTD = _layer_norm(x_BTD, t["ln_f.weight"], t["ln_f.bias"])
    return x_BTD @ t["wte.weight"].T


def _tokens(cfg) -> np.ndarray:
    return np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, cfg.model.seq_len))


def test_exported_tensors_are_gpt2(model):
    cfg, graphdef, params = model
    tokens_BT = _tokens(cfg)
    ours_BTV = np.asarray(nnx.merge(graphdef, params)(tokens_BT))[..., : cfg.model.vocab_size]
    ref_BTV = _hf_gpt2_logits(to_hf(params, cfg.model), cfg.model.n_head, tokens_BT)
    assert ref_BTV.std() > 0.3  # the perturbed model's logits are far from constant
    np.testing.assert_allclose(ours_BTV, ref_BTV, rtol=0, atol=ATOL)


def _assert_tokenizer_is_jaxgpts(hf_dir) -> None:
    """AutoTokenizer on the exported files encodes (and decodes) exactly as jaxgpt's tiktoken GPT-2."""
    from transformers import AutoTokenizer

    from jaxgpt.tokenizer import gpt2_encoding

    enc, tok = gpt2_encoding(), AutoTokenizer.from_pretrained(hf_dir)
    assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == (50256, 50256, 50257)
    rng = np.random.default_rng(0)
    pieces = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "a", "Zz", "7", "42", "'s", "'LL", "'", "é", "ß", "日本",
              "🤖", "e\u0301", "\u00a0", "\u3000", ".", "--", "<|endoftext|>", "<|endoftext|"]
    texts = ["Hello world", " Hello  world  ", "\t\t x \n  \n   ", "I'll DON'T they're we've", "3.14159 1e-3",
             "héllo wörld ☃ 🤖 日本語 עברית", "<|endoftext|>", "a<|endoftext|>b", " <|endoftext|> x",
             "   ", "", (REPO / "jaxgpt" / "assets" / "tinyshakespeare.txt").read_text()[:20_000]]
    texts += ["".join(rng.choice(pieces, 30)) for _ in range(200)]
    for text in texts:
        ids = enc.encode(text, allowed_special="all")
        assert tok.encode(text) == ids, repr(text)
        assert tok.decode(ids) == text, repr(text)
    assert tok.encode("<|endoftext|>") == [50256] and enc.encode_ordinary("ROMEO: hi") == tok.encode("ROMEO: hi")


def test_export_from_a_run_and_load_back(tmp_path, shakespeare_dir):
    cfg = tiny_config("train.steps=2", mesh="dp=8")
    state = train(cfg, tmp_path / "run")
    assert export(tmp_path / "run", tmp_path / "hf") == 2
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(EXPORT_FILES)
    hf = json.loads((tmp_path / "hf" / CONFIG).read_text())
    want = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_positions": 32,
            "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256,
            "dtype": "float32", "torch_dtype": "missing"}
    assert {k: hf.get(k, "missing") for k in want} == want
    assert json.loads((tmp_path / "hf" / GENERATION_CONFIG).read_text()) == {"bos_token_id": 50256,
                                                                             "eos_token_id": 50256}
    _assert_tokenizer_is_jaxgpts(tmp_path / "hf")
    _assert_same_but_padding(load_dir(tmp_path / "hf", cfg.model), jax.device_get(state.params),
                             cfg.model.vocab_size)
    proc = run_cli("check", str(tmp_path / "hf"), module="jaxgpt.hf")
    assert proc.returncode == 0, proc.stderr
    assert "model.n_layer=2 model.n_head=4 model.n_embd=32 model.seq_len=32" in proc.stdout


def test_mismatches_are_user_errors_naming_them(model, tmp_path):
    cfg, _, params = model
    tensors = to_hf(params, cfg.model)
    with pytest.raises(UserError, match=r"2 layers but model.n_layer=3; set model.n_layer=2"):
        from_hf(tensors, dataclasses.replace(cfg.model, n_layer=3))
    with pytest.raises(UserError, match=r"wte.weight has shape \(50257, 32\) but the model config needs \(50257, 64\)"):
        from_hf(tensors, dataclasses.replace(cfg.model, n_embd=64))
    with pytest.raises(UserError, match=r"unexpected tensors in the weights: h.0.extra"):
        from_hf(tensors | {"transformer.h.0.extra": np.zeros(1)}, cfg.model)
    save_file(tensors, tmp_path / WEIGHTS)
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(cfg.model)))
    with pytest.raises(UserError, match=r"n_layer 2 vs model.n_layer=12.*override with model.n_layer=2"):
        load_dir(tmp_path, dataclasses.replace(cfg.model, n_layer=12))


def test_cli_missing_dir_is_one_line(tmp_path):
    proc = run_cli("check", "/nonexistent", module="jaxgpt.hf")
    assert proc.returncode == EXIT_USER_ERROR and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "/nonexistent" in errors[0], proc.stderr


def test_transformers_loads_the_export(model, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, graphdef, params = model
    save_file(to_hf(params, cfg.model), tmp_path / WEIGHTS, metadata={"format": "pt"})
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(cfg.model)))
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    tokens_BT = _tokens(cfg)
    with torch.no_grad():
        theirs_BTV = hf_model(torch.as_tensor(tokens_BT)).logits.numpy()
    ours_BTV = np.asarray(nnx.merge(graphdef, params)(tokens_BT))[..., : cfg.model.vocab_size]
    np.testing.assert_allclose(ours_BTV, theirs_BTV, rtol=0, atol=ATOL)


def test_a_run_starts_from_exported_hf_weights(tmp_path, shakespeare_dir):
    """checkpoint.init_from_hf: the first step of a new run uses exactly the imported weights."""
    source = tmp_path / "source"
    train(tiny_config("train.steps=3", mesh="dp=8"), source)
    export(source, tmp_path / "hf")
    run = tmp_path / "finetune"
    state = train(tiny_config("train.steps=1", f"checkpoint.init_from_hf={tmp_path / 'hf'}", "optimizer.lr=1e-12",
                              mesh="fsdp=4,tp=2"), run)
    want = load_dir(tmp_path / "hf", tiny_config().model)
    np.testing.assert_allclose(np.asarray(state.params["blocks"]["mlp"]["c_fc_kernel"]),
                               want["blocks"]["mlp"]["c_fc_kernel"], atol=1e-9)
    assert int(state.step) == 1 and read_metrics(run)[-1]["step"] == 1


def test_import_makes_a_run_that_samples_exports_and_trains(model, tmp_path, capsys):
    """python -m jaxgpt.hf import: HF weights -> a step-0 checkpoint, read back exactly by restore_params
    (what sample and export use), exported back to the same tensors, and resumed by train."""
    from safetensors.numpy import load_file

    from jaxgpt import hf, sample

    cfg, _, params = model
    source = tmp_path / "gpt2"
    source.mkdir()
    save_file(to_hf(params, cfg.model), source / WEIGHTS)
    (source / CONFIG).write_text(json.dumps(hf_config(cfg.model)))
    run = tmp_path / "run"
    # model.loss_chunk is a compute setting config.json cannot carry: give the tiny config's
    assert hf.main(["import", str(source), str(run), "train.steps=1", "model.loss_chunk=8",
                    "--config", "shakespeare"]) == 0
    assert "model.n_layer=2 model.n_head=4 model.n_embd=32 model.seq_len=32" in capsys.readouterr().out
    restored, run_cfg, step = restore_params(run)
    assert step == 0 and run_cfg.model == cfg.model and run_cfg.train.steps == 1
    _assert_same_but_padding(jax.device_get(restored), params, cfg.model.vocab_size)

    assert export(run, tmp_path / "out") == 0
    back, original = load_file(tmp_path / "out" / WEIGHTS), load_file(source / WEIGHTS)
    assert back.keys() == original.keys() and all(np.array_equal(back[k], original[k]) for k in original)

    assert sample.main([str(run), "--prompt", "ROMEO:", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    assert hf.main(["import", str(source), str(run)]) == EXIT_USER_ERROR  # never over an existing run
    assert "already holds checkpoints" in capsys.readouterr().err

    state = train(tiny_config("train.steps=1", mesh="dp=8"), run)  # resumes the imported step 0: full state
    assert int(state.step) == 1 and [r["step"] for r in read_metrics(run) if "loss" in r] == [1]

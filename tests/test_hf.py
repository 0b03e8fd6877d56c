"""Hugging Face GPT-2 interop: the layout mapping is exact, and the exported tensors *are* GPT-2.

The second claim is checked against an independent NumPy GPT-2 written from HF's layout (and,
where torch and transformers are installed, against `GPT2LMHeadModel` itself)."""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, main_in_process, read_metrics, run_cli
# the Hugging Face files here carry GPT-2's vocabulary (GPT2LMHeadModel's 50,257 rows, its tokenizer
# files exported beside them); a test that only moves weights through a run takes the small one
from helpers import gpt2_tiny_config as tiny_config
from helpers import tiny_config as small_vocab_config
from safetensors.numpy import save_file

from jaxgpt.cli import EXIT_USER_ERROR
from jaxgpt.errors import UserError
from jaxgpt.hf import CONFIG, EXPORT_FILES, GENERATION_CONFIG, WEIGHTS, export, load_dir, restore_params
from jaxgpt.hf.gpt2 import from_hf, hf_config, to_hf
from jaxgpt.model import GPT
from jaxgpt.step import abstract_model
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
        if name in ("wte", "lm_head"):
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


def test_export_from_a_run_and_load_back(tmp_path, shakespeare_dir, monkeypatch):
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
    proc = main_in_process("check", str(tmp_path / "hf"), module="jaxgpt.hf")
    assert proc.returncode == 0, proc.stderr
    assert "model.n_layer=2 model.n_head=4 model.n_embd=32 model.seq_len=32" in proc.stdout

    # killed before the weights took their place: no model.safetensors a reader would take for a
    # complete export; the re-run removes what the killed one staged and writes every file
    from jaxgpt.hf import convert
    real_replace = convert.os.replace

    def killed(src, dst):
        if Path(dst).name == WEIGHTS:
            raise SystemExit(137)
        real_replace(src, dst)

    monkeypatch.setattr(convert.os, "replace", killed)
    monkeypatch.setattr(convert.shutil, "rmtree", lambda *a, **k: None)  # a SIGKILL runs no cleanup
    with pytest.raises(SystemExit):
        export(tmp_path / "run", tmp_path / "hf2")
    monkeypatch.undo()
    assert not (tmp_path / "hf2" / WEIGHTS).exists() and list((tmp_path / "hf2").glob(".jaxgpt-export-*"))
    assert main_in_process("check", str(tmp_path / "hf2"), module="jaxgpt.hf").returncode == EXIT_USER_ERROR
    assert export(tmp_path / "run", tmp_path / "hf2") == 2
    assert sorted(p.name for p in (tmp_path / "hf2").iterdir()) == sorted(EXPORT_FILES)
    assert all((tmp_path / "hf2" / n).read_bytes() == (tmp_path / "hf" / n).read_bytes() for n in EXPORT_FILES)


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
    bad = dict(tensors)
    bad["transformer.h.1.mlp.c_fc.weight"] = bad["transformer.h.1.mlp.c_fc.weight"].copy()
    bad["transformer.h.1.mlp.c_fc.weight"].flat[7] = np.nan  # a diverged or damaged model: refused on reading
    save_file(bad, tmp_path / WEIGHTS)
    with pytest.raises(UserError, match=r"tensor transformer.h.1.mlp.c_fc.weight holds NaN or infinite values"):
        load_dir(tmp_path, cfg.model)
    import ml_dtypes  # bf16, as most Llama checkpoints hold it (numpy kind 'V', not a floating type)
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in bad.items()}, tmp_path / WEIGHTS)
    with pytest.raises(UserError, match=r"tensor transformer.h.1.mlp.c_fc.weight holds NaN or infinite values"):
        load_dir(tmp_path, cfg.model)


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


LLAMA_KEYS = ("model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.bias=false", "model.n_kv_head=2")


@pytest.mark.parametrize("arch, keys, weights, mesh", [
    ("gpt2", (), ("blocks", "mlp", "c_fc_kernel"), "fsdp=4,tp=2"),
    ("llama", LLAMA_KEYS, ("blocks", "attn", "kv_kernel"), "fsdp=4,tp=2"),  # grouped-query k/v: LlamaForCausalLM
    ("mixtral", (*LLAMA_KEYS, "model.moe_experts=4"), ("groups", "moe", "mlp", "c_gate_kernel"), "dp=2,ep=4"),
])
def test_a_run_starts_from_exported_hf_weights(tmp_path, shakespeare_dir, arch, keys, weights, mesh):
    """checkpoint.init_from_hf: the first step of a new run uses exactly the imported weights
    (Mixtral's experts split over ep). The HF directory holds random weights in the architecture's
    own files (a run's export writes the same files: the round trips above and below)."""
    import importlib

    fmt = importlib.import_module(f"jaxgpt.hf.{arch}")
    cfg = small_vocab_config(*keys)
    (tmp_path / "hf").mkdir()
    save_file(fmt.to_hf(_perturbed(cfg)[1], cfg.model), tmp_path / "hf" / WEIGHTS)
    (tmp_path / "hf" / CONFIG).write_text(json.dumps(fmt.hf_config(cfg.model)))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == arch
    run = tmp_path / "finetune"
    state = train(small_vocab_config("train.steps=1", *keys, f"checkpoint.init_from_hf={tmp_path / 'hf'}",
                                     "optimizer.lr=1e-12", mesh=mesh), run)
    want = load_dir(tmp_path / "hf", small_vocab_config(*keys).model)
    got = functools.reduce(operator.getitem, weights, state.params)
    np.testing.assert_allclose(np.asarray(got), functools.reduce(operator.getitem, weights, want), atol=1e-9)
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


def test_a_model_with_a_smaller_vocabulary_is_refused_gpt2_ids(tmp_path, capsys):
    """An imported model with its own 1,000-token vocabulary and no tokenizer beside it: sampling it
    with GPT-2's, whose ids go past it, is refused in one line (its embedding lookup clamped them:
    garbage, exit 0); an export says its GPT-2 tokenizer files do not fit it."""
    from jaxgpt import hf, sample

    cfg = tiny_config("model.vocab_size=1000")
    params = nnx.to_pure_dict(nnx.split(GPT(cfg.model, nnx.Rngs(0)), nnx.Param)[1])
    source = tmp_path / "gpt2"
    source.mkdir()
    save_file(to_hf(params, cfg.model), source / WEIGHTS)
    (source / CONFIG).write_text(json.dumps(hf_config(cfg.model)))
    assert hf.main(["import", str(source), str(tmp_path / "run"), "model.loss_chunk=8"]) == 0
    assert "has a vocabulary of 1000 tokens, not GPT-2's 50257, and no tokenizer.json" in capsys.readouterr().err
    assert sample.main([str(tmp_path / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "4"]) == EXIT_USER_ERROR
    assert capsys.readouterr().err == (
        "error: the tokenizer gpt2 (50,257 tokens) has ids past this model's vocabulary of 1000 tokens "
        "(model.vocab_size): it is not the tokenizer the model was made for; a Hugging Face model comes with its own: "
        "hf import its directory with tokenizer.json beside the weights, or set data.tokenizer\n")
    assert export(tmp_path / "run", tmp_path / "out") == 0
    assert "warning: the model's vocabulary is 1000 tokens, smaller than its tokenizer's 50257" in capsys.readouterr().err


# --- Llama (jaxgpt/hf/llama.py) ------------------------------------------------------------------

LLAMA = ["model.n_embd=64", "model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.mlp_hidden=96",
         "model.rope_theta=500.0"]  # a theta other than the default, so a wrong one shows


def _perturbed(cfg) -> tuple:
    """(graphdef, random fp32 params: norm scales 1 + N(0, 0.1), everything else N(0, 0.1)), built without
    running the initialisers (eager init of the [V, D] tables costs seconds on 2 cores)."""
    graphdef, state = abstract_model(cfg)
    rng = np.random.default_rng(1)
    def draw(path, x):
        return (("scale" in jax.tree_util.keystr(path)) + 0.1 * rng.standard_normal(x.shape)).astype(np.float32)

    return graphdef, jax.tree.map_with_path(draw, nnx.to_pure_dict(state))


@pytest.fixture(scope="module", params=["gqa-untied", "mha-tied-bias"])
def llama(request):
    """Llama 3's choices (4 query heads over 2 kv heads, untied head, no biases), and the other branches."""
    extra = {"gqa-untied": ["model.n_kv_head=2", "model.tie_embeddings=false", "model.bias=false"],
             "mha-tied-bias": ["model.bias=true"]}[request.param]
    cfg = tiny_config(*LLAMA, *extra)
    return cfg, *_perturbed(cfg)


def test_llama_round_trip_is_exact(llama):
    from jaxgpt.hf import llama as hf_llama

    cfg, _, params = llama
    m = cfg.model
    tensors = hf_llama.to_hf(params, m)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (m.kv_heads * 16, 64)
    assert tensors["model.layers.1.self_attn.o_proj.weight"].shape == (64, 64)
    assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (64, 96)
    assert ("lm_head.weight" in tensors) == (not m.tie_embeddings)
    assert len(tensors) == 2 + (not m.tie_embeddings) + (9 + 7 * m.bias) * m.n_layer
    _assert_same_but_padding(hf_llama.from_hf(tensors, m), params, m.vocab_size)
    # LlamaModel's names (no "model."), older exports' RoPE buffers, a tied head saved anyway
    bare = {k.removeprefix("model."): v for k, v in tensors.items()} | {
        "layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    if m.tie_embeddings:
        bare["lm_head.weight"] = bare["embed_tokens.weight"]
    _assert_same_but_padding(hf_llama.from_hf(bare, m), params, m.vocab_size)


def _rotate_half(x):
    """transformers' Llama (modeling_llama.rotate_half): [x1, x2] -> [-x2, x1] over the head dim."""
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([-x2, x1], axis=-1)


def _rope_hf(x_BHTK, theta: float):
    """transformers' default RoPE: cos/sin of t * theta^(-2i/K), repeated over both halves."""
    T, K = x_BHTK.shape[-2:]
    freqs_TF = np.arange(T)[:, None] * theta ** (-np.arange(0, K, 2) / K)
    cos_TK, sin_TK = (f(np.concatenate([freqs_TF, freqs_TF], -1)) for f in (np.cos, np.sin))
    return x_BHTK * cos_TK + _rotate_half(x_BHTK) * sin_TK


def _rope_meta(x_BHTK, theta: float):
    """Meta's original RoPE: adjacent pairs (2i, 2i+1) rotate by t * theta^(-2i/K)."""
    T, K = x_BHTK.shape[-2:]
    angle_TF = np.arange(T)[:, None] * theta ** (-np.arange(0, K, 2) / K)
    pairs = x_BHTK.reshape(*x_BHTK.shape[:-1], K // 2, 2)
    c, s = np.cos(angle_TF), np.sin(angle_TF)
    rotated = np.stack([pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 1] * c + pairs[..., 0] * s], -1)
    return rotated.reshape(x_BHTK.shape)


def _meta_permute(w, n_heads: int):
    """HF's convert_llama_weights_to_hf.permute: Meta's interleaved q/k rows -> rotate-half order."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _rms(x, w):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * w


def _silu(x):
    return x / (1 + np.exp(-x))


def _llama_mlp(p: dict, m_BTD: np.ndarray, c: dict) -> np.ndarray:
    def lin(x, name):
        return x @ p[f"mlp.{name}.weight"].T + p.get(f"mlp.{name}.bias", 0)

    return lin(_silu(lin(m_BTD, "gate_proj")) * lin(m_BTD, "up_proj"), "down_proj")


def _hf_llama_logits(t: dict[str, np.ndarray], c: dict, tokens_BT: np.ndarray, rope=_rope_hf,
                     mlp=_llama_mlp) -> np.ndarray:
    """Llama's forward pass (transformers' LlamaForCausalLM) from HF's tensors and config.json alone, in
    float64; with `mlp=_mixtral_moe`, Mixtral's (MixtralForCausalLM)."""
    t = {k.removeprefix("model."): v.astype(np.float64) for k, v in t.items()}
    B, T = tokens_BT.shape
    H, G, K, theta = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rope_theta"]
    future_TT = np.triu(np.ones((T, T), bool), 1)

    def lin(x, p, name):
        return x @ p[f"{name}.weight"].T + p.get(f"{name}.bias", 0)

    x_BTD = t["embed_tokens.weight"][tokens_BT]
    for i in range(c["num_hidden_layers"]):
        p = {k.removeprefix(f"layers.{i}."): v for k, v in t.items() if k.startswith(f"layers.{i}.")}
        a_BTD = _rms(x_BTD, p["input_layernorm.weight"])
        q_BHTK, k_BGTK, v_BGTK = (lin(a_BTD, p, f"self_attn.{n}_proj").reshape(B, T, -1, K).transpose(0, 2, 1, 3)
                                  for n in "qkv")
        q_BHTK, k_BGTK = rope(q_BHTK, theta), rope(k_BGTK, theta)
        k_BHTK, v_BHTK = (np.repeat(z, H // G, axis=1) for z in (k_BGTK, v_BGTK))  # transformers' repeat_kv
        s_BHTT = np.where(future_TT, -np.inf, q_BHTK @ k_BHTK.transpose(0, 1, 3, 2) / np.sqrt(K))
        w_BHTT = np.exp(s_BHTT - s_BHTT.max(-1, keepdims=True))
        w_BHTT /= w_BHTT.sum(-1, keepdims=True)
        x_BTD = x_BTD + lin((w_BHTT @ v_BHTK).transpose(0, 2, 1, 3).reshape(B, T, H * K), p, "self_attn.o_proj")
        x_BTD = x_BTD + mlp(p, _rms(x_BTD, p["post_attention_layernorm.weight"]), c)
    head_VD = t.get("lm_head.weight", t["embed_tokens.weight"])
    return _rms(x_BTD, t["norm.weight"]) @ head_VD.T


def test_llama_export_is_transformers_llama_and_rope_is_rotate_half(llama):
    """The exported tensors run through an independent NumPy LlamaForCausalLM (rotate-half RoPE) give
    our logits; with the q/k rows in Meta's order, or Meta's adjacent-pair RoPE, they do not."""
    from jaxgpt.hf import llama as hf_llama

    cfg, graphdef, params = llama
    m = cfg.model
    tensors, c = hf_llama.to_hf(params, m), hf_llama.hf_config(m)
    tokens_BT = _tokens(cfg)
    ours_BTV = np.asarray(nnx.merge(graphdef, params)(tokens_BT))[..., : m.vocab_size]
    ref_BTV = _hf_llama_logits(tensors, c, tokens_BT)
    assert ref_BTV.std() > 0.3  # the perturbed model's logits are far from constant
    np.testing.assert_allclose(ours_BTV, ref_BTV, rtol=0, atol=ATOL)
    # The convention matters: either mistake moves the logits by far more than the tolerance.
    meta_rows = dict(tensors)
    for i in range(m.n_layer):
        for name, heads in (("q", m.n_head), ("k", m.kv_heads)):
            key = f"model.layers.{i}.self_attn.{name}_proj.weight"
            meta_rows[key] = _meta_permute(tensors[key], heads)
    assert np.abs(_hf_llama_logits(meta_rows, c, tokens_BT) - ours_BTV).max() > 100 * ATOL
    assert np.abs(_hf_llama_logits(tensors, c, tokens_BT, rope=_rope_meta) - ours_BTV).max() > 100 * ATOL


def test_llama_attention_scores_use_rotate_half(llama):
    """One layer's q.k scores: attention.rope on our kernels == transformers' rotate-half RoPE on
    the exported q_proj/k_proj rows (!= Meta's adjacent-pair RoPE on them)."""
    from jaxgpt.hf import llama as hf_llama
    from jaxgpt.model.positions import rope

    cfg, _, params = llama
    m = cfg.model
    H, G, K, theta = m.n_head, m.kv_heads, m.head_dim, m.rope_theta
    x_TD = np.random.default_rng(2).normal(size=(m.seq_len, m.n_embd))
    attn = params["blocks"]["attn"]
    q_DHK, k_DGK = ((attn["c_attn_kernel"][0, :, 0], attn["c_attn_kernel"][0, :, 1]) if G == H
                    else (attn["q_kernel"][0], attn["kv_kernel"][0, :, 0]))
    q_1THK, k_1TGK = (rope(np.einsum("td,dhk->thk", x_TD, w)[None].astype(np.float32), 0, theta)
                      for w in (q_DHK, k_DGK))
    ours_HTT = np.einsum("thk,shk->hts", q_1THK[0], np.repeat(k_1TGK[0], H // G, axis=1))
    t = hf_llama.to_hf(params, m)
    q_HTK, k_GTK = ((x_TD @ t[f"model.layers.0.self_attn.{n}_proj.weight"].astype(np.float64).T)
                    .reshape(m.seq_len, -1, K).transpose(1, 0, 2) for n in "qk")
    for rope_fn, same in ((_rope_hf, True), (_rope_meta, False)):
        theirs_HTT = rope_fn(q_HTK, theta) @ np.repeat(rope_fn(k_GTK, theta), H // G, axis=0).transpose(0, 2, 1)
        assert np.allclose(ours_HTT, theirs_HTT, rtol=0, atol=1e-3 * np.abs(theirs_HTT).max()) == same, rope_fn


LLAMA_3 = [*LLAMA, "model.n_kv_head=2", "model.tie_embeddings=false", "model.bias=false"]


def _hf_dirs(tmp, fmt, overrides: list[str], *import_args: str) -> tuple:
    """(cfg, graphdef, random params, tmp): an HF directory tmp/source written by `fmt` (an hf module),
    `hf import`ed as tmp/run, exported back as tmp/out."""
    from jaxgpt import hf

    cfg = tiny_config(*overrides)
    graphdef, params = _perturbed(cfg)
    (tmp / "source").mkdir()
    save_file(fmt.to_hf(params, cfg.model), tmp / "source" / WEIGHTS)
    (tmp / "source" / CONFIG).write_text(json.dumps(fmt.hf_config(cfg.model)))
    assert hf.main(["import", str(tmp / "source"), str(tmp / "run"), "model.loss_chunk=8", *import_args]) == 0
    assert export(tmp / "run", tmp / "out") == 0
    return cfg, graphdef, params, tmp


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """An HF Llama directory (weights + config.json), `hf import`ed as a run, exported back."""
    from jaxgpt.hf import llama as hf_llama

    return _hf_dirs(tmp_path_factory.mktemp("llama"), hf_llama, LLAMA_3)


def test_llama_import_then_export_is_exact(llama_dirs, capsys):
    from safetensors.numpy import load_file

    from jaxgpt import hf

    cfg, _, params, tmp = llama_dirs
    restored, run_cfg, step = restore_params(tmp / "run")
    assert step == 0 and run_cfg.model == cfg.model  # config.json implies every architecture key
    _assert_same_but_padding(jax.device_get(restored), params, cfg.model.vocab_size)
    _assert_same_but_padding(load_dir(tmp / "out", cfg.model), params, cfg.model.vocab_size)
    assert sorted(p.name for p in (tmp / "out").iterdir()) == sorted(EXPORT_FILES)
    source_config = json.loads((tmp / "source" / CONFIG).read_text())
    assert (tmp / "out" / CONFIG).read_text() == json.dumps(source_config, indent=2) + "\n"
    back, original = load_file(tmp / "out" / WEIGHTS), load_file(tmp / "source" / WEIGHTS)
    assert back.keys() == original.keys() and all(np.array_equal(back[k], original[k]) for k in original)
    capsys.readouterr()
    assert hf.main(["check", str(tmp / "out")]) == 0
    # embedding + head 2 x 50257 x 64, per layer 2 norms, q and o 64 x 64, k and v 32 x 64, 3 x 64 x 96; final norm
    assert capsys.readouterr().out.endswith(
        "Llama with 6,494,656 parameters; it loads as model.n_layer=2 model.n_head=4 model.n_embd=64 "
        "model.mlp_hidden=96 model.seq_len=32 model.vocab_size=50257 model.n_kv_head=2 model.rope_theta=500.0 "
        "model.head_size=0 model.norm_eps=1e-05 model.tie_embeddings=False "
        "model.bias=False model.norm=rmsnorm model.norm_scale=True model.position=rope model.mlp=swiglu "
        "model.qk_norm=False model.logit_softcap=0.0\n")


def test_transformers_llama_gives_our_logits_and_greedy_text(llama_dirs, capsys):
    """LlamaForCausalLM + AutoTokenizer on the export: logits to 1e-5 (fp32) and `generate`'s greedy
    text == `python -m jaxgpt.sample --temperature 0` on the run (scripts/hf_greedy_check.py, automated)."""
    hf_model = _transformers_matches(llama_dirs, "LlamaForCausalLM", capsys)
    assert type(hf_model.model.layers[0].self_attn).__name__ == "LlamaAttention"


def _transformers_matches(dirs: tuple, class_name: str, capsys):
    """transformers' `class_name` on the export (dirs: a *_dirs fixture) gives our logits to 1e-5
    (fp32), and its greedy `generate` with AutoTokenizer the text of `jaxgpt.sample --temperature 0`
    on the run. Returns the HF model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxgpt import sample

    cfg, graphdef, params, tmp = dirs
    hf_model = getattr(transformers, class_name).from_pretrained(tmp / "out", dtype=torch.float32).eval()
    tokens_BT = _tokens(cfg)
    with torch.no_grad():
        theirs_BTV = hf_model(torch.as_tensor(tokens_BT)).logits.numpy()
    ours_BTV = np.asarray(nnx.merge(graphdef, params)(tokens_BT))[..., : cfg.model.vocab_size]
    with capsys.disabled():  # the figure a by-hand run records (docs/benchmarks.md)
        print(f"\nmax |ours - transformers {class_name}| = {np.abs(ours_BTV - theirs_BTV).max():.2e}")
    np.testing.assert_allclose(ours_BTV, theirs_BTV, rtol=0, atol=1e-5)

    capsys.readouterr()
    assert sample.main([str(tmp / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "16", "--temperature", "0"]) == 0
    ours = capsys.readouterr().out.removesuffix("\n")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp / "out")
    ids = tokenizer("ROMEO:", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = hf_model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape[1] == ids.shape[1] + 16  # no <|endoftext|> on the way: all 16 tokens compared
    assert tokenizer.decode(generated[0]) == ours
    return hf_model


NANOCHAT = ["model.norm=rmsnorm", "model.norm_scale=false", "model.position=rope", "model.mlp=relu2",
            "model.bias=false"]


@pytest.mark.parametrize("overrides, line", [
    ([], "gpt2"), (LLAMA_3, "llama"), ([*LLAMA, "model.bias=true"], "llama"),
    (NANOCHAT, "no Hugging Face class holds this model: LlamaForCausalLM cannot, for model.norm_scale=False "
               "(Llama's RMSNorms have a learned scale), model.mlp=relu2 (Llama's MLP is SwiGLU); nor can "
               "GPT2LMHeadModel, for model.norm=rmsnorm, model.norm_scale=False, model.position=rope, model.mlp=relu2, "
               "model.bias=False"),
    (["model.norm=rmsnorm", "model.mlp=swiglu"], "LlamaForCausalLM cannot, for model.position=learned (Llama has "
                                                 "rotary positions, no position table); nor can GPT2LMHeadModel"),
    (["model.position=rope"], "cannot, for model.norm=layernorm (Llama's norms are RMSNorm), model.mlp=gelu "
                              "(Llama's MLP is SwiGLU); nor can GPT2LMHeadModel, for model.position=rope"),
    ([*LLAMA, "model.qk_norm=true"], "cannot, for model.qk_norm=True (Llama has no QK-norm);"),
    ([*LLAMA, "model.logit_softcap=30"], "cannot, for model.logit_softcap=30.0 (Llama does not cap its logits);"),
    ([*LLAMA_3, "model.moe_experts=4"], "mixtral"),
    ([*LLAMA, "model.moe_experts=4", "model.moe_every=2", "model.moe_shared_experts=1", "model.moe_balance=bias"],
     "no Hugging Face class holds this Mixture-of-Experts model: MixtralForCausalLM cannot, for model.moe_every=2 "
     "(every Mixtral block is MoE), model.moe_shared_experts=1 (Mixtral has no shared experts), model.bias=True "
     "(Mixtral's linears have no biases), model.moe_balance=bias (Mixtral's router has no balancing bias)"),
    ([*NANOCHAT, "model.moe_experts=4"], "MixtralForCausalLM cannot, for model.norm_scale=False (Llama's RMSNorms"),
])
def test_architecture_or_one_line_refusal(overrides, line):
    from jaxgpt.hf import architecture

    m = tiny_config(*overrides).model
    if line in ("gpt2", "llama", "mixtral"):
        assert architecture(m) == line
        return
    with pytest.raises(UserError) as e:
        architecture(m)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_init_from_hf_is_refused_before_the_run_starts_where_no_class_holds_the_model(tmp_path):
    """The check config.validate made through hf/ (an import circle, issue 39) is train's, still first."""
    cfg = tiny_config("model.mlp=swiglu", "checkpoint.init_from_hf=x")
    with pytest.raises(UserError) as e:
        train(cfg, tmp_path / "run", jax.devices()[:1])
    assert "nor can GPT2LMHeadModel, for model.mlp=swiglu" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing written, nothing compiled
    from jaxgpt import plan  # plan refuses it too, before compiling
    assert plan.main(["model.mlp=swiglu", "checkpoint.init_from_hf=x"]) != 0


def test_llama_export_refuses_a_nanochat_model_in_one_line(tmp_path, capsys):
    """A relu2, parameter-free-norm run: `python -m jaxgpt.hf export` says why in one line, writes nothing."""
    from jaxgpt import hf
    from jaxgpt.checkpoint import Checkpointer
    from jaxgpt.parallel.mesh import make_mesh
    from jaxgpt.step import abstract_state, make_setup

    cfg = tiny_config(*NANOCHAT)
    mesh = make_mesh({}, jax.devices()[:1])
    with jax.set_mesh(mesh):  # a checkpoint of zeros: export refuses it from its config alone
        state = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding),
                             abstract_state(cfg, make_setup(cfg, mesh)))
        ckpt = Checkpointer(tmp_path / "run" / "checkpoints", cfg.checkpoint)
        ckpt.save(0, state, hf.convert._fresh_data_state(), cfg)
        ckpt.wait()
        ckpt.close()
    capsys.readouterr()
    assert hf.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == EXIT_USER_ERROR
    assert capsys.readouterr().err == (
        "error: no Hugging Face class holds this model: LlamaForCausalLM cannot, for model.norm_scale=False (Llama's "
        "RMSNorms have a learned scale), model.mlp=relu2 (Llama's MLP is SwiGLU); nor can GPT2LMHeadModel, for "
        "model.norm=rmsnorm, model.norm_scale=False, model.position=rope, model.mlp=relu2, model.bias=False; nor can "
        "Qwen3ForCausalLM, for model.norm_scale=False (Qwen3's RMSNorms have a learned scale), model.mlp=relu2 (Qwen3's "
        "MLP is SwiGLU), model.qk_norm=False (Qwen3 normalises each head's queries and keys)\n")
    assert not (tmp_path / "hf").exists()


def test_llama_config_json_both_spellings_and_one_line_mismatches(llama_dirs, tmp_path):
    """transformers 4's rope_theta and 5's rope_parameters read alike; what jaxgpt's Llama cannot be is named."""
    import shutil

    from jaxgpt.hf.llama import model_overrides

    cfg, _, params, tmp = llama_dirs
    source = json.loads((tmp / "source" / CONFIG).read_text())
    v4 = {k: v for k, v in source.items() if k != "rope_parameters"}
    v5 = {k: v for k, v in source.items() if k != "rope_theta"}
    assert model_overrides(v4) == model_overrides(v5) and model_overrides(v5)["model.rope_theta"] == 500.0
    shutil.copy(tmp / "source" / WEIGHTS, tmp_path / WEIGHTS)
    cases = [
        ({"rms_norm_eps": 1e-6}, cfg, "(model.norm_eps=1e-05 vs 1e-06 there); override with model.norm_eps=1e-06"),
        ({"head_dim": 32}, cfg, "(model.head_size=0 vs 32 there); override with model.head_size=32"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 32.0}, "rope_parameters": None}, cfg,
         "rope_type='llama3' is not supported (jaxgpt's Llama has 'default')"),
        ({"mlp_bias": True}, cfg, "mlp_bias=True is not supported (jaxgpt's Llama has False, as attention_bias"),
        ({"hidden_act": "gelu"}, cfg, "hidden_act='gelu' is not supported"),
        ({}, tiny_config(*LLAMA_3, "model.n_layer=3", "model.rope_theta=10000"),
         "does not match the model config (model.n_layer=3 vs 2 there, model.rope_theta=10000.0 vs 500.0 there); "
         "override with model.n_layer=2 model.rope_theta=500.0"),
        ({}, tiny_config(*LLAMA_3, "model.seq_len=64"), "model.seq_len=64 vs 32 there"),
        ({"model_type": "mistral"}, cfg, "describes a 'mistral' model; jaxgpt reads GPT-2, Llama, Mixtral, Qwen3"),
    ]
    for change, case_cfg, message in cases:
        (tmp_path / CONFIG).write_text(json.dumps(source | change))
        with pytest.raises(UserError) as e:
            load_dir(tmp_path, case_cfg.model)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    (tmp_path / CONFIG).write_text(json.dumps(source))
    _assert_same_but_padding(load_dir(tmp_path, tiny_config(*LLAMA_3, "model.seq_len=16").model), params,
                             cfg.model.vocab_size)  # a shorter context is the same model
    # a GPT-2 directory into a Llama config, and the other way round
    gpt2_cfg = tiny_config()
    gpt2_params = _perturbed(gpt2_cfg)[1]
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(gpt2_cfg.model)))
    save_file(to_hf(gpt2_params, gpt2_cfg.model), tmp_path / WEIGHTS)
    with pytest.raises(UserError, match="a GPT-2 but the model config sets model.norm=rmsnorm, model.position"):
        load_dir(tmp_path, cfg.model)
    with pytest.raises(UserError, match=r"model.norm=layernorm vs rmsnorm there"):
        load_dir(tmp / "source", gpt2_cfg.model)


# --- Mixtral (jaxgpt/hf/mixtral.py) --------------------------------------------------------------

# Llama 3's attention with 4 fine-grained experts (narrower than the dense width), top-2, in every block.
# Capacity dispatch (the default) with a factor that holds every assignment (C = S): Mixtral drops nothing.
MIXTRAL = [*LLAMA_3, "model.moe_experts=4", "model.moe_top_k=2", "model.moe_mlp_hidden=48",
           "model.moe_capacity_factor=2.0"]


def _mixtral_moe(p: dict, m_BTD: np.ndarray, c: dict) -> np.ndarray:
    """transformers' MixtralSparseMoeBlock: softmax over the router's logits, the top k renormalised,
    each expert silu(x w1) * (x w3) w2, weighted and summed."""
    probs_BTE = np.exp(m_BTD @ p["block_sparse_moe.gate.weight"].T)
    probs_BTE /= probs_BTE.sum(-1, keepdims=True)
    k = c["num_experts_per_tok"]
    top_BTK = np.argsort(-probs_BTE, axis=-1, kind="stable")[..., :k]
    weights_BTK = np.take_along_axis(probs_BTE, top_BTK, -1)
    weights_BTK /= weights_BTK.sum(-1, keepdims=True)
    out_BTD = np.zeros_like(m_BTD)
    for e in range(c["num_local_experts"]):
        w1, w2, w3 = (p[f"block_sparse_moe.experts.{e}.{w}.weight"] for w in ("w1", "w2", "w3"))
        y_BTD = (_silu(m_BTD @ w1.T) * (m_BTD @ w3.T)) @ w2.T
        out_BTD += (weights_BTK * (top_BTK == e)).sum(-1, keepdims=True) * y_BTD
    return out_BTD


@pytest.fixture(scope="module")
def mixtral_dirs(tmp_path_factory):
    """An HF Mixtral directory (weights + config.json), `hf import`ed as a run, exported back."""
    from jaxgpt.hf import mixtral

    return _hf_dirs(tmp_path_factory.mktemp("mixtral"), mixtral, MIXTRAL, "model.moe_capacity_factor=2.0")


def test_mixtral_round_trip_is_exact_and_in_the_hub_layout(mixtral_dirs):
    from jaxgpt.hf import mixtral

    cfg, _, params, tmp = mixtral_dirs
    m = cfg.model
    tensors = mixtral.to_hf(params, m)
    moe = "model.layers.1.block_sparse_moe"
    assert tensors[f"{moe}.gate.weight"].shape == (4, 64)
    assert tensors[f"{moe}.experts.3.w1.weight"].shape == tensors[f"{moe}.experts.3.w3.weight"].shape == (48, 64)
    assert tensors[f"{moe}.experts.3.w2.weight"].shape == (64, 48)
    assert len(tensors) == 3 + (6 + 1 + 3 * 4) * m.n_layer  # embed, head, norm; norms, q k v o, gate, 4 x w1 w2 w3
    np.testing.assert_array_equal(tensors[f"{moe}.experts.2.w2.weight"],
                                  params["groups"]["moe"]["mlp"]["c_proj_kernel"][1, 2].T)
    _assert_same_but_padding(mixtral.from_hf(tensors, m), params, m.vocab_size)
    c = mixtral.hf_config(m)
    assert (c["model_type"], c["intermediate_size"], c["num_local_experts"], c["num_experts_per_tok"]) == (
        "mixtral", 48, 4, 2)
    restored, run_cfg, step = restore_params(tmp / "run")
    # config.json implies every architecture key; a dense MLP width is none (every block is MoE)
    assert step == 0 and run_cfg.model == dataclasses.replace(m, mlp_hidden=0)
    _assert_same_but_padding(jax.device_get(restored), params, m.vocab_size)
    assert (tmp / "out" / CONFIG).read_text() == (tmp / "source" / CONFIG).read_text().replace(
        json.dumps(c), json.dumps(c, indent=2) + "\n")
    _assert_same_but_padding(load_dir(tmp / "out", m), params, m.vocab_size)


def test_mixtral_export_is_transformers_mixtral(mixtral_dirs):
    """The exported tensors through an independent NumPy MixtralForCausalLM give our logits; the same
    tensors through Llama's dense MLP (the router ignored) do not."""
    from jaxgpt.hf import mixtral

    cfg, graphdef, params, _ = mixtral_dirs
    tensors, c = mixtral.to_hf(params, cfg.model), mixtral.hf_config(cfg.model)
    tokens_BT = _tokens(cfg)
    ours_BTV = np.asarray(nnx.merge(graphdef, params)(tokens_BT))[..., : cfg.model.vocab_size]
    ref_BTV = _hf_llama_logits(tensors, c, tokens_BT, mlp=_mixtral_moe)
    assert ref_BTV.std() > 0.3
    np.testing.assert_allclose(ours_BTV, ref_BTV, rtol=0, atol=ATOL)
    # top-1 in place of top-2 moves the logits far past the tolerance: the routing is what is compared
    assert np.abs(_hf_llama_logits(tensors, c | {"num_experts_per_tok": 1}, tokens_BT, mlp=_mixtral_moe)
                  - ours_BTV).max() > 100 * ATOL


def test_transformers_mixtral_gives_our_logits_and_greedy_text(mixtral_dirs, capsys):
    """MixtralForCausalLM + AutoTokenizer on the export: logits to 1e-5 (fp32), greedy text == jaxgpt.sample's."""
    hf_model = _transformers_matches(mixtral_dirs, "MixtralForCausalLM", capsys)
    assert type(hf_model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"


def test_mixtral_mismatches_are_one_line(mixtral_dirs, llama_dirs, tmp_path, capsys):
    from jaxgpt import hf

    cfg, _, _, tmp = mixtral_dirs
    cases = [(tmp / "source", tiny_config(*MIXTRAL, "model.moe_experts=8"),
              "model.moe_experts=8 vs 4 there"),
             (tmp / "source", tiny_config(*LLAMA_3), "model.moe_experts=0 vs 4 there"),
             (tmp / "source", tiny_config(*MIXTRAL, "model.moe_mlp_hidden=0"), "model.moe_mlp_hidden=96 vs 48 there"),
             (llama_dirs[3] / "source", cfg, "holds a Llama model, which has no experts, but the model config sets "
                                             "model.moe_experts=4; set model.moe_experts=0")]
    for source, case_cfg, message in cases:
        with pytest.raises(UserError) as e:
            load_dir(source, case_cfg.model)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    source = json.loads((tmp / "source" / CONFIG).read_text())
    (tmp_path / CONFIG).write_text(json.dumps(source | {"sliding_window": 4096}))
    (tmp_path / WEIGHTS).symlink_to(tmp / "source" / WEIGHTS)
    with pytest.raises(UserError, match="sliding_window=4096 is not supported"):
        load_dir(tmp_path, cfg.model)
    capsys.readouterr()
    assert hf.main(["check", str(tmp / "out")]) == 0
    assert capsys.readouterr().out.split(": ")[1].startswith("Mixtral with ")

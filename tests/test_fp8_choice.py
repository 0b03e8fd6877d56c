"""model.fp8=auto and lists of layers: the config, the per-kind estimate (jaxgpt/gpu/fp8_choice.py),
which layers the model then runs in fp8, and a CPU run with auto (pure Python and jaxprs, no compile
but the one short CPU run)."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
import yaml
from helpers import lowering, tiny_config

from jaxgpt.config import load_config, validate
from jaxgpt.errors import UserError
from jaxgpt.gpu import fp8_choice
from jaxgpt.gpu.perf import perf
from jaxgpt.hlo import BLOCK_LINEARS
from jaxgpt.model import GPT
from jaxgpt.tracking import read_events
from jaxgpt.train import train


@pytest.mark.parametrize("value, fp8, kinds", [
    ("true", True, set(BLOCK_LINEARS)), ("false", False, set()), ("auto", "auto", set()),  # auto unresolved: none
    ("mlp_out, qkv", "qkv,mlp_out", {"qkv", "mlp_out"}),  # written back in BLOCK_LINEARS order
])
def test_fp8_takes_true_false_auto_or_a_list_of_layers(value, fp8, kinds):
    m = load_config(None, [f"model.fp8={value}"]).model
    assert m.fp8 == fp8 and type(m.fp8) is type(fp8) and m.fp8_linears() == kinds


@pytest.mark.parametrize("value, message", [
    ("autox", "got 'autox'; did you mean 'auto'"), ("qkv,mlp_ot", "did you mean 'mlp_out'"),
    (",", "true, false, auto or a comma-separated list of qkv, .*; got ','"), ("3", "got 3"), ("[qkv]", "got"),
])
def test_fp8_rejects_anything_else_in_one_line(value, message):
    with pytest.raises(UserError, match=message) as e:
        load_config(None, [f"model.fp8={value}"])
    assert "\n" not in str(e.value)


def _resolve(name: str, target: str | None, *overrides: str, devices: int = 1):
    cfg = load_config(name, ["model.fp8=auto", *overrides], mesh="dp=-1")
    return fp8_choice.resolve(cfg, validate(cfg, devices), target)


@pytest.mark.parametrize("name, target, chosen", [
    (None, "h100", set()), ("gpt2-124m", "h100", set()), ("gpt2-124m", "h200", set()),
    ("gpt2-1.3b", "h100", {"qkv", "attn_out", "mlp_in", "mlp_out"}),
    ("gpt2-1.3b", "h200", {"qkv", "attn_out", "mlp_in", "mlp_out"}),
    ("llama-8b", "h100", {"qkv", "attn_out", "mlp_in", "mlp_gate", "mlp_out"}),
])
def test_auto_takes_fp8_exactly_where_the_estimate_gains(name, target, chosen):
    """auto = the kinds whose three GEMMs plus quantization are predicted faster in fp8, never one
    predicted slower: the tiny model and gpt2-124m stay bf16 (its three kinds in fp8 measured 0.967x
    bf16 on an H100), gpt2-1.3b and llama-8b take every kind. On one H100 gpt2-1.3b's and the
    slice's are the fastest of the compiled choices (docs/benchmarks.md, stop 52): gpt2-1.3b 3,256.4
    ms against 4,137.6 in bf16 and 3,296.3 with attn_out in bf16 (3,121.7 and 3,168.3 on an H200);
    the slice with all five kinds 5,720.1 against 7,764.1 in bf16."""
    cfg, rows, why = _resolve(name, target, devices=8 if name == "llama-8b" else 1)
    assert {c.kind for c in rows if c.gain_seconds > 0} == chosen == cfg.model.fp8_linears()
    assert all(c.fp8 == (c.gain_seconds > 0) and c.bf16_seconds > 0 for c in rows)
    assert cfg.model.fp8 == (",".join(k for k in BLOCK_LINEARS if k in chosen) or False)
    assert why.startswith("model.fp8=auto on NVIDIA H") and len(fp8_choice.format_choices(rows)) == len(rows)


def test_the_estimates_gemms_are_the_compiled_steps():
    """Each kind's GEMM time per step, bf16 and fp8, is what jaxgpt/gpu/cost.py reads from the
    compiled H100 programs of gpt2-124m and gpt2-1.3b (docs/benchmarks.md, 'fp8 in the step-time
    model', per-layer table, to its 0.1 ms rounding): the estimate's shapes, uses and bytes are the
    programs' (fp8: f8 operands, a bf16 result; 2026-11-27, docs/benchmarks.md 'fp8 GEMMs write bf16')."""
    compiled = {"gpt2-124m": {"qkv": (90.6, 45.6), "attn_out": (30.7, 16.7), "mlp_in": (120.7, 60.7),
                              "mlp_out": (120.7, 60.7)},
                "gpt2-1.3b": {"qkv": (645.2, 324.9), "attn_out": (218.7, 111.7), "mlp_in": (858.5, 431.5),
                              "mlp_out": (858.5, 431.5)}}
    p = perf("h100")
    for name, ms in compiled.items():
        cfg = load_config(name)
        shapes = fp8_choice.linear_shapes(cfg, validate(cfg, 1))
        got = {k: tuple(round(1e3 * uses * fp8_choice.gemm_seconds(gemms, p, fp8), 1) for fp8 in (False, True))
               for k, (gemms, uses) in shapes.items()}
        assert got == ms, name


def test_shapes_follow_tp_grouped_attention_and_swiglu():
    cfg = load_config("llama-tiny", ["model.fp8=auto"], mesh="dp=4,tp=2")
    m, shapes = cfg.model, fp8_choice.linear_shapes(cfg, validate(cfg, 8))
    (q, kv), _ = shapes["qkv"]
    assert (q.n, kv.n) == (m.n_head * m.head_dim // 2, 2 * m.kv_heads * m.head_dim // 2)
    assert shapes["mlp_gate"] == shapes["mlp_in"] and shapes["mlp_out"][0][0].k == m.mlp_width // 2
    assert q.m == cfg.train.batch_size // cfg.train.grad_accum // 4 * m.seq_len


def test_auto_without_an_h100_or_h200_is_no_fp8_and_says_so():
    cfg, rows, why = _resolve(None, None)
    assert cfg.model.fp8 is False and rows == [] and "no layer in fp8" in why
    same = load_config(None, ["model.fp8=qkv"])
    assert fp8_choice.resolve(same, validate(same, 1), "h100") == (same, [], "")  # only auto is resolved
    kinds = [fp8_choice.target_of(types.SimpleNamespace(device_kind=k)) for k in
             ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "cpu", "NVIDIA A100-SXM4-80GB")]
    assert kinds == ["h100", "h200", None, None]


def _fp8_dots(jaxpr) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and "float8" in str(eqn.invars[0].aval.dtype):
            out.append((eqn.invars[0].aval.shape, eqn.invars[1].aval.shape))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out += _fp8_dots(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out += _fp8_dots(sub)
    return out


def test_a_list_runs_exactly_those_layers_in_fp8():
    """model.fp8=qkv,mlp_out: the forward pass's fp8 GEMMs are qkv's ([B,T,D] x [D,3,H,K]) and
    mlp_out's ([B,T,F] x [F,D]), and no other (the scanned layers' body holds each once). fp8 is
    the lowering's choice (jaxgpt/lowering/fp8.py), the same under model.ops=reference and tuned."""
    cfg = tiny_config("model.fp8=qkv,mlp_out")
    m = cfg.model
    tokens = jnp.zeros((2, m.seq_len), jnp.int32)
    B, T, D, H, K, F = 2, m.seq_len, m.n_embd, m.n_head, m.head_dim, m.mlp_width
    for form in ("reference", "tuned"):
        jaxpr = jax.make_jaxpr(lambda t, form=form: GPT(m, nnx.Rngs(0), lowering(m, form))(t))(tokens).jaxpr
        assert sorted(_fp8_dots(jaxpr)) == sorted([((B, T, D), (D, 3, H, K)), ((B, T, F), (F, D))]), form


def test_auto_on_cpu_trains_exactly_like_no_fp8(tmp_path, shakespeare_dir, capsys):
    """On a CPU run auto resolves to no fp8 layer: the config the run trains and records is the
    fp8-free one, field for field (so is its step), and the banner says so."""
    cfg = tiny_config("train.steps=1", "model.fp8=auto", "model.n_layer=1")
    train(cfg, tmp_path, devices=jax.devices()[:1])
    recorded = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert recorded == dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8=False)).to_dict()
    assert [e["fp8"] for e in read_events(tmp_path) if e["event"] == "start"] == [False]
    assert "model.fp8=auto: no layer in fp8" in capsys.readouterr().out

"""Attention kernels, fp8 matmuls and remat: each is checked against the plain computation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GPT2_VOCAB, lowering, run_cli, tiny_config, train_losses
from jax.sharding import PartitionSpec as P

from jaxgpt.config import validate
from jaxgpt.errors import UserError
from jaxgpt.lowering import flash
from jaxgpt.lowering.attention import (causal_attention, cudnn_unavailable_reason, gpu_unavailable_reason,
                                       reference_attention, select_kernel)
from jaxgpt.lowering.fp8 import E4M3, E5M2, fp8_einsum, power_of_two_scale, quantize
from jaxgpt.model.documents import documents
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.tokenizer import EOT_ID
from jaxgpt.train import train


def _qkv(dtype, B=2, T=64, H=4, K=32):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (B, T, H, K), jnp.float32).astype(dtype) for k in keys]


KERNEL_CASES = [("xla", jnp.float32, 1e-5), ("xla", jnp.bfloat16, 2e-2), ("cudnn", jnp.bfloat16, 2e-2),
                ("mosaic", jnp.bfloat16, 2e-2)]  # the GPU kernels run where JAXGPT_TEST_GPU=1 shows a GPU
# model.document_mask: rows of several documents (a boundary at 0 too), XLA's boolean mask and cuDNN's packed layout
MASKED_CASES = [("xla", jnp.float32, 1e-5), ("cudnn", jnp.bfloat16, 2e-2)]


@pytest.mark.parametrize("impl, dtype, atol, masked", [(*c, False) for c in KERNEL_CASES]
                         + [(*c, True) for c in MASKED_CASES])
def test_kernel_matches_reference_forward_and_gradients(impl, dtype, atol, masked):
    """Forward and d/d(q, k, v) of each kernel against the textbook formula in fp32. The bf16
    bound is bf16's rounding (~3 significant digits) on values of order 1."""
    device = jax.devices()[0]
    if impl in ("cudnn", "mosaic"):
        device = next(iter(_gpus()), device)
        reason = (cudnn_unavailable_reason(dtype, 32, device, document_mask=masked) if impl == "cudnn"
                  else gpu_unavailable_reason(dtype, device) or flash.unavailable_reason())
        if reason:
            pytest.skip(f"{impl} flash attention cannot run here: {reason} (JAXGPT_TEST_GPU=1 on a GPU host runs it)")
    with jax.default_device(device):
        _check_kernel(impl, dtype, atol, masked)


def _gpus() -> list[jax.Device]:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend (the tests run on CPU unless JAXGPT_TEST_GPU=1)
        return []


def _check_kernel(impl, dtype, atol, masked=False):
    q, k, v = _qkv(dtype)
    docs = None
    if masked:  # row 0: documents at 0, 20, 21 (one token long) and 50; row 1: <|endoftext|> first, then 40
        tokens = np.zeros((2, 64), np.int32)
        tokens[0, [20, 21, 50]] = tokens[1, [0, 40]] = EOT_ID
        docs = documents(jnp.asarray(tokens))
    out = causal_attention(q, k, v, impl=impl, docs=docs)
    with jax.default_matmul_precision("highest"):  # a true fp32 reference on a GPU too (no TF32)
        want_out = reference_attention(q, k, v, docs)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), atol=atol, rtol=0)
    w = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w)  # noqa: E731
    got = jax.grad(loss(lambda *a: causal_attention(*a, impl=impl, docs=docs)), argnums=(0, 1, 2))(q, k, v)
    with jax.default_matmul_precision("highest"):
        want = jax.grad(loss(lambda *a: reference_attention(*a, docs)), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=5 * atol, rtol=0)


def test_auto_falls_back_to_xla_with_a_reason_and_cudnn_is_refused_on_cpu():
    cpu = jax.devices()[0]
    kernel, why = select_kernel("auto", jnp.bfloat16, 64, cpu)
    assert kernel == "xla" and "NVIDIA GPU" in why
    with pytest.raises(UserError, match="model.attention=cudnn cannot run here"):
        select_kernel("cudnn", jnp.bfloat16, 64, cpu)
    with pytest.raises(UserError, match="model.attention=mosaic cannot run here: it needs an NVIDIA GPU"):
        select_kernel("mosaic", jnp.bfloat16, 64, cpu)
    proc = run_cli("--mesh", "dp=8", "model.attention=cudnn", "train.steps=1")
    assert proc.returncode == 2 and "cannot run here" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("overrides, mesh, words", [
    (["model.document_mask=true"], "fsdp=8", "not with model.document_mask"),
    ([], "cp=2,fsdp=4", "not with cp"),
    ([], "dp=2,fsdp=4", "cannot run with dp=2"),
    ([], "pp=2,fsdp=4", "cannot run with pp=2"),
])
def test_mosaic_attention_outside_its_layouts_is_one_line_before_compiling(overrides, mesh, words):
    """model.attention=mosaic (jaxgpt/lowering/flash.py) runs plain causal attention in steps with no
    manual shard_map; anything else is refused by validate, naming what to use instead."""
    cfg = tiny_config("model.attention=mosaic", "model.n_layer=4", *overrides, mesh=mesh)
    with pytest.raises(UserError, match=words) as e:
        validate(cfg, 8)
    assert "model.attention=auto or cudnn" in str(e.value) and "\n" not in str(e.value)


def _dequantized(x: jax.Array, fmt) -> jax.Array:
    q, scale = quantize(x, fmt)
    return q.astype(jnp.float32) * scale


def test_quantize_rounds_to_representable_fp8_values():
    x = jax.random.normal(jax.random.key(1), (256, 64), jnp.float32) * 3.0
    for fmt, rel in [(E4M3, 2.0 ** -4), (E5M2, 2.0 ** -3)]:  # half an ulp: 3 and 2 mantissa bits
        q, scale = quantize(x, fmt)
        least = float(jnp.max(jnp.abs(x))) / float(jnp.finfo(fmt).max)  # the scale that maps amax onto fmax
        assert q.dtype == fmt and least <= float(scale) < 2 * least and np.log2(float(scale)).is_integer()
        y = _dequantized(x, fmt)
        normal = jnp.abs(x) > 2.0 ** -4 * jnp.max(jnp.abs(x))  # away from the subnormal range
        assert float(jnp.max(jnp.where(normal, jnp.abs(y - x) / jnp.abs(x), 0))) <= rel * 1.0001
        assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) > float(jnp.finfo(fmt).max) / 2  # the top binade is used


def test_quantize_keeps_a_non_finite_tensor_non_finite():
    """An inf or NaN in the operand comes out as NaN in its fp8 copy (and so in the GEMM and the
    loss, where train stops the run), never clipped to a finite fp8 value."""
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        x = jnp.ones((4, 8), jnp.bfloat16).at[1, 2].set(bad)
        for fmt in (E4M3, E5M2):
            q, _ = quantize(x, fmt)
            assert bool(jnp.isnan(q.astype(jnp.float32)).any()), (bad, fmt)


# Per format: (unit roundoff u, the absolute rounding error of a subnormal in units of the scale):
# e4m3fn has 3 mantissa bits (u = 2^-4) and subnormal spacing 2^-9; e5m2 has 2 (u = 2^-3) and 2^-16.
ROUNDING = {E4M3: (2.0 ** -4, 2.0 ** -10), E5M2: (2.0 ** -3, 2.0 ** -17)}


def _rounding_bound(a: np.ndarray, fmt) -> np.ndarray:
    """The most quantize() can move each element of a: half an ulp, relative for normal values,
    absolute (times the scale) for subnormal ones."""
    u, sub = ROUNDING[fmt]
    scale = float(power_of_two_scale(jnp.float32(np.abs(a).max()), fmt))  # quantize()'s own scale
    return np.maximum(u * np.abs(a), sub * scale)


def _product_bound(spec: str, a: np.ndarray, fa, b: np.ndarray, fb) -> np.ndarray:
    """|einsum(spec, a~, b~) - einsum(spec, a, b)| for a~, b~ rounded to fa, fb, summed in fp32:
    sum(ea|b| + |a|eb + ea eb) over the contraction, plus fp32 accumulation (gamma_K sum|a~ b~|,
    K the contraction length) and the fp32 result's own rounding. Derived, not tuned."""
    ea, eb = _rounding_bound(a, fa), _rounding_bound(b, fb)
    ins, out = spec.split("->")
    sa, sb = ins.split(",")
    K = int(np.prod([a.shape[sa.index(c)] for c in sa if c in sb and c not in out]))
    gamma = K * 2.0 ** -24 / (1 - K * 2.0 ** -24)
    abs_ab = np.einsum(spec, np.abs(a) + ea, np.abs(b) + eb)
    return (np.einsum(spec, ea, np.abs(b)) + np.einsum(spec, np.abs(a), eb) + np.einsum(spec, ea, eb)
            + gamma * abs_ab + 2.0 ** -24 * abs_ab) * (1 + 2.0 ** -20)


@pytest.mark.parametrize("spec, x_shape, w_shape", [("btd,df->btf", (4, 16, 64), (64, 48)),
                                                    ("btd,dshk->btshk", (2, 8, 32), (32, 3, 4, 8)),
                                                    ("egcd,edf->egcf", (4, 2, 8, 16), (4, 16, 24))])
def test_fp8_einsum_and_its_gradients_are_within_fp8_rounding_of_float64(spec, x_shape, w_shape):
    """Forward (e4m3 x e4m3), dx (e5m2 dy x e4m3 w) and dw (e4m3 x x e5m2 dy) against the exact
    product in float64, element by element, within the bound fp8 rounding implies; and off by more
    than a bf16 path would be (a matmul left in bf16 rounds 16x finer and fails the second check)."""
    keys = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(keys[0], x_shape, jnp.float32) * jnp.exp(jax.random.normal(keys[1], x_shape))
    w = jax.random.normal(keys[1], w_shape, jnp.float32) * 0.05
    y, vjp = jax.vjp(lambda x, w: fp8_einsum(spec, x, w), x, w)
    dy = jax.random.normal(keys[2], y.shape, jnp.float32) * 1e-3
    dx, dw = vjp(dy)
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    a, b, out = spec.replace("->", ",").split(",")
    for got, want, bound in [
        (y, np.einsum(spec, x64, w64), _product_bound(spec, x64, E4M3, w64, E4M3)),
        (dx, np.einsum(f"{out},{b}->{a}", dy64, w64), _product_bound(f"{out},{b}->{a}", dy64, E5M2, w64, E4M3)),
        (dw, np.einsum(f"{a},{out}->{b}", x64, dy64), _product_bound(f"{a},{out}->{b}", x64, E4M3, dy64, E5M2)),
    ]:
        err = np.abs(np.asarray(got, np.float64) - want)
        assert np.all(err <= bound), float(np.max(err / bound))
        assert np.linalg.norm(err) > 1e-2 * np.linalg.norm(want)  # fp8's ~5%, not bf16's ~0.2%


def test_fp8_einsum_keeps_the_compute_dtype_and_fp8_residuals():
    x = jax.random.normal(jax.random.key(2), (8, 16, 32), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (32, 24), jnp.float32) * 0.1
    y, vjp = jax.vjp(lambda x, w: fp8_einsum("btd,df->btf", x, w), x, w.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in vjp(jnp.ones_like(y)))
    grads = jax.grad(lambda x, w: fp8_einsum("btd,df->btf", x, w).astype(jnp.float32).sum(), argnums=(0, 1))
    dots = [[v.aval.dtype.name for v in eqn.invars] for eqn in _equations(jax.make_jaxpr(grads)(x, w.astype(jnp.bfloat16)).jaxpr)
            if eqn.primitive.name == "dot_general"]
    e4, e5 = jnp.dtype(E4M3).name, jnp.dtype(E5M2).name
    assert sorted(dots) == sorted([[e4, e4], [e5, e4], [e4, e5]])  # forward, dx = dy w^T, dw = x^T dy


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (custom_vjp, jit)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _equations(sub)


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory, shakespeare_dir):
    run_dir = tmp_path_factory.mktemp("no-fp8")
    # lr 3x the default: at 1e-3 the tiny vocabulary's loss fell 0.28 in 20 steps, under the 0.3 asked below
    train(tiny_config("train.steps=20", "optimizer.warmup_steps=5", "optimizer.lr=3e-3", mesh="dp=8"), run_dir)
    return train_losses(run_dir)


def test_fp8_training_stays_close(fp32_losses, tmp_path):
    """20 steps of the tiny model with fp8 matmuls track the same run without: every loss within
    1% (the loss falls ~10% over the run, 7.06 -> 6.35, so a broken fp8 path would show)."""
    train(tiny_config("train.steps=20", "optimizer.warmup_steps=5", "optimizer.lr=3e-3", "model.fp8=true",
                      mesh="dp=8"), tmp_path)
    fp8 = train_losses(tmp_path)
    assert fp32_losses[-1] < fp32_losses[0] - 0.3
    np.testing.assert_allclose(fp8, fp32_losses, rtol=0.01)


def test_fp8_head_loss_and_gradients_track_the_exact_head():
    """model.fp8_head: the fused head + loss with e4m3 logits GEMM and e5m2 x e4m3 gradient GEMMs
    against the same loss in float32, on a default-run-shaped head (D 128, the GPT-2 vocabulary).
    The loss moves by less than e4m3's relative rounding (2^-4) times the logits' spread, and the
    gradients by e5m2's (2^-3) relative error in norm; all three GEMMs of the chunk are fp8."""
    from jaxgpt.lowering.loss import chunked_cross_entropy
    cfg = tiny_config("model.n_embd=128", "model.seq_len=64", "model.loss_chunk=16", "model.ops=tuned", *GPT2_VOCAB).model
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (4, 64, 128), jnp.float32)
    wte = jax.random.normal(keys[1], (50304, 128), jnp.float32) * 0.02
    labels = jax.random.randint(keys[2], (4, 64), 0, cfg.vocab_size)

    def loss(fp8_head):
        ops = lowering(dataclasses.replace(cfg, fp8_head=fp8_head))
        return jax.value_and_grad(lambda x, w: chunked_cross_entropy(x, w, labels, ops, jnp.float32), argnums=(0, 1))

    (l8, (dx8, dw8)), (l, (dx, dw)) = jax.jit(loss(True))(x, wte), jax.jit(loss(False))(x, wte)
    logits_std = float(jnp.std(jnp.einsum("btd,vd->btv", x[:1], wte)))
    assert abs(float(l8) - float(l)) < 2.0 ** -4 * logits_std
    for a, b in [(dx8, dx), (dw8, dw)]:
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 2.0 ** -3
    jaxpr = jax.make_jaxpr(loss(True))(x, wte).jaxpr
    dots = [[v.aval.dtype.name for v in eqn.invars] for eqn in _equations(jaxpr) if eqn.primitive.name == "dot_general"]
    assert len(dots) == 3 and all(d[0].startswith("float8") and d[1].startswith("float8") for d in dots), dots


def test_fp8_scale_is_global_inside_the_dp_shard_map():
    """The train step runs under a shard_map that is manual over dp (jaxgpt/step.py). There each
    device sees only its rows, so the fp8 scale must still come from the whole tensor's amax
    (a pmax over the manual axes): the quantized tensor is bit-identical to the unsharded one
    (both jitted: eager mode rounds x / scale differently by an ulp). A per-shard scale moves
    elements by up to half an fp8 step, ~6%."""
    mesh = make_mesh({"dp": 8, "fsdp": 1, "tp": 1})
    x = jax.random.normal(jax.random.key(3), (64, 32), jnp.float32) * jnp.arange(1, 65)[:, None]
    per_shard = jax.shard_map(lambda x: _dequantized(x, E4M3), mesh=mesh, in_specs=P("dp"), out_specs=P("dp"),
                              axis_names={"dp"})
    with jax.set_mesh(mesh):
        got = jax.jit(per_shard)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(lambda x: _dequantized(x, E4M3))(x)))


def test_fp8_under_a_3d_mesh_matches_one_device(tmp_path):
    """fp8 on dp=2,fsdp=2,tp=2 and pp=2,dp=2,tp=2 vs one device: the per-tensor amax is a global
    max (exact under any sharding; under pp each stage's own tensors), but a different fp32 summation order can move a value across an fp8 rounding
    boundary, so the bound is looser than the fp32 layouts' 1e-4: 1e-3 on losses of ~7.1. Two
    micro-batches a step, so the weights are quantized once per step (trick prequantize) on the
    flat layouts, inside the dp shard_map too."""
    losses = {}
    for layout, devices in [("dp=1", jax.devices()[:1]), ("dp=2,fsdp=2,tp=2", None), ("pp=2,dp=2,tp=2", None)]:
        run_dir = tmp_path / layout
        train(tiny_config("train.steps=5", "model.fp8=true", "train.grad_accum=2", mesh=layout), run_dir,
              devices=devices)
        losses[layout] = train_losses(run_dir)
    for layout in ("dp=2,fsdp=2,tp=2", "pp=2,dp=2,tp=2"):  # pp: each stage scales its own layers' tensors
        np.testing.assert_allclose(losses[layout], losses["dp=1"], rtol=0, atol=1e-3, err_msg=layout)


def test_gelu_backward_recomputes_the_autodiff_gradient():
    """jaxgpt/lowering/activations.py's gelu_tanh keeps only the pre-activation and recomputes tanh in its backward
    pass (custom VJP): its value is jax.nn.gelu(approximate=True)'s bit for bit, and its fp32
    gradient is as close to the exact derivative (float64) as autodiff's, over |h| up to 12 (fp32's
    own rounding near the saturated tails, ~3.5e-6, bounds both); in bf16 (computed in fp32 and
    rounded once) it is within bf16's unit roundoff of the fp32 gradient."""
    from jaxgpt.lowering.activations import gelu_tanh
    h = jnp.concatenate([jnp.linspace(-12.0, 12.0, 4001), jax.random.normal(jax.random.key(0), (4096,)) * 3])
    w = jax.random.normal(jax.random.key(1), h.shape)
    np.testing.assert_array_equal(np.asarray(gelu_tanh(h)), np.asarray(jax.nn.gelu(h, approximate=True)))
    ours = jax.grad(lambda h: jnp.sum(gelu_tanh(h) * w))(h)
    autodiff = jax.grad(lambda h: jnp.sum(jax.nn.gelu(h, approximate=True) * w))(h)
    x, c, k = np.asarray(h, np.float64), np.sqrt(2 / np.pi), 0.044715
    t = np.tanh(c * (x + k * x ** 3))
    exact = (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x)) * np.asarray(w, np.float64)
    err_ours, err_autodiff = (np.abs(np.asarray(g, np.float64) - exact).max() for g in (ours, autodiff))
    assert err_ours <= 1.01 * err_autodiff + 1e-7, (err_ours, err_autodiff)
    h16, w16 = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)  # the same inputs, rounded, in fp32 below
    ours_bf16 = jax.grad(lambda h: jnp.sum(gelu_tanh(h) * w16))(h16)
    ours_fp32 = jax.grad(lambda h: jnp.sum(gelu_tanh(h) * w16.astype(jnp.float32)))(h16.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(ours_bf16, np.float32), np.asarray(ours_fp32), rtol=2.0 ** -8, atol=0)


def test_gelu_keeping_its_derivative_rounds_the_gradient_twice_at_most():
    """jaxgpt/lowering/activations.py `gelu_tanh_keeping_derivative` (trick gelu_derivative: the bf16 MLP's on a GPU): its value is
    jax.nn.gelu's bit for bit, and its bf16 gradient round(g round(gelu'(h))) is within two bf16
    roundings of g gelu'(h) with the derivative in fp32: the derivative kept in bf16 by the forward,
    then the product. `gelu_tanh`'s, which recomputes the derivative in fp32, is within one."""
    from jaxgpt.lowering.activations import _gelu_derivative, gelu_tanh, gelu_tanh_keeping_derivative
    h = jnp.concatenate([jnp.linspace(-12.0, 12.0, 4001), jax.random.normal(jax.random.key(0), (4096,)) * 3])
    h16, g16 = h.astype(jnp.bfloat16), jax.random.normal(jax.random.key(1), h.shape).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(gelu_tanh_keeping_derivative(h16)),
                                  np.asarray(jax.nn.gelu(h16, approximate=True)))
    product = np.asarray(g16, np.float64) * np.asarray(_gelu_derivative(h16.astype(jnp.float32)), np.float64)
    u = 2.0 ** -8  # bf16's unit roundoff
    for fn, roundings in ((gelu_tanh_keeping_derivative, 2), (gelu_tanh, 1)):
        grad = jax.vjp(fn, h16)[1](g16)[0]
        assert grad.dtype == jnp.bfloat16
        err = np.abs(np.asarray(grad, np.float64) - product)
        assert np.all(err <= ((1 + u) ** roundings - 1 + 2.0 ** -23) * np.abs(product)), fn.__name__


def test_online_logsumexp_matches_two_passes():
    """The fused loss's one-pass logsumexp (jaxgpt/lowering/loss.py online_lse over online_max_sum, the
    reduction a GPU runs) against jax.nn.logsumexp on the head's shape: rows at several scales
    (the running max grows and rescales the sum), the vocabulary padding at -inf, a row of only
    -inf (-inf, not NaN) and a logit of 1e30 (the sum of exp of the others vanishes, no overflow). Equal to fp32 rounding of
    the largest logit: 1e-6 relative."""
    from jaxgpt.lowering.loss import online_lse
    x = jax.random.normal(jax.random.key(0), (4, 8, 50304)) * jnp.array([0.1, 1.0, 10.0, 100.0])[:, None, None]
    x = x.at[..., 50257:].set(-jnp.inf).at[0, 0].set(-jnp.inf).at[1, 1, 5].set(1e30)
    ours, reference = np.asarray(jax.jit(online_lse)(x)), np.asarray(jax.jit(jax.nn.logsumexp, static_argnums=1)(x, -1))
    assert ours[0, 0] == -np.inf and ours[1, 1] == 1e30
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=0)


def _assert_same_gradient(cfg, path, a, b) -> None:
    """a (with the copies) is b (in the loop) bit for bit; but for the bias of an fp8 GEMM that takes
    it in its epilogue (q, k and v; the MLP's in and gate), whose gradient the prequantized GEMMs sum
    in fp32 (jaxgpt/lowering/fp8.py `_pre_backward`) where autodiff of the in-loop bias add sums it in bf16:
    within 2^-5 of its largest element."""
    a, b = np.asarray(a), np.asarray(b)
    leaf = tuple(getattr(k, "key", None) for k in path)
    kinds = {("blocks", "attn", "c_attn_bias"): "qkv", ("blocks", "mlp", "c_fc_bias"): "mlp_in",
             ("blocks", "mlp", "c_gate_bias"): "mlp_gate"}
    if kinds.get(leaf) in cfg.fp8_linears():
        np.testing.assert_allclose(a, b, rtol=0, atol=2.0 ** -5 * np.abs(b).max(), err_msg=str(path))
    else:
        np.testing.assert_array_equal(a, b, err_msg=str(path))


def _copies_and_in_loop(cfg, rows: int, fp32_grads: bool = False) -> tuple:
    """A bf16 micro-batch of `rows` sequences through `cfg`'s model, tuned (jaxgpt/lowering/):
    (params, the copies the train step makes of its block weights once per step (copies.py),
    loss(params, copies), (loss, grads) with the copies, (loss, grads) with each weight cast or
    quantized inside its layer instead)."""
    from flax import nnx

    from jaxgpt.copies import copies_once_per_step, with_copies
    from jaxgpt.model import GPT
    from jaxgpt.step import objective_fn, param_logical_axes
    ops = lowering(cfg, "tuned")
    graphdef, state = nnx.split(GPT(cfg, nnx.Rngs(0), ops), nnx.Param)
    params, axes = nnx.to_pure_dict(state), param_logical_axes(state)
    batch_BT1 = jax.random.randint(jax.random.key(1), (rows, cfg.seq_len + 1), 0, cfg.vocab_size)
    pre = jax.jit(lambda blocks: copies_once_per_step(blocks, axes["blocks"], ops, jnp.bfloat16, fp32_grads))(
        params["blocks"])  # compiled, as the train step makes them (and one compile, not an eager op each)

    def loss(p, pre):
        return objective_fn(with_copies(p, pre, axes["blocks"]), graphdef, batch_BT1, cfg, jnp.bfloat16)[0]

    return params, pre, loss, *(jax.jit(jax.value_and_grad(loss))(params, q) for q in (pre, None))


@pytest.mark.parametrize("overrides, weights", [
    (["model.scan_layers=false"], {"attn": ["c_attn_kernel", "c_proj_kernel"], "mlp": ["c_fc_kernel", "c_proj_kernel"]}),
    (["model.norm=rmsnorm", "model.mlp=swiglu", "model.mlp_hidden=64", "model.n_kv_head=2", "model.bias=false"],
     {"attn": ["c_proj_kernel", "kv_kernel", "q_kernel"], "mlp": ["c_fc_kernel", "c_gate_kernel", "c_proj_kernel"]}),
], ids=["gpt2", "llama"])
def test_prequantized_fp8_weights_give_the_in_loop_loss_and_gradients(overrides, weights):
    """With micro-batches the train step quantizes the fp8 block weights once per step, before its
    loop (trick prequantize, jaxgpt/copies.py; each GEMM then reads the e4m3 copy in the layout it
    takes). A micro-batch's loss and every gradient are bit for bit those of quantizing each weight
    inside the layer, for every kind (GQA's q and kv weights, SwiGLU's gate too), in bf16, with the
    layers unrolled (GPT-2 here, the copies per layer) and scanned (Llama, the copies stacked); and no
    max-reduction over a block weight is left in the prequantized loss (the weights' amax is taken
    outside)."""
    cfg = tiny_config("model.fp8=true", *overrides).model
    # 3 sequences: 4 x 32 rows of D = 32 made the norm's [rows, D] row maxima (norm.py
    # `normalize_with_amax`) the shape of mlp_out's weight [4D, D] (2 x 32 rows SwiGLU's [64, D]),
    # which the check below tells by shape
    params, pre, loss, (l_pre, g_pre), (l_in, g_in) = _copies_and_in_loop(cfg, 3)
    assert {module: sorted(ws) for module, ws in pre.items()} == weights
    assert float(l_pre) == float(l_in)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_pre)[0], jax.tree.leaves(g_in)):
        _assert_same_gradient(cfg, path, a, b)
    weight_shapes = {w.q[0].shape for ws in pre.values() for w in ws.values()}  # one layer's
    maxes = [eqn.invars[0].aval.shape for eqn in _equations(jax.make_jaxpr(loss)(params, pre).jaxpr)
             if eqn.primitive.name == "reduce_max"]
    assert maxes and not [s for s in maxes if s in weight_shapes], maxes


def test_fp32_weight_gradients_round_to_the_in_loop_ones():
    """Where the train step sums the block weights' gradients inside their GEMMs
    (trick grads_in_gemm: unrolled layers, micro-batches), the copies made once
    per step are the *Fp32Grad ones, whose gradient GEMMs write fp32 (jaxgpt/lowering/linear.py
    `_precast_einsum`, fp8.py `_pre_backward`). In bf16, GPT-2 unrolled with qkv and mlp_out
    in fp8: the loss and every other gradient are bit for bit the in-loop ones; an fp8 weight's
    gradient rounds to the in-loop one exactly (the same fp32 sum, its power-of-two rescale exact);
    a bf16 one is within 2^-5 of its largest element: XLA:CPU's bf16 dot, which autodiff's in-loop
    gradient takes, is off by up to 2% of it here (tests/test_ops.py holds the fp32 one to 1e-6 of
    the exact sum)."""
    from jaxgpt.lowering.fp8 import PrequantizedFp32Grad
    from jaxgpt.lowering.linear import PrecastFp32Grad
    cfg = tiny_config("model.scan_layers=false", "model.fp8=qkv,mlp_out").model
    _, pre, _, (l_pre, g_pre), (l_in, g_in) = _copies_and_in_loop(cfg, 3, fp32_grads=True)
    kinds = {(module, name): type(p) for module, ws in pre.items() for name, p in ws.items()}
    assert sorted(k.__name__ for k in kinds.values()) == ["PrecastFp32Grad"] * 2 + ["PrequantizedFp32Grad"] * 2
    assert float(l_pre) == float(l_in)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_pre)[0], jax.tree.leaves(g_in)):
        a, b = np.asarray(a), np.asarray(b)
        kind = kinds.get((path[1].key, path[2].key)) if path[0].key == "blocks" else None
        if kind is PrequantizedFp32Grad:
            np.testing.assert_array_equal(np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float32), b, str(path))
        elif kind is PrecastFp32Grad:
            np.testing.assert_allclose(a, b, rtol=0, atol=2.0 ** -5 * np.abs(b).max(), err_msg=str(path))
        else:
            _assert_same_gradient(cfg, path, a, b)


@pytest.mark.parametrize("overrides", [["model.scan_layers=false"], ["model.scan_layers=false", "model.fp8=qkv,mlp_out"],
                                       ["model.norm=rmsnorm", "model.mlp=swiglu", "model.mlp_hidden=64",
                                        "model.n_kv_head=2", "model.bias=false"]], ids=["gpt2", "gpt2-fp8-mixed", "llama"])
def test_precast_weights_give_the_in_loop_loss_and_gradients(overrides):
    """With micro-batches the train step casts the block weights that are not fp8 to the compute
    dtype once per step, before its loop (trick precast, jaxgpt/copies.py), instead of in every
    micro-batch. A micro-batch's loss and every fp32 gradient are bit for bit those of casting in
    the layer, in bf16, unrolled (per-layer copies, also beside fp8 kinds' prequantized ones) and
    scanned (stacked copies); and no block weight is cast inside the loss any more."""
    cfg = tiny_config(*overrides).model
    params, pre, loss, (l_pre, g_pre), (l_in, g_in) = _copies_and_in_loop(cfg, 3)  # 96 rows: no weight's shape
    assert sum(len(ws) for ws in pre.values()) == (6 if cfg.mlp == "swiglu" else 4)
    assert float(l_pre) == float(l_in)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_pre)[0], jax.tree.leaves(g_in)):
        assert a.dtype == jnp.float32, path
        _assert_same_gradient(cfg, path, a, b)
    weights = {params["blocks"][module][name].shape for module, ws in pre.items() for name in ws}
    weights |= {shape[1:] for shape in weights}  # the stack and one layer
    casts = [eqn.invars[0].aval.shape for eqn in _equations(jax.make_jaxpr(loss)(params, pre).jaxpr)
             if eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.dtype == jnp.float32
             and eqn.params["new_dtype"] == jnp.bfloat16]
    assert casts and not [s for s in casts if s in weights], casts  # casts remain: embeddings, norms, biases

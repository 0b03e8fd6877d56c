"""Every trick of the lowering layer (jaxgpt/lowering/, docs/ops.md) against the reference forms
(jaxgpt/model/ops.py): issue 58's tuned-equals-reference matrix, and the numerics of the ops whose
tuned forms round differently (hand-written backward passes in bf16, fp32 weight gradients, fp8
bounds). What the tricks save XLA:GPU from writing is held by tests/test_gpu_compile.py; the
weight copies made once per step by tests/test_kernels.py; every layout in both forms by
tests/test_parallel.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import lowering, tiny_config

from jaxgpt.config import TRICKS, validate
from jaxgpt.errors import UserError
from jaxgpt.lowering.activations import relu2, swiglu
from jaxgpt.lowering.norm import normalize
from jaxgpt.model import GPT, Ops
from jaxgpt.step import objective_fn

# The tricks that act in fp32 on one CPU device, each with the ones it builds on; the others act only
# in bf16 (the weight copies, gelu_derivative: tests/test_kernels.py), in fp8 (below) or under fsdp
# in bf16 (tables_in_compute_dtype: test_parallel.py's bf16 dp=2,fsdp=2,tp=2, test_gpu_compile.py).
FP32_TRICKS = {"norm_vjp": (), "norm_recompute": ("norm_vjp",), "routed_bias": (), "activation_vjps": (),
               "residual_epilogue": (), "qkv_gemms": (), "qkv_bias_drop": (), "fused_loss": ()}
FP8_TRICKS = {"fp8_pins": (), "h_fence": (), "activation_amax": (), "norm_amax": ("norm_vjp",)}
ELSEWHERE = {"precast", "grads_in_gemm", "gelu_derivative", "prequantize", "fp8_pieces", "tables_in_compute_dtype"}
# the block the tricks treat apart from GPT-2's (every bias random: none is zero at init): k's bias kept
# with rope and its gradient routed, grouped-query q and kv with v's bias folded over the groups, SwiGLU's
# gate. (Without biases RMSNorm routes nothing; an untied soft-capped head: test_modern.py, both forms.)
MODERN = ("model.position=rope", "model.n_kv_head=2", "model.mlp=swiglu", "model.mlp_hidden=64")


def test_every_trick_is_in_the_matrix():
    assert set(FP32_TRICKS) | set(FP8_TRICKS) | ELSEWHERE == set(TRICKS)


def test_model_ops_takes_its_forms_or_tricks_and_says_so_in_one_line_when_wrong():
    """model.ops: auto, reference, tuned, or tricks (written back in TRICKS' order); anything else,
    or fp8's head without the fused loss it runs in, one sentence naming what is valid, before
    anything compiles."""
    assert tiny_config("model.ops=fused_loss,routed_bias").model.ops == "routed_bias,fused_loss"
    assert lowering(tiny_config().model, "reference").tricks == frozenset()
    assert lowering(tiny_config().model, "tuned").tricks == frozenset(TRICKS)
    for value, words in (("fastest", "got 'fastest'"), ("routed_bais", "did you mean 'routed_bias'"), (",", "")):
        with pytest.raises(UserError, match="config key 'model.ops' is one of auto, reference, tuned or a") as e:
            tiny_config(f"model.ops={value}")
        assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="model.fp8_head runs inside the fused loss"):
        validate(tiny_config("model.ops=reference", "model.fp8_head=true"), 1)


def _variants(cfg, tricks: dict, alone: bool = True) -> dict[str, tuple]:
    """name -> graphdef: the reference, each trick alone (with what it builds on; `alone`), all of them."""
    forms = {"reference": "reference", **({t: ",".join((t, *needs)) for t, needs in tricks.items()} if alone else {}),
             "all": ",".join(tricks)}
    out = {}
    for name, ops in forms.items():
        lowered = lowering(cfg.model, ops)
        out[name] = nnx.split(nnx.eval_shape(lambda lowered=lowered: GPT(cfg.model, nnx.Rngs(0), lowered)))[0]
    return out


def _losses_and_grads(cfg, tricks: dict, alone: bool = True, rows: int = 4):
    """{variant: (objective, grads)} of one batch, every variant in one jit (one compile)."""
    graphdefs = _variants(cfg, tricks, alone)
    params = nnx.to_pure_dict(nnx.split(GPT(cfg.model, nnx.Rngs(0)), nnx.Param)[1])
    keys = iter(jax.random.split(jax.random.key(1), 256))
    params = jax.tree_util.tree_map_with_path(  # biases away from 0, so that dropping or routing one shows
        lambda path, p: p + 0.1 * jax.random.normal(next(keys), p.shape) if "bias" in str(path[-1]) else p, params)
    batch_BT1 = jax.random.randint(jax.random.key(2), (rows, cfg.model.seq_len + 1), 0, cfg.model.vocab_size)

    @jax.jit
    def run(params):
        def objective(graphdef):
            return lambda params: objective_fn(params, graphdef, batch_BT1, cfg.model, jnp.float32)[0]
        return {name: jax.value_and_grad(objective(g))(params) for name, g in graphdefs.items()}

    return run(params)


def _assert_close(got, want, name, rtol=1e-5):
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=rtol, atol=0, err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-6 * float(np.abs(b).max()),
                                   err_msg=f"{name}: {jax.tree_util.keystr(path)}")


def test_each_trick_and_all_of_them_equal_the_reference():
    """fp32 on one CPU device, GPT-2's block (every bias random): each trick alone (on the ones it
    builds on) and all of them (model.ops=tuned's, less the bf16 and fp8 ones) give the reference
    forms' loss and every gradient to fp32 rounding, 1e-5 relative (the norms' and the loss's sums
    in another order, a bias's gradient routed through the weights it feeds): a trick that dropped,
    folded or routed a bias wrongly would move its gradient by ~1e-1. Every layout: the layout tests
    (tests/test_parallel.py, test_pipeline.py, test_context.py, test_moe.py) train the tuned forms
    to the reference forms' one-device losses, and the reference forms on a layout too."""
    results = _losses_and_grads(tiny_config(), FP32_TRICKS)
    for name, got in results.items():
        _assert_close(got, results["reference"], name)


def test_all_the_tricks_equal_the_reference_on_the_modern_block():
    """The same for the block the tricks treat apart from GPT-2's (MODERN), all of them at once."""
    results = _losses_and_grads(tiny_config(*MODERN), FP32_TRICKS, alone=False)
    _assert_close(results["all"], results["reference"], "modern")


def test_fp8_tricks_keep_the_fp8_reference_loss():
    """model.fp8=true, fp32 compute: the fp8 tricks together against fp8's reference form (each
    GEMM's operands quantized with their own amax in the loop). The pins and the fence move no
    value; the bounds on an activation's or a norm's max |x| may give a scale one power of two
    higher than the exact amax's, so the loss is held to the fp8 layouts' 1e-3 (test_kernels.py)
    and each gradient to e5m2's relative error in norm. (The copies once per step, bit for bit the
    in-loop quantization: test_kernels.py.)"""
    results = _losses_and_grads(tiny_config("model.fp8=true", "model.scan_layers=false"), FP8_TRICKS, alone=False)
    (loss, grads), (ref_loss, ref_grads) = results["all"], results["reference"]
    assert abs(float(loss) - float(ref_loss)) < 1e-3
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert float(jnp.linalg.norm(a - b)) <= 2.0 ** -3 * float(jnp.linalg.norm(b)) + 1e-9


def test_the_loss_weighs_each_token_in_both_forms():
    """The loss op's per-token weights (SFT's loss mask, `weights_BT`): sum(w nats) / sum(w), the
    fused form (its backward scales each row's gradient by its weight) equal to the reference's in
    value and gradients (fp32: 1e-6 for the loss, the matrix's 1e-5 for gradients); all-ones
    weights give the plain mean, and tokens of weight 0 move neither the loss nor the gradient."""
    cfg = tiny_config("model.loss_chunk=8", "model.logit_softcap=20").model
    keys = jax.random.split(jax.random.key(4), 4)
    x = jax.random.normal(keys[0], (4, cfg.seq_len, cfg.n_embd))
    table = 0.2 * jax.random.normal(keys[1], (cfg.padded_vocab, cfg.n_embd))
    labels = jax.random.randint(keys[2], (4, cfg.seq_len), 0, cfg.vocab_size)
    w = jnp.where(jax.random.uniform(keys[3], labels.shape) < 0.3, 0.0, jax.random.uniform(keys[3], labels.shape))

    def loss(form, ww):
        return lambda x, t: lowering(cfg, form).cross_entropy(x, t, labels, jnp.float32, ww)

    @jax.jit
    def run(x, table, w):
        return ({form: jax.value_and_grad(loss(form, w), argnums=(0, 1))(x, table) for form in ("reference", "tuned")},
                loss("tuned", None)(x, table), loss("tuned", jnp.ones_like(w))(x, table))

    out, plain, ones = run(x, table, w)
    np.testing.assert_allclose(float(ones), float(plain), rtol=1e-6)
    (a, ga), (b, gb) = out["tuned"], out["reference"]
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    for g, h in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-6 * float(jnp.abs(h).max()))
    dx = ga[0]
    assert float(jnp.abs(jnp.where(w[..., None] == 0, dx, 0)).max()) == 0.0


def _reference_norm(x, scale, bias, rms):
    """The reference form (jaxgpt/model/ops.py), left to autodiff, in fp32."""
    return Ops(tiny_config().model).norm(x.astype(jnp.float32), scale, bias, rms).astype(jnp.float32)


NORM_CASES = [(False, True, True, (64, 48)), (False, False, False, (4, 16, 48)), (True, True, False, (64, 48)),
              (True, True, False, (2, 8, 4, 16))]  # qk-norm: RMS over the head dim of [B, T, H, K]


@pytest.mark.parametrize("keep_stats", [False, True], ids=["recomputed", "kept"])
@pytest.mark.parametrize("rms,with_scale,with_bias,shape", NORM_CASES)
def test_norm_value_and_gradients_match_autodiff(rms, with_scale, with_bias, shape, keep_stats):
    """fp32: values to 1e-6, gradients of x, scale and bias to 1e-5 of autodiff's (rows offset by 3
    and scaled by 4, so the mean matters); bf16 x: y and dx come back in bf16, within bf16's
    rounding of the fp32 gradient. With the statistics recomputed in the backward (the default) and
    kept from the forward (under fsdp, or before an fp8 GEMM)."""
    k = jax.random.split(jax.random.key(0), 4)
    D = shape[-1]
    x = 4 * jax.random.normal(k[0], shape) + 3
    scale = 1 + 0.1 * jax.random.normal(k[1], (D,)) if with_scale else None
    bias = 0.1 * jax.random.normal(k[2], (D,)) if with_bias else None
    w = jax.random.normal(k[3], shape)

    @jax.jit
    def run(x, scale, bias):
        def loss(fn, x, scale, bias):
            return jnp.sum(fn(x, scale, bias, rms).astype(jnp.float32) * w)

        def ours(x, scale, bias, rms):
            return normalize(x, scale, bias, rms, keep_stats)

        x16 = x.astype(jnp.bfloat16)
        return (ours(x, scale, bias, rms), _reference_norm(x, scale, bias, rms),
                jax.value_and_grad(loss, argnums=(1, 2, 3))(ours, x, scale, bias),
                jax.value_and_grad(loss, argnums=(1, 2, 3))(_reference_norm, x, scale, bias),
                ours(x16, scale, bias, rms), jax.grad(loss, argnums=1)(ours, x16, scale, bias),
                jax.grad(loss, argnums=1)(_reference_norm, x16.astype(jnp.float32), scale, bias))

    y, y_ref, (ours, ours_grads), (ref, ref_grads), y16, dx16, dx32 = run(x, scale, bias)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    assert abs(float(ours) - float(ref)) <= 1e-5 * max(1.0, abs(float(ref)))
    for got, want in zip(ours_grads, ref_grads):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert y16.dtype == dx16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dx16, np.float32), dx32, rtol=2.0 ** -7, atol=2.0 ** -7 * float(
        jnp.abs(dx32).max()))


@pytest.mark.parametrize("rms,with_scale,with_bias", [(False, True, True), (True, True, False), (False, False, False)])
def test_norm_amax_bound_holds_and_the_norm_is_unchanged(rms, with_scale, with_bias):
    """jaxgpt/lowering/norm.py `normalize_with_amax` (trick norm_amax), the norm before an fp8
    GEMM: y and every gradient are
    `normalize`'s (statistics kept) bit for bit, in bf16, and the bound is >= max |y| over y as
    rounded, on rows of very different spreads and with a scale and bias that peak where the
    deviation does not; it is within 4x of max |y| there (so the e4m3 cast's largest value lands
    in (fmax/8, fmax] at worst, one power of two lower than the exact amax's at most twice)."""
    from jaxgpt.lowering.norm import normalize_with_amax
    k = jax.random.split(jax.random.key(3), 5)
    D = 64
    x = (jax.random.normal(k[0], (256, D)) * jnp.exp(2 * jax.random.normal(k[1], (256, 1))) + 3).astype(jnp.bfloat16)
    scale = 1 + jax.random.uniform(k[2], (D,), minval=-0.9, maxval=2.0) if with_scale else None
    bias = jax.random.normal(k[3], (D,)) if with_bias else None
    w = jax.random.normal(k[4], (256, D))

    def loss(fn, x, scale, bias):
        y = fn(x, scale, bias)
        return jnp.sum((y[0] if isinstance(y, tuple) else y).astype(jnp.float32) * w)

    plain = lambda x, s, b: normalize(x, s, b, rms, keep_stats=True)  # noqa: E731
    bounded = lambda x, s, b: normalize_with_amax(x, s, b, rms)  # noqa: E731
    y, amax = jax.jit(bounded)(x, scale, bias)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(jax.jit(plain)(x, scale, bias), np.float32))
    top = float(jnp.abs(y.astype(jnp.float32)).max())
    assert amax.dtype == jnp.float32 and top <= float(amax) <= 4 * top, (top, float(amax))
    grads = [jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)(fn, x, scale, bias) for fn in (plain, bounded)]
    for a, b in zip(*grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("offset,spread", [(1000.0, 0.01), (-5e4, 1.0)])
def test_recomputed_layernorm_statistics_hold_where_the_mean_dwarfs_the_spread(offset, spread):
    """jaxgpt/lowering/norm.py's backward recomputes each row's statistics in one pass (sums of x, x^2, g and
    g x): taken of x - x[..., :1] and never through the mean, they stay at fp32's accuracy against
    float64 where a row's mean is 1e5 times its spread, 1e-6 of the largest gradient. Unshifted,
    E[x^2] - E[x]^2 cancels to garbage there; through the fp32 mean, as autodiff and the kept
    statistics go, x - mean carries the mean's rounding, ~4e-3 of dscale here."""
    k = jax.random.split(jax.random.key(0), 4)
    x = spread * jax.random.normal(k[0], (64, 768)) + offset
    scale, bias = 1 + 0.1 * jax.random.normal(k[1], (768,)), 0.1 * jax.random.normal(k[2], (768,))
    w = jax.random.normal(k[3], (64, 768))
    grads = jax.jit(jax.grad(lambda x, s, b: jnp.sum(normalize(x, s, b, False) * w), (0, 1, 2)))(x, scale, bias)
    x64, s64, w64 = (np.asarray(a, np.float64) for a in (x, scale, w))
    mean = x64.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x64 - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    xhat, gs = (x64 - mean) * rstd, w64 * s64
    exact = (rstd * (gs - gs.mean(-1, keepdims=True) - xhat * (gs * xhat).mean(-1, keepdims=True)),
             (w64 * xhat).sum(0), w64.sum(0))
    for got, want in zip(grads, exact):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("name", ["relu2", "swiglu"])
def test_activation_value_and_gradients_match_autodiff(name):
    """relu(h)^2 and silu(gate) h with backward passes that keep only h (and gate): values bit for
    bit autodiff's (the same forward), fp32 gradients to 1e-6 relative over |h| up to 12 (both
    sides of relu's kink and silu's saturation); in bf16 within bf16's rounding of the fp32 ones."""
    h = jnp.concatenate([jnp.linspace(-12.0, 12.0, 4001), 3 * jax.random.normal(jax.random.key(0), (4096,))])
    gate = jnp.roll(h, 517) * 0.9
    w = jax.random.normal(jax.random.key(1), h.shape)
    ours_fn, ref_fn = {"relu2": (lambda g, h: relu2(h), lambda g, h: jnp.square(jax.nn.relu(h))),
                       "swiglu": (swiglu, lambda g, h: jax.nn.silu(g) * h)}[name]
    np.testing.assert_array_equal(jax.jit(ours_fn)(gate, h), jax.jit(ref_fn)(gate, h))

    @jax.jit
    def run(gate, h, w):
        def grads(fn, gate, h, w):
            return jax.grad(lambda g, h: jnp.sum(fn(g, h).astype(jnp.float32) * w), argnums=(0, 1))(gate, h)

        g16, h16, w16 = gate.astype(jnp.bfloat16), h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        return (grads(ours_fn, gate, h, w), grads(ref_fn, gate, h, w), grads(ours_fn, g16, h16, w16),
                grads(ours_fn, g16.astype(jnp.float32), h16.astype(jnp.float32), w16.astype(jnp.float32)))

    ours, ref, ours16, fp32 = run(gate, h, w)
    for got, want in zip(ours, ref):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))
    for got, want in zip(ours16, fp32):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2.0 ** -8, atol=0)


@pytest.mark.parametrize("kind", ["gelu", "relu2"])
def test_activation_amax_is_the_activations_own_amax(kind):
    """jaxgpt/lowering/activations.py `activation_amax` (trick activation_amax: the fp8 cast's amax
    of the MLP activation, taken from
    h alone): equal to max |activate(h)| in fp32 where h reaches past the negative lobe (every real
    MLP), never below it where h does not (all-negative or tiny h), and equal to the amax that fp8's
    `quantize` takes of the activation itself, so the e4m3 copy is bit for bit the same."""
    from jaxgpt.lowering.activations import activate, activation_amax
    from jaxgpt.lowering.fp8 import E4M3, quantize
    key = jax.random.key(0)
    for h in (jax.random.normal(key, (64, 256)) * 3, jax.random.normal(key, (8, 4, 96)) + 0.5):
        own = jnp.max(jnp.abs(activate(kind, h)))
        assert float(activation_amax(kind, h)) == float(own), kind
        q, s = quantize(activate(kind, h), E4M3, amax=activation_amax(kind, h))
        q_own, s_own = quantize(activate(kind, h), E4M3)
        assert float(s) == float(s_own) and bool(jnp.all(q.view(jnp.uint8) == q_own.view(jnp.uint8)))
    for h in (-jnp.abs(jax.random.normal(key, (64, 256))) * 4, jax.random.normal(key, (64, 256)) * 0.01,
              jnp.full((4, 4), -0.7525)):
        assert float(activation_amax(kind, h)) >= float(jnp.max(jnp.abs(activate(kind, h)))), kind
    assert activation_amax("swiglu", h) is None


# (spec, x's shape, the weight's): MLP in/out, attention-out's heads, QKV's [D, 3, H, K]
LINEAR_CASES = [("btd,df->btf", (2, 16, 48), (48, 96)), ("btf,fd->btd", (2, 16, 96), (96, 48)),
                ("bthk,hkd->btd", (2, 16, 4, 8), (4, 8, 48)), ("btd,dshk->btshk", (2, 16, 48), (48, 3, 4, 8))]


@pytest.mark.parametrize("spec,x_shape,w_shape", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_precast_linear_matches_autodiff_with_an_fp32_weight_gradient(spec, x_shape, w_shape):
    """jaxgpt/lowering/linear.py `_precast_einsum` (a block linear whose weight gradient the train step sums
    inside its GEMM) against autodiff of einsum(x, w in bf16): the output and dx bit for bit, and
    the fp32 parameter's gradient within 1e-6 of the exact fp32 sum of the bf16 products, which
    autodiff first rounds to bf16 (4e-3 relative here, and worse on XLA:CPU's bf16 dots)."""
    from jaxgpt.lowering.linear import _precast_einsum
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], x_shape).astype(jnp.bfloat16)
    w = 0.1 * jax.random.normal(k[1], w_shape)
    out = spec.split("->")[1]
    dy = jax.random.normal(k[2], jax.eval_shape(lambda: jnp.einsum(spec, x, w.astype(jnp.bfloat16))).shape)
    dy = dy.astype(jnp.bfloat16)

    @jax.jit
    def run(x, w, dy):
        ours = jax.vjp(lambda x, w: _precast_einsum(spec, jnp.float32, True, None, x, w, w.astype(jnp.bfloat16)), x, w)
        ref = jax.vjp(lambda x, w: jnp.einsum(spec, x, w.astype(jnp.bfloat16)), x, w)
        a, b = spec.split("->")[0].split(",")
        exact = jnp.einsum(f"{a},{out}->{b}", x.astype(jnp.float32), dy.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
        return ours[0], ours[1](dy), ref[0], ref[1](dy), exact

    y, (dx, dw), y_ref, (dx_ref, dw_ref), exact = run(x, w, dy)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32))
    assert dw.dtype == dw_ref.dtype == jnp.float32
    scale = float(jnp.abs(exact).max())
    np.testing.assert_allclose(dw, exact, rtol=0, atol=1e-6 * scale)
    assert float(jnp.abs(dw_ref - exact).max()) > 1e-4 * scale  # what the fp32 gradient is for


@pytest.mark.parametrize("fp32_grad", [False, True], ids=["bf16_dw", "fp32_dw"])
def test_qkv_as_three_gemms_with_the_bias_in_their_epilogue_matches_the_fused_projection(fp32_grad):
    """jaxgpt/lowering/linear.py `_precast_einsum` with parts (trick qkv_gemms: attention's q, k
    and v as a GEMM each on its
    slice of c_attn [D, 3, H, K]) and their biases (added to the fp32 dot, then rounded once) against
    autodiff of the one fused GEMM plus the bias in bf16 (GPT-2's qkv before issue 40's split).
    Against the exact fp32 values: q, k and v within bf16's half ulp (one rounding, where the fused
    GEMM rounded twice); dx within 3 ulps (three GEMMs' bf16 sums); the weight gradient as
    autodiff's, or the exact fp32 sum (fp32_grad); the bias gradient the exact fp32 sum (autodiff
    summed in bf16). All gradients arrive in the parameters' own layouts."""
    from jaxgpt.lowering.linear import _precast_einsum
    k = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(k[0], (2, 16, 48)).astype(jnp.bfloat16)
    w = 0.1 * jax.random.normal(k[1], (48, 3, 4, 8))
    b = 0.5 * jax.random.normal(k[2], (3, 4, 8))
    dy = tuple(jax.random.normal(key, (2, 16, 4, 8)).astype(jnp.bfloat16) for key in jax.random.split(k[3], 3))
    hi = jax.lax.Precision.HIGHEST

    @jax.jit
    def run(x, w, b, dy):
        ours = jax.vjp(lambda x, w, b: _precast_einsum("btd,dhk->bthk", jnp.float32, fp32_grad, 1, x, w,
                                                       w.astype(jnp.bfloat16), tuple(b)), x, w, b)
        ref = jax.vjp(lambda x, w, b: jnp.einsum("btd,dshk->btshk", x, w.astype(jnp.bfloat16)) + b.astype(jnp.bfloat16),
                      x, w, b)
        dy_BT3HK = jnp.stack(dy, axis=2)
        x32, w32, dy32 = x.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32), dy_BT3HK.astype(jnp.float32)
        exact = (jnp.einsum("btd,dshk->btshk", x32, w32, precision=hi) + b,
                 jnp.einsum("btshk,dshk->btd", dy32, w32, precision=hi),
                 jnp.einsum("btd,btshk->dshk", x32, dy32, precision=hi), dy32.sum((0, 1)))
        return ours[0], ours[1](dy), ref[0], ref[1](dy_BT3HK), exact

    ys, (dx, dw, db), y_ref, (_, dw_ref, _), (y_exact, dx_exact, dw_exact, db_exact) = run(x, w, b, dy)
    # q's bias alone (attention's k and v GEMMs add none: trick qkv_bias_drop): the same bias gradient
    q_only = jax.jit(lambda x, w, b, dy: jax.vjp(lambda x, w, b: _precast_einsum(
        "btd,dhk->bthk", jnp.float32, fp32_grad, 1, x, w, w.astype(jnp.bfloat16), (b, None, None)), x, w,
        b)[1](dy))
    np.testing.assert_array_equal(q_only(x, w, b[0], dy)[2], db[0])

    def ulp(a):  # bf16's spacing at |a|
        return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(a), 1e-30))) - 7)

    for i, y in enumerate(ys):
        assert y.shape == y_ref[:, :, i].shape and y.dtype == jnp.bfloat16
        exact_i = np.asarray(y_exact[:, :, i])
        assert np.all(np.abs(np.asarray(y, np.float32) - exact_i) <= 0.5 * ulp(exact_i) + 1e-7)
    np.testing.assert_allclose(np.asarray(dx, np.float32), dx_exact, rtol=0, atol=3 * float(ulp(np.abs(dx_exact).max())))
    db = jnp.stack(db)
    assert dw.shape == w.shape and dw.dtype == jnp.float32 and db.shape == b.shape and db.dtype == jnp.float32
    scale = float(jnp.abs(dw_exact).max())
    if fp32_grad:
        np.testing.assert_allclose(dw, dw_exact, rtol=0, atol=1e-6 * scale)
    else:
        np.testing.assert_array_equal(dw, dw_ref)
    np.testing.assert_allclose(db, db_exact, rtol=0, atol=1e-6 * float(jnp.abs(db_exact).max()))

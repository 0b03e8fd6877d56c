"""Properties of the model itself: causality, the vocabulary padding, GPT-2's size and init."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import GPT2_VOCAB, lowering, tiny_config

from jaxgpt.config import load_config
from jaxgpt.lowering.loss import chunk_positions, chunked_cross_entropy
from jaxgpt.model import GPT, param_count
from jaxgpt.step import loss_fn


def _model(cfg, ops: str | None = None):
    """cfg's model, computing in the reference forms, or (ops) through a one-device lowering."""
    return GPT(cfg.model, nnx.Rngs(0), None if ops is None else lowering(cfg.model, ops))


def test_causality_through_gradients():
    """d loss(t) / d wpe[s] is zero for every s > t: position s only reaches later positions."""
    cfg = tiny_config()
    model = _model(cfg)
    graphdef, params = nnx.split(model)
    tokens_BT = jax.random.randint(jax.random.key(1), (2, cfg.model.seq_len), 0, cfg.model.vocab_size)
    T = cfg.model.seq_len

    def loss_at_t(params, t):
        logits_BTV = nnx.merge(graphdef, params)(tokens_BT)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BTV[:, t], tokens_BT[:, t + 1]).mean()

    grad_wpe = jax.jit(lambda params, t: jax.grad(loss_at_t)(params, t)["wpe"][...])  # one compile for every t
    for t in (0, 7, T - 2):
        g_wpe_TD = grad_wpe(params, t)
        norms_T = np.linalg.norm(np.asarray(g_wpe_TD), axis=-1)
        assert np.all(norms_T[t + 1:] == 0), f"position {t} depends on later positions"
        assert np.all(norms_T[: t + 1] > 0), f"position {t} ignores earlier positions"


def test_vocab_padding_gets_no_probability_and_no_gradient():
    cfg = tiny_config()
    model = _model(cfg)
    V, Vp = cfg.model.vocab_size, cfg.model.padded_vocab
    assert Vp % 128 == 0 and Vp - 128 < V <= Vp
    tokens_BT = jnp.arange(2 * 16).reshape(2, 16)
    graphdef, params = nnx.split(model)
    # jitted, as a run computes them: one compile, not one per operation
    probs_BTV = jax.jit(lambda params: jax.nn.softmax(nnx.merge(graphdef, params)(tokens_BT), axis=-1))(params)
    assert float(probs_BTV[..., V:].max()) == 0.0
    np.testing.assert_allclose(np.asarray(probs_BTV[..., :V].sum(-1)), 1.0, rtol=1e-5)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens_BT[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT[:, 1:]).mean()

    g_wte_VD = jax.jit(jax.grad(loss))(params)["wte"][...]
    assert float(jnp.abs(g_wte_VD[V:]).max()) == 0.0  # padding rows never learn


def test_gpt2_small_has_gpt2_parameter_count():
    """GPT-2 small is 124,439,808 parameters with 50,257 tokens; padding adds 47 rows of 768."""
    cfg = load_config("gpt2-124m")
    model = nnx.eval_shape(lambda: GPT(cfg.model, nnx.Rngs(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == param_count(cfg.model) == 124_439_808 + 47 * 768


def test_gpt2_initialisation():
    cfg = tiny_config("model.n_layer=4", "model.n_embd=128")
    p = nnx.state(_model(cfg), nnx.Param)
    std = lambda x: float(jnp.std(x[...]))  # noqa: E731
    assert abs(std(p["wte"]) - 0.02) < 0.001
    assert abs(std(p["blocks"]["mlp"]["c_fc_kernel"]) - 0.02) < 0.001
    residual = 0.02 / np.sqrt(2 * 4)
    assert abs(std(p["blocks"]["mlp"]["c_proj_kernel"]) - residual) < 0.1 * residual
    assert abs(std(p["blocks"]["attn"]["c_proj_kernel"]) - residual) < 0.1 * residual
    assert float(jnp.abs(p["blocks"]["attn"]["c_attn_bias"][...]).max()) == 0.0
    assert float(jnp.abs(p["ln_f"]["scale"][...] - 1).max()) == 0.0
    # the layers are initialised independently, not copies of one another
    w = np.asarray(p["blocks"]["mlp"]["c_fc_kernel"][...])
    assert not np.allclose(w[0], w[1])


def test_bf16_compute_stays_close_to_fp32():
    """Parameters stay fp32; bf16 compute changes the initial loss only by bf16 rounding."""
    cfg = tiny_config()
    model = _model(cfg)
    tokens_BT = jax.random.randint(jax.random.key(2), (2, 33), 0, cfg.model.vocab_size)

    def loss(dtype):
        logits = model(tokens_BT[:, :-1], dtype)
        assert logits.dtype == jnp.float32
        return float(optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT[:, 1:]).mean())

    assert abs(loss(jnp.bfloat16) - loss(jnp.float32)) < 0.02


@pytest.mark.parametrize("chunk, ops", [(1, "tuned"), (8, "tuned"), (32, "tuned"), (8, "reference")])
def test_chunked_loss_equals_whole_logits_autodiff(chunk, ops):
    """The loss over chunks of `chunk` positions, fused (jaxgpt/lowering/loss.py: the gradients in
    the forward pass) or the reference form (jaxgpt/model/ops.py: each chunk recomputed), gives the
    loss and every gradient of optax's cross-entropy on the whole logits, differentiated by JAX;
    the padding rows of the tied embedding get no gradient there either. fp32: only the order of
    sums differs (a loss of ~7.1, gradients of ~1e-2), so 1e-6 absolute."""
    cfg = tiny_config(f"model.loss_chunk={chunk}")
    graphdef, params = nnx.split(_model(cfg, ops), nnx.Param)
    params = nnx.to_pure_dict(params)
    batch_BT1 = jax.random.randint(jax.random.key(1), (4, cfg.model.seq_len + 1), 0, cfg.model.vocab_size)

    def reference(params):
        logits_BTV = nnx.merge(graphdef, params)(batch_BT1[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch_BT1[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params, graphdef, batch_BT1, cfg.model, jnp.float32)
    ref_loss, ref_grads = jax.value_and_grad(reference)(params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=0, atol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=1e-6, err_msg=str(path))
    assert float(jnp.abs(grads["wte"][cfg.model.vocab_size:]).max()) == 0.0
    # without differentiation (evaluation) the primal gives the same loss
    np.testing.assert_allclose(float(loss_fn(params, graphdef, batch_BT1, cfg.model, jnp.float32)), float(ref_loss),
                               rtol=0, atol=1e-6)


def test_fused_loss_in_bf16_is_cross_entropy_of_the_bf16_logits():
    """In bf16 (the GPU default) the head's logits are rounded to bf16, as nanoGPT's head under
    autocast, llm.c's and nanochat's write them, and the loss is fp32 cross-entropy of those
    rounded logits (the label's logit rounded alike). Against that reference the loss agrees to
    fp32's last bit at 16.6 (1.9e-6 measured); against the unrounded fp32 logits it moves by 7e-4,
    so rounding in the wrong place fails. The gradients carry e = exp(logits - max) rounded to bf16
    into their GEMMs: within bf16's unit roundoff in norm."""
    cfg = tiny_config("model.n_embd=128", "model.seq_len=64", "model.loss_chunk=16", *GPT2_VOCAB).model
    ops = lowering(cfg, "tuned")
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (4, 64, 128), jnp.float32)
    wte = jax.random.normal(keys[1], (50304, 128), jnp.float32) * 0.3  # logits' std ~3.3
    labels = jax.random.randint(keys[2], (4, 64), 0, cfg.vocab_size)

    def reference(x, wte):
        logits = jnp.einsum("btd,vd->btv", x.astype(jnp.bfloat16), wte.astype(jnp.bfloat16),
                            preferred_element_type=jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits[..., :cfg.vocab_size], labels).mean()

    ours = jax.value_and_grad(lambda x, w: chunked_cross_entropy(x, w, labels, ops, jnp.bfloat16), argnums=(0, 1))
    (loss, grads), (ref_loss, ref_grads) = (jax.jit(f)(x, wte) for f in (ours, jax.value_and_grad(reference, (0, 1))))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=0, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 2.0 ** -8


@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layers_equal_scanned(remat):
    """model.scan_layers=false (the blocks' loop unrolled, parameters still stacked) computes the
    same loss and gradients as the scanned loop: the same ops in the same order, only XLA's
    buffers differ, so 1e-6 absolute in fp32."""
    results = []
    for scan in ("true", "false"):
        cfg = tiny_config(f"model.scan_layers={scan}", f"model.remat={remat}")
        graphdef, params = nnx.split(_model(cfg), nnx.Param)
        params = nnx.to_pure_dict(params)
        batch_BT1 = jax.random.randint(jax.random.key(3), (4, cfg.model.seq_len + 1), 0, cfg.model.vocab_size)
        results.append(jax.jit(jax.value_and_grad(loss_fn), static_argnums=(1, 3, 4))(
            params, graphdef, batch_BT1, cfg.model, jnp.float32))
    (loss_scan, g_scan), (loss_unrolled, g_unrolled) = results
    np.testing.assert_allclose(float(loss_unrolled), float(loss_scan), rtol=0, atol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_unrolled)[0], jax.tree.leaves(g_scan)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6, err_msg=str(path))


def test_auto_loss_chunk_bounds_rows_per_device():
    """model.loss_chunk=0: the largest divisor of seq_len within the CPU's max(256, n_embd) rows per device."""
    def chunk(m, rows, T=None):
        return chunk_positions(m, rows, T or m.seq_len, "cpu")

    m = load_config(None, ["model.seq_len=128"]).model
    assert chunk(m, 16) == 16       # the default run on one device
    assert chunk(m, 4) == 64        # dp=4
    assert chunk(m, 2) == 128       # dp=8: one chunk
    assert chunk(m, 1000) == 1
    assert chunk(load_config(None, ["model.seq_len=96"]).model, 16) == 16
    assert chunk(load_config(None, ["model.seq_len=96"]).model, 5) == 48
    wide = load_config(None, ["model.n_embd=768", "model.n_head=12", "model.seq_len=1024"]).model
    assert chunk(wide, 1) == 512     # gpt2-124m, 1 x 1024: 768 rows -> 512
    assert chunk(wide, 8) == 64
    assert chunk(load_config(None, ["model.seq_len=96", "model.loss_chunk=48"]).model, 16) == 48
    assert chunk_positions(m, 16, 128, "gpu") == 128  # 8192 rows on a GPU

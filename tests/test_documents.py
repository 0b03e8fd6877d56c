"""Document masking (model.document_mask, jaxgpt/model/documents.py): no token sees another
document, a packed window scores each document as if it ran alone, and every place the model
runs (training, val loss and bits per byte, the task scorer, KV-cached sampling, pipeline and
sharded layouts) masks the same way. fp32 on the 8 fake CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TINY_DOCUMENTS, TINY_EOT, TINY_VOCAB, packed_batch, step_metrics, tiny_config

from jaxgpt.config import validate
from jaxgpt.errors import UserError
from jaxgpt.evaluate.score import Scorer
from jaxgpt.model import GPT
from jaxgpt.lowering.attention import packed_segments
from jaxgpt.model.documents import documents, window_stats
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.sample import generate, shard_params
from jaxgpt.step import init_state, loss_fn, make_eval_step, make_setup

MASK = tuple(TINY_DOCUMENTS)
ROPE = (*MASK, "model.position=rope", "model.position_reset=true")
LENGTHS = [9, 12, 11]  # three documents, each after the first begun by <|endoftext|>, in a T = 32 window


def _window(seed: int = 0, lengths=LENGTHS) -> np.ndarray:
    """[1, sum(lengths)] tokens: documents of these lengths, each but the first led by <|endoftext|>."""
    tokens = np.random.default_rng(seed).integers(0, TINY_EOT, sum(lengths)).astype(np.int32)
    for start in np.cumsum(lengths)[:-1]:
        tokens[start] = TINY_EOT
    return tokens[None]


def _model(*overrides: str, seed: int = 0):
    """(graphdef, params, jitted logits(tokens)) of a tiny fp32 model with weights far from init
    (normal(0, 0.3) added), so attention is peaked."""
    model = GPT(tiny_config(*overrides).model, nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    leaves, tree = jax.tree.flatten(nnx.to_pure_dict(params))
    keys = jax.random.split(jax.random.key(seed + 7), len(leaves))
    params = jax.tree.unflatten(tree, [p + 0.3 * jax.random.normal(k, p.shape)
                                       for p, k in zip(leaves, keys, strict=True)])
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    return graphdef, params, lambda tokens: forward(params, jnp.asarray(tokens))


def test_documents_start_at_the_separator_and_pack_for_cudnn():
    tokens = jnp.asarray(_window())
    docs = documents(tokens, separator=TINY_EOT)
    want = np.repeat([0, 9, 21], LENGTHS)
    np.testing.assert_array_equal(docs.start_BT[0], want)
    np.testing.assert_array_equal(docs.position_BT[0], np.arange(32) - want)
    lengths, offsets = packed_segments(docs.start_BT, 4)
    np.testing.assert_array_equal(lengths[0], [9, 12, 11, -1])
    np.testing.assert_array_equal(offsets[0], [0, 9, 21, -1, -1])
    lengths, offsets = packed_segments(docs.start_BT, 2)  # more documents than slots: the last ones as one
    np.testing.assert_array_equal(lengths[0], [9, 23])
    stats = jax.device_get(window_stats(tokens, separator=TINY_EOT))
    assert stats["docs_per_window"] == 3
    hidden = sum(int(s) for s in want)  # query t loses keys 0 .. start[t] - 1
    assert stats["masked_pairs"] == pytest.approx(hidden / (32 * 33 / 2))


@pytest.mark.parametrize("overrides", [MASK, ROPE], ids=["learned", "rope_reset"])
def test_no_gradient_reaches_another_documents_tokens(overrides):
    """The loss at a token of the middle document, differentiated w.r.t. every input embedding: exactly
    0 at the other documents' tokens (masked scores get probability exactly 0, so their gradient is
    exactly 0, not small), and non-zero at every earlier token of its own."""
    graphdef, params, _ = _model(*overrides)
    tokens = jnp.asarray(_window())
    t, label = 17, 123  # inside document 2 (positions 9..20)

    def loss_at_t(x_BTD, params):
        model = nnx.merge(graphdef, params)
        logits = model._logits(model.run_blocks(x_BTD, model.documents(tokens))[0], jnp.float32)
        return -jax.nn.log_softmax(logits[0, t])[label]

    embed = jax.jit(lambda p: nnx.merge(graphdef, p).embed(tokens, jnp.float32))
    grad_TD = jax.jit(jax.grad(loss_at_t))(embed(params), params)[0]
    per_token = np.abs(np.asarray(grad_TD)).max(axis=-1)
    others = np.r_[0:9, 21:32]
    assert (per_token[others] == 0).all(), per_token[others]
    assert (per_token[9:t + 1] > 0).all()


def test_a_packed_window_scores_each_document_as_if_alone():
    """Rotary positions restarting at each document: each document's per-token nats inside the packed
    window equal its nats run as a window of its own. Masked keys add exact zeros, so the two differ
    only in the order of fp32 sums over 32 vs <= 12 keys and positions: a few ulps of the ~7 nats
    per layer and in the head's logsumexp over 1,159 logits; measured exactly 0 on XLA:CPU (3 windows), and
    2e-5, a few ulps of the ~12 nats, allows another backend's summation order."""
    model = _model(*ROPE)[2]
    tokens = _window(1)
    logp = jax.nn.log_softmax(model(tokens)[..., :TINY_VOCAB], axis=-1)
    start = 0
    for n in LENGTHS:
        piece = tokens[:, start:start + n]
        alone = jax.nn.log_softmax(model(_pad(piece))[..., :TINY_VOCAB], axis=-1)
        np.testing.assert_allclose(logp[0, start:start + n - 1][np.arange(n - 1), piece[0, 1:]],
                                   alone[0, :n - 1][np.arange(n - 1), piece[0, 1:]], rtol=0, atol=2e-5)
        start += n
    # without document masking the later documents do see the earlier ones
    unmasked = _model("model.position=rope")[2]
    assert not np.allclose(unmasked(tokens)[0, 9:20, :TINY_VOCAB], unmasked(tokens[:, 9:21])[0, :11, :TINY_VOCAB], atol=1e-3)


def _pad(tokens_BT: np.ndarray, T: int = 32) -> np.ndarray:
    """Right-padded to T (one compiled forward for every length): a causal model never sees the padding."""
    return np.pad(tokens_BT, ((0, 0), (0, T - tokens_BT.shape[1])))


def test_val_loss_and_bits_per_byte_agree_with_the_training_forward():
    cfg = tiny_config(*ROPE)
    batch = packed_batch()
    mesh = make_mesh(validate(cfg, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        params = init_state(cfg, setup).params
        val = jax.device_get(make_eval_step(cfg, mesh, setup)(params, batch))
        train_loss = float(jax.jit(loss_fn, static_argnums=(1, 3, 4))(params, setup.graphdef, batch, cfg.model,
                                                                        jnp.float32))
        logits = nnx.merge(setup.graphdef, params)(jnp.asarray(batch[:, :-1]))
    nats = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, axis=-1)), batch[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(val["loss"], train_loss, rtol=1e-6)
    np.testing.assert_allclose(val["loss"], nats.mean(), rtol=1e-6)
    np.testing.assert_allclose(val["text_nats"], nats[batch[:, 1:] != TINY_EOT].sum(), rtol=1e-6)


def test_task_scorer_and_cached_sampling_mask_as_the_forward_does():
    cfg = tiny_config(*ROPE)
    graphdef, params, model = _model(*ROPE)
    # the scorer on a dp x fsdp x tp mesh: sequences with a document boundary inside
    rng = np.random.default_rng(3)
    sequences = [rng.integers(0, TINY_EOT, n).astype(np.int32) for n in (20, 33, 9, 27)]
    for seq in sequences:
        seq[len(seq) // 3] = TINY_EOT
    sharded, mesh = shard_params(params, cfg, "dp=2,fsdp=2,tp=2")
    got = Scorer(graphdef, cfg.model, mesh, batch_rows=4).loglik(sharded, sequences, [4, 6, 2, 5])
    for seq, n, score in zip(sequences, [4, 6, 2, 5], got, strict=True):
        logp = np.asarray(jax.nn.log_softmax(model(_pad(seq[None, :-1]))[0], axis=-1), np.float64)
        np.testing.assert_allclose(score, sum(logp[t, seq[t + 1]] for t in range(len(seq) - 1 - n, len(seq) - 1)),
                                   rtol=2e-6)
    # KV-cached sampling from a prompt holding a boundary, then generating across one
    prompt = np.asarray([[11, 22, TINY_EOT, 33, 44], [TINY_EOT, 5, 6, 7, 8]], np.int32)
    cached = np.stack(list(generate(graphdef, params, cfg, prompt, 12, temperature=0)), axis=1)
    seq = prompt
    for _ in range(12):
        last = np.asarray(jnp.argmax(model(_pad(seq))[:, seq.shape[1] - 1], -1))
        seq = np.concatenate([seq, last[:, None]], axis=1)
    np.testing.assert_array_equal(cached, seq[:, 5:])


# fp32 as in test_parallel.py: layouts reorder fp32 sums only, ~1e-6 per step on a loss of ~10.8 (~7.1 here).
LOSS_ATOL = 1e-4


def _steps(layout: str, devices, *overrides: str) -> list[dict]:
    return step_metrics(tiny_config(*ROPE, "model.n_layer=4", *overrides, mesh=layout), devices)


@pytest.fixture(scope="module")
def one_device_steps():
    return _steps("dp=1", jax.devices()[:1])


@pytest.mark.parametrize("layout, overrides", [("dp=2,fsdp=2,tp=2", ()),
                                               ("pp=2,dp=4", ("pipeline.repeats=2", "train.grad_accum=2"))])
def test_sharded_and_pipelined_layouts_mask_as_one_device(layout, overrides, one_device_steps):
    steps = _steps(layout, jax.devices(), *overrides)
    for key in ("loss", "docs_per_window", "masked_pairs"):
        np.testing.assert_allclose([s[key] for s in steps], [s[key] for s in one_device_steps], rtol=0,
                                   atol=LOSS_ATOL if key == "loss" else 1e-6, err_msg=key)
    assert one_device_steps[0]["docs_per_window"] > 2 and 0.3 < one_device_steps[0]["masked_pairs"] < 1


@pytest.mark.parametrize("overrides, message", [
    (("model.position_reset=true", "model.position=rope"), "needs model.document_mask=true"),
    ((*MASK, "model.position_reset=true"), "model.position=rope"),
    ((*MASK, "model.max_documents=1"), "model.max_documents must be >= 2"),
])
def test_impossible_combinations_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        validate(tiny_config(*overrides), 8)

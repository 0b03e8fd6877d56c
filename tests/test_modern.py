"""The modern decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention, QK-norm, no biases, soft-capped
logits) and Muon: every layout trains to the one-device losses, Muon resumes bit for bit, RoPE is
right in the KV cache, and impossible combinations are one line before compiling. 8 fake CPU devices."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import lowering, tiny_config, train_losses
from test_parallel import LOSS_ATOL

from jaxgpt.config import ModelConfig, load_config, validate
from jaxgpt.errors import UserError
from jaxgpt.model import GPT, param_count
from jaxgpt.model.positions import rope
from jaxgpt.sample import generate
from jaxgpt.step import abstract_model
from jaxgpt.train import train

# Every new choice at once, Muon and the untied head included; n_head=4 over n_kv_head=2 so tp=2
# splits whole groups.
MODERN = ["model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.mlp_hidden=64",
          "model.n_kv_head=2", "model.qk_norm=true", "model.bias=false", "model.logit_softcap=15",
          "model.tie_embeddings=false", "optimizer.name=muon"]
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=4.0",  # no drops: exact parity
       "model.moe_every=2"]


def _modern(*overrides: str, mesh: str):
    # AdamW's lr (the table and head) 3x the default: with the tiny vocabulary the loss falls 0.06 in
    # 5 steps, not 0.03, so "the model should be learning" below has something to see
    return tiny_config("train.steps=5", *MODERN, "optimizer.lr=3e-3", *overrides, mesh=mesh)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, shakespeare_dir):
    """(run dir, final state) of the modern model with Muon on one device, checkpoints at steps 2, 4, 5."""
    run_dir = tmp_path_factory.mktemp("modern-single")
    state = train(_modern("checkpoint.every=2", mesh="dp=1"), run_dir, devices=jax.devices()[:1])
    return run_dir, state


# Two runs cover the axes (each costs a compile, so no more): a pipeline with fsdp and tp inside its
# stages (the dense model), and fsdp x ep x tp with SwiGLU experts (one dense and one MoE block).
# (dp=2,fsdp=2,tp=2 with configs/llama-tiny.yaml: docs/benchmarks.md, run by hand.)
def test_pipeline_with_fsdp_and_tp_matches_one_device(one_device, tmp_path):
    """pp=2 x fsdp=2 x tp=2 trains the modern model with Muon to the one-device losses (fp32,
    LOSS_ATOL as for GPT-2): Muon orthogonalises the sharded momentum as XLA partitions it, so its
    result does not depend on the layout either."""
    single = train_losses(one_device[0])
    train(_modern(mesh="pp=2,fsdp=2,tp=2"), tmp_path)
    assert single[-1] < single[0] - 0.05, "the model should be learning"
    np.testing.assert_allclose(train_losses(tmp_path), single, rtol=0, atol=LOSS_ATOL)


def test_swiglu_experts_under_fsdp_ep_tp_match_one_device(tmp_path_factory, shakespeare_dir):
    """MoE experts as gated MLPs (three matmuls each), split over ep, their F over tp and D over fsdp;
    Muon on every expert's matrices (the expert axis is a batch axis of the orthogonalisation)."""
    single, split = (tmp_path_factory.mktemp(name) for name in ("moe-single", "moe-split"))
    train(_modern(*MOE, mesh="dp=1"), single, devices=jax.devices()[:1])
    train(_modern(*MOE, mesh="fsdp=2,ep=2,tp=2"), split)
    np.testing.assert_allclose(train_losses(split), train_losses(single), rtol=0, atol=LOSS_ATOL)


def test_muon_resumes_bit_for_bit(one_device, tmp_path):
    """Drop the checkpoints of steps 4 and 5: the run resumes from step 2 (Muon's momentum restored
    with the rest) and ends with the same losses and parameters, bit for bit."""
    run_dir, reference = one_device
    shutil.copytree(run_dir, tmp_path / "run")
    for step in ("4", "5"):
        shutil.rmtree(tmp_path / "run" / "checkpoints" / step)
    state = train(_modern("checkpoint.every=2", mesh="dp=1"), tmp_path / "run", devices=jax.devices()[:1])
    assert train_losses(tmp_path / "run") == train_losses(run_dir)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    from jaxgpt.optim import muon_labels
    _, params = abstract_model(tiny_config(*MODERN, *MOE))
    labels = {"/".join(map(str, path)): label for path, label in
              jax.tree_util.tree_flatten_with_path(muon_labels(nnx.to_pure_dict(params)))[0]
              for path in [tuple(getattr(k, "key", k) for k in path)]}
    muon = {name for name, label in labels.items() if label == "muon"}
    assert muon == {f"groups/{block}/{m}" for block in ("dense", "moe")
                    for m in ("attn/q_kernel", "attn/kv_kernel", "attn/c_proj_kernel",
                              "mlp/c_fc_kernel", "mlp/c_gate_kernel", "mlp/c_proj_kernel")}
    assert labels["groups/moe/mlp/router_kernel"] == labels["wte"] == "adamw"


def test_rope_depends_only_on_the_distance():
    """<rope(q, i), rope(k, j)> is a function of i - j: shifting both positions changes nothing."""
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 6, 2, 8))
    scores = lambda start: jnp.einsum("bthk,bshk->bhts", rope(q, start, 10000.0), rope(k, start, 10000.0))  # noqa: E731
    np.testing.assert_allclose(scores(0), scores(37), atol=1e-4)
    assert not np.allclose(scores(0)[..., 0, 1], jnp.einsum("bhk,bhk->bh", q[:, 0], k[:, 1]), atol=1e-3)


def _model(cfg: ModelConfig, noise: float = 0.0):
    """(graphdef, params) built under jit (eager init dispatches every small op on its own); with
    `noise`, weights far from init so that greedy argmaxes are not near-ties."""
    graphdef = nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))[0]

    def init():
        params = nnx.to_pure_dict(nnx.split(GPT(cfg, nnx.Rngs(0)))[1])
        keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(params))))
        return jax.tree.map(lambda p: p + noise * jax.random.normal(next(keys), p.shape), params)

    return graphdef, jax.jit(init)()


def test_cached_decoding_with_rope_and_grouped_kv_matches_recomputation():
    """Prefill of a 5-token prompt, then 11 one-token decode steps through the [L, B, S, G, K] cache
    (multi-query: G=1): each greedy token is the argmax of the full, uncached forward pass over the
    sequence so far, so RoPE gave the cached keys and the new queries their right positions."""
    cfg = tiny_config(*MODERN, "model.n_kv_head=1")
    graphdef, params = _model(cfg.model, noise=0.3)
    prompt_BT = np.asarray(jax.random.randint(jax.random.key(1), (2, 5), 0, cfg.model.vocab_size), np.int32)
    cached = np.stack(list(generate(graphdef, params, cfg, prompt_BT, 12, temperature=0)), axis=1)
    full_BTV = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, np.concatenate([prompt_BT, cached], 1))
    np.testing.assert_array_equal(cached, np.asarray(jnp.argmax(full_BTV[:, 4:-1], -1)))


@pytest.mark.parametrize("ops", ["tuned", "reference"])
def test_untied_soft_capped_head_in_the_chunked_loss_matches_autodiff(ops):
    """The chunked loss with lm_head and logit_softcap, fused or the reference form: its value and
    gradients equal plain cross-entropy on the model's own (capped) logits, differentiated by JAX."""
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8, vocab_size=200, tie_embeddings=False,
                      logit_softcap=3.0, loss_chunk=4, dtype="float32", ops=ops)
    graphdef, params = _model(cfg)
    lowered = nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0), lowering(cfg))))[0]
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 200)

    def fused(p):
        model = nnx.merge(lowered, p)
        return model.loss(model(tokens[:, :-1], features_only=True), tokens[:, 1:], jnp.float32)

    def plain(p):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])[..., :200]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    (a, ga), (b, gb) = (jax.jit(jax.value_and_grad(f))(params) for f in (fused, plain))
    np.testing.assert_allclose(a, b, rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), ga, gb)
    assert float(jnp.abs(gb["lm_head"]).sum()) > 0 and "lm_head" in params


def test_defaults_are_gpt2_and_counts_match_the_tree():
    assert ModelConfig().beyond_gpt2() == []
    for overrides in ([], MODERN, [*MODERN, *MOE, "model.n_kv_head=1", "model.norm_scale=false"]):
        cfg = tiny_config(*overrides)
        _, params = abstract_model(cfg)
        assert param_count(cfg.model) == sum(p.size for p in jax.tree.leaves(params)), overrides


@pytest.mark.parametrize("overrides, mesh, message", [
    (["model.n_kv_head=3"], "dp=1", "model.n_kv_head=3 must divide model.n_head=4"),
    (["model.n_kv_head=2"], "dp=2,tp=4", "model.n_kv_head=2 is not divisible by the tp axis (4)"),
    (["model.n_head=8", "model.n_embd=24", "model.position=rope"], "dp=1", "the head dim (model.head_size, or n_embd / n_head) = 3 is odd"),
    (["model.mlp_hidden=101"], "dp=4,tp=2", "the MLP width (101)"),
])
def test_impossible_combinations_are_one_line(overrides, mesh, message):
    cfg = load_config(None, ["model.n_layer=2", "model.n_head=4", "model.n_embd=32", *overrides], mesh)
    with pytest.raises(UserError, match=None) as e:
        validate(cfg, 1 if mesh == "dp=1" else 8)
    assert message in str(e.value) and "\n" not in str(e.value)

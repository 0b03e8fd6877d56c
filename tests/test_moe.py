"""Mixture of Experts (jaxgpt/model/moe.py) and the ep mesh axis: layouts train the same model, routing
and its losses match a NumPy reference, experts are split over ep, the step holds all-to-alls,
checkpoints move between ep layouts, sampling works and HF export refuses a GPT-2-shaped MoE model (Mixtral holds
Llama-shaped ones: tests/test_hf.py). 8 fake CPU devices, fp32."""

from __future__ import annotations

import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TINY, layer_loops, main_in_process, read_metrics, restore_run, tiny_config, train_losses
from test_parallel import LOSS_ATOL

from jaxgpt import data, tokenizer
from jaxgpt.config import load_config, validate
from jaxgpt.errors import UserError
from jaxgpt.hlo import collectives
from jaxgpt.model import GPT, param_count
from jaxgpt.model.moe import capacity, route
from jaxgpt.parallel.mesh import make_mesh, named
from jaxgpt.plan import expert_bytes
from jaxgpt.sample import generate
from jaxgpt.step import abstract_model, init_state, make_setup, make_train_step
from jaxgpt.train import train

E, K = 8, 2
# capacity factor E/K makes C = S: no assignment can be dropped, so every layout routes alike
MOE = [f"model.moe_experts={E}", f"model.moe_top_k={K}", f"model.moe_capacity_factor={E / K}"]
EXPERT_LEAVES = ("c_fc_kernel", "c_fc_bias", "c_proj_kernel", "c_proj_bias")


def _devices(layout: str):
    n = math.prod(int(part.split("=")[1]) for part in layout.split(","))
    return jax.devices()[:n]


@pytest.fixture(scope="module")
def batches(shakespeare_dir):
    """The first 5 batches train() feeds the tiny config (same data, seed and order)."""
    cfg = tiny_config()
    tokens = data.open_splits(cfg.data.path, cfg.data.mix, tok=tokenizer.load(cfg.data.tokenizer))[0]
    it = data.train_iterator(tokens, seq_len=cfg.model.seq_len, global_batch=cfg.train.batch_size,
                             seed=cfg.train.seed, process_index=0, process_count=1)
    return [next(it) for _ in range(5)]


def _step_losses(layout: str, batches, *overrides: str) -> list[float]:
    """5 train steps on `layout`, called directly (no loop, logging or checkpoints: faster)."""
    cfg = tiny_config("train.steps=5", *MOE, *overrides, mesh=layout)
    devices = _devices(layout)
    mesh = make_mesh(validate(cfg, len(devices)), devices)
    losses = []
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        state, step = init_state(cfg, setup), make_train_step(cfg, mesh, setup)
        for batch in batches:
            state, metrics = step(state, jax.device_put(batch, named(mesh, ("batch", None))))
            losses.append(float(metrics["loss"]))
    return losses


@pytest.fixture(scope="module")
def single_device_losses(batches):
    """One device, the reference forms (model.ops=reference, jaxgpt/model/ops.py)."""
    return _step_losses("dp=1", batches, "model.ops=reference")


# ep_run's config: also ep_state's, so both use one compiled step (tests/conftest.py)
EP_RUN = ("train.steps=5", "checkpoint.every=5", "train.grad_accum=2", *MOE)


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, shakespeare_dir):
    """dp=2 x ep=4, 5 steps of 2 micro-batches (each dp shard sums its own gradients and metrics),
    a checkpoint at the end (also the checkpoint test's source)."""
    run_dir = tmp_path_factory.mktemp("moe-dp2-ep4")
    train(tiny_config(*EP_RUN, mesh="dp=2,ep=4"), run_dir)
    return run_dir


def test_dp_ep_matches_single_device_and_logs_moe_metrics(ep_run, single_device_losses):
    assert single_device_losses[-1] < single_device_losses[0] - 0.05, "the model should be learning"
    np.testing.assert_allclose(train_losses(ep_run), single_device_losses, rtol=0, atol=LOSS_ATOL)
    rows = [r for r in read_metrics(ep_run) if "loss" in r]
    assert len(rows) == 5
    for r in rows:
        assert r["moe_dropped"] == 0.0  # capacity = the whole sequence
        assert 1.0 <= r["moe_aux_loss"] < 1.5  # 1 = perfectly balanced
        assert r["moe_z_loss"] > 0


@pytest.mark.parametrize("layout, overrides", [("ep=4", ()), ("ep=2,tp=2", ("model.remat=full",)),
                                               ("pp=2,dp=2,ep=2", ("train.grad_accum=2",))])
def test_ep_layouts_match_single_device(layout, overrides, single_device_losses, batches):
    """Routing, capacity and the MoE losses are per sequence, so splitting the batch over dp, ep,
    micro-batches or pipeline stages (each stage's share of the aux and z losses, summed over pp)
    changes only the order of sums (the LOSS_ATOL of tests/test_parallel.py)."""
    losses = _step_losses(layout, batches, *overrides)
    np.testing.assert_allclose(losses, single_device_losses, rtol=0, atol=LOSS_ATOL)


def _reference_route(logits_GSE: np.ndarray, k: int, slots: int):
    """Loops over groups, choices and tokens, in GShard's priority order."""
    G, S, E_ = logits_GSE.shape
    logits = logits_GSE.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    combine = np.zeros((G, S, E_, slots))
    dropped = aux = 0.0
    for g in range(G):
        top = np.argsort(-probs[g], axis=-1, kind="stable")[:, :k]  # [S, k]
        load = np.zeros(E_, int)
        for choice in range(k):
            for s in range(S):
                e = top[s, choice]
                if load[e] < slots:
                    combine[g, s, e, load[e]] = probs[g, s, e] / probs[g, s, top[s]].sum()
                else:
                    dropped += 1
                load[e] += 1
        aux += E_ * np.sum(load / (S * k) * probs[g].mean(0))
    lse = np.log(np.exp(logits).sum(-1))
    return combine, dropped / (G * S * k), aux / G, np.mean(lse**2)


@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0])
def test_routing_drops_and_losses_match_numpy(factor):
    G, S = 3, 32
    logits = np.asarray(jax.random.normal(jax.random.key(0), (G, S, E)) * 2, np.float32)
    slots = capacity(K, S, E, factor)
    assert slots == min(S, math.ceil(K * S * factor / E))
    dispatch, combine, stats = jax.jit(route, static_argnums=(1, 2))(jnp.asarray(logits), K, slots)
    ref_combine, ref_dropped, ref_aux, ref_z = _reference_route(logits, K, slots)
    np.testing.assert_allclose(np.asarray(combine), ref_combine, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(dispatch), (ref_combine > 0).astype(np.float32))
    assert float(stats.dropped) == pytest.approx(ref_dropped, abs=1e-7)
    assert (ref_dropped > 0.1) if factor < 1 else True
    assert (ref_dropped == 0) if factor == 4.0 else True
    np.testing.assert_allclose(float(stats.aux), ref_aux, rtol=1e-5)
    np.testing.assert_allclose(float(stats.z), ref_z, rtol=1e-5)


@pytest.fixture(scope="module")
def ep_state():
    """ep_run's config and layout: its train step, compiled once for both (tests/conftest.py)."""
    cfg = tiny_config(*EP_RUN, mesh="dp=2,ep=4")
    mesh = make_mesh(validate(cfg, 8))
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        return cfg, mesh, setup, init_state(cfg, setup)


def test_each_device_holds_one_ep_th_of_the_experts_and_their_moments(ep_state):
    _, mesh, _, state = ep_state
    experts = state.params["groups"]["moe"]["mlp"]
    adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    for name in EXPERT_LEAVES:
        for x in (experts[name], adam.mu["groups"]["moe"]["mlp"][name], adam.nu["groups"]["moe"]["mlp"][name]):
            assert x.shape[1] == E  # [layers, E, ...]
            assert x.sharding.spec[1] == "ep"
            for shard in x.addressable_shards:
                assert shard.data.shape == (x.shape[0], E // 4, *x.shape[2:]), name
                assert shard.data.size == x.size // 4
    # jaxgpt.plan's expert line: a quarter of the fp32 expert weights per device
    assert expert_bytes(state.params) == 4 * sum(experts[n].size for n in EXPERT_LEAVES) // 4
    # the router scores every expert on every device
    assert state.params["groups"]["moe"]["mlp"]["router_kernel"].sharding.is_fully_replicated


def test_step_moves_tokens_with_all_to_all(ep_state):
    """ep is manual inside the train step, so the dispatched tokens move to their experts and back
    by the two explicit all-to-alls of moe.py, inside the layer loops: 2 forward, and their 2
    transposes backward. Nothing gathers the expert weights over ep."""
    cfg, mesh, setup, state = ep_state
    batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), np.int32,
                                 sharding=named(mesh, ("batch", None)))
    with jax.set_mesh(mesh):
        hlo = make_train_step(cfg, mesh, setup).lower(state, batch).compile().as_text()
    counts = sorted(collectives(b)["all-to-all"] for b in layer_loops(hlo))
    assert counts == [2, 2], counts  # the forward and the backward layer loop
    assert all(collectives(b)["all-gather"] == 0 for b in layer_loops(hlo))


def test_checkpoint_moves_between_ep_layouts(ep_run):
    """Saved under dp=2 x ep=4, restored under ep=2 x tp=2 (4 devices): equal, and resharded."""
    layout = "ep=2,tp=2"
    restored, setup = restore_run(ep_run, tiny_config(*MOE, mesh=layout), _devices(layout))
    saved, _ = restore_run(ep_run, tiny_config(*MOE, mesh="dp=2,ep=4"))
    assert restored.step == saved.step == 5
    for a, b, sh in zip(jax.tree.leaves(restored.state), jax.tree.leaves(saved.state),
                        jax.tree.leaves(setup.shardings)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(sh, a.ndim)


def test_moe_every_groups_dense_and_moe_blocks():
    """moe_every=2 on 4 layers: 2 groups of (1 dense block, 1 MoE block); counts add up."""
    cfg = tiny_config("model.n_layer=4", "model.moe_every=2", *MOE)
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: GPT(cfg.model, nnx.Rngs(0))), nnx.Param))
    assert "blocks" not in params
    assert params["groups"]["dense"]["mlp"]["c_fc_kernel"].shape == (2, 1, 32, 128)
    assert params["groups"]["moe"]["mlp"]["c_fc_kernel"].shape == (2, E, 32, 128)
    assert sum(x.size for x in jax.tree.leaves(params)) == param_count(cfg.model)
    dense = param_count(tiny_config("model.n_layer=4").model)
    mlp = 2 * 32 * 128 + 128 + 32
    assert param_count(cfg.model) == dense + 2 * (32 * E + (E - 1) * mlp)
    assert param_count(cfg.model, active=True) == dense + 2 * (32 * E + (K - 1) * mlp)


def test_cached_sampling_matches_full_recomputation():
    """Sampling routes with no capacity limit; with C = S the full pass drops nothing either, so
    the tokens decoded one by one with the KV cache are the full pass's argmax at every position
    (one full pass over prompt + generated tokens: causal, so each position sees only its prefix)."""
    cfg = tiny_config("model.moe_every=2", *MOE)  # 2 layers: one group of a dense and an MoE block
    graphdef, shapes = abstract_model(cfg)
    rng = np.random.default_rng(7)  # random weights of scale 0.3: the argmax is not a near-tie everywhere
    params = jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), jnp.float32),
                          nnx.to_pure_dict(shapes))
    prompt_BT = np.asarray(jax.random.randint(jax.random.key(1), (2, 5), 0, cfg.model.vocab_size), np.int32)
    cached_BN = np.stack(list(generate(graphdef, params, cfg, prompt_BT, 6, temperature=0)), axis=1)
    seq_BT = np.concatenate([prompt_BT, cached_BN[:, :-1]], axis=1)
    logits_BTV = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, seq_BT)
    np.testing.assert_array_equal(cached_BN, np.asarray(jnp.argmax(logits_BTV[:, 4:], -1)))


def test_hf_export_refuses_moe_in_one_line(ep_run, tmp_path):
    proc = main_in_process("export", str(ep_run), str(tmp_path / "hf"), module="jaxgpt.hf")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Mixture-of-Experts" in proc.stderr, proc.stderr


@pytest.mark.parametrize("overrides, mesh, message", [
    (["model.moe_experts=4", "model.moe_top_k=5"], "dp=8", "model.moe_top_k=5 exceeds model.moe_experts=4"),
    (["model.moe_experts=6"], "dp=2,ep=4", r"the ep axis \(4\) does not divide model.moe_experts=6"),
    (["model.moe_experts=4", "model.moe_every=3"], "dp=8", "model.moe_every=3 does not divide model.n_layer=4"),
    (["train.batch_size=4", "model.moe_experts=8"], "dp=1,ep=8", "does not split over dp x fsdp x ep = 8"),
    (["model.moe_capacity_factor=0"], "dp=8", "model.moe_capacity_factor must be > 0"),
    (["model.moe_experts=-1"], "dp=8", "model.moe_experts must be >= 0"),
    (["model.moe_experts=4", "model.moe_dispatch=dropless", "model.fp8=true"], "dp=8",
     "model.moe_dispatch=dropless runs its experts as ragged_dot grouped GEMMs, which have no fp8 form"),
])
def test_impossible_moe_combinations(overrides, mesh, message):
    with pytest.raises(UserError, match=message):
        validate(load_config(None, overrides, mesh), 8)


def test_ep_with_a_dense_model_only_splits_the_batch():
    assert validate(load_config(None, [], "dp=2,ep=4"), 8)["ep"] == 4


@pytest.mark.parametrize("override, changed", [("model.moe_experts=4", "model.moe_experts 8 -> 4"),
                                               ("model.moe_every=2", "model.moe_every 1 -> 2"),
                                               ("model.moe_experts=0", "model.moe_experts 8 -> 0")])
def test_resume_with_other_experts_names_the_key(ep_run, tmp_path, capsys, override, changed):
    """A resume whose expert arrays do not fit says which setting changed, in one line."""
    from jaxgpt.train import main

    shutil.copytree(ep_run, tmp_path / "run")
    args = ["--run-dir", str(tmp_path / "run"), *TINY, "train.steps=5", "train.grad_accum=2", *MOE, override]
    assert main([*args, "--mesh", "dp=2,ep=4"]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint {tmp_path / 'run' / 'checkpoints' / '5'} does not fit the "
                                       f"current config: {changed} (checkpoint -> this run)\n")


def test_resume_with_other_routing_says_so_in_one_line(ep_run, tmp_path, capsys):
    """moe_top_k and the capacity factor fit the same arrays: the resume goes on, and says so."""
    from jaxgpt.train import main

    shutil.copytree(ep_run, tmp_path / "run")
    args = ["--run-dir", str(tmp_path / "run"), *TINY, "train.steps=5", "train.grad_accum=2", *MOE[:1],
            "model.moe_top_k=1", "model.moe_capacity_factor=2.0", "--mesh", "dp=2,ep=4"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert err == (f"warning: model.moe_top_k 2 -> 1, model.moe_capacity_factor 4.0 -> 2.0 (checkpoint "
                   f"{tmp_path / 'run' / 'checkpoints' / '5'} -> this run): the run continues with other MoE routing\n")
    assert "resuming from step 5" in out

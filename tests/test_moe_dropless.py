"""Dropless dispatch, fine-grained and shared experts, bias balancing and ep inside the train step
(jaxgpt/model/dropless.py, moe.py, step.py): dropless equals the capacity path where nothing is
dropped, layouts train the same model as one device, the routing bias moves against the load with
no optimizer state and resumes exactly, and the gradients' all-reduces do not grow with the
micro-batches. 8 fake CPU devices, fp32."""

from __future__ import annotations

import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import restore_run, tiny_config
from test_parallel import LOSS_ATOL

from jaxgpt.config import validate
from jaxgpt.hlo import collective_bytes
from jaxgpt.model import param_count
from jaxgpt.model.moe import Experts, moe_mlp
from jaxgpt.model.ops import Ops
from jaxgpt.parallel.mesh import make_mesh, named
from jaxgpt.model.balance import split_balance
from jaxgpt.step import abstract_state, init_state, make_setup, make_train_step
from jaxgpt.train import train

E, K, RATE = 8, 2, 0.01
# capacity factor E/K: C = S, nothing dropped; fine-grained (F = 64 < 4 D) and one shared expert
MODERN = [f"model.moe_experts={E}", f"model.moe_top_k={K}", f"model.moe_capacity_factor={E / K}",
          "model.moe_dispatch=dropless", "model.moe_balance=bias", f"model.moe_bias_rate={RATE}",
          "model.moe_shared_experts=1", "model.moe_mlp_hidden=64"]


def _experts(key, D: int, F: int, swiglu: bool) -> Experts:
    k = jax.random.split(key, 6)
    normal = lambda i, shape: 0.3 * jax.random.normal(k[i], shape)  # noqa: E731
    return Experts(normal(0, (E, D, F)), normal(1, (E, F)), normal(2, (E, D, F)) if swiglu else None,
                   normal(3, (E, F)) if swiglu else None, normal(4, (E, F, D)), normal(5, (E, D)))


def test_dropless_equals_capacity_when_nothing_is_dropped(mlp="swiglu"):
    """With C = S the capacity path drops nothing, so both dispatches compute the same function:
    outputs, the MoE losses and every gradient agree to fp32 rounding (a routing bias, expert
    biases and swiglu's gate included; the layout tests below run gelu experts)."""
    B, T, D, F = 3, 16, 8, 12
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    router = jax.random.normal(jax.random.key(1), (D, E))
    w = _experts(jax.random.key(2), D, F, mlp == "swiglu")
    bias = 0.1 * jax.random.normal(jax.random.key(3), (E,))

    def run(dispatch):
        def f(x, router, w):
            y, stats = moe_mlp(x, router, w, Ops(tiny_config().model), mlp=mlp, top_k=K, capacity_factor=E / K, dispatch=dispatch,
                               bias_E=bias)
            return jnp.sum(y * jnp.cos(y)) + stats.aux + stats.z, (y, stats)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(x, router, w)

    (grads_c, (y_c, stats_c)), (grads_d, (y_d, stats_d)) = run("capacity"), run("dropless")
    np.testing.assert_allclose(y_d, y_c, rtol=0, atol=1e-6)
    for a, b in zip(stats_d, stats_c, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert float(stats_d.dropped) == 0.0 and float(jnp.sum(stats_d.load)) == pytest.approx(1.0)
    for a, b in zip(jax.tree.leaves(grads_d), jax.tree.leaves(grads_c), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def _devices(layout: str):
    return jax.devices()[:math.prod(int(part.split("=")[1]) for part in layout.split(","))]


def _run(layout: str, *overrides: str, steps: int = 3):
    """(losses, the final routing bias, the final state) of `steps` train steps on random batches."""
    cfg = tiny_config(*MODERN, *overrides, mesh=layout)
    devices = _devices(layout)
    mesh = make_mesh(validate(cfg, len(devices)), devices)
    rng = np.random.default_rng(0)
    losses = []
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        state, step = init_state(cfg, setup), make_train_step(cfg, mesh, setup)
        for _ in range(steps):
            batch = rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.seq_len + 1), np.int32)
            state, metrics = step(state, jax.device_put(batch, named(mesh, ("batch", None))))
            losses.append(float(metrics["loss"]))
    return losses, np.asarray(split_balance(state.params)[1]), state


@pytest.fixture(scope="module")
def one_device():
    return _run("dp=1")


@pytest.mark.parametrize("layout, overrides", [("dp=2,ep=4", ("train.grad_accum=2",)), ("fsdp=2,ep=2", ()),
                                               ("ep=2,tp=2", ()), ("pp=2,ep=4", ("train.grad_accum=2",))])
def test_dropless_and_bias_layouts_match_one_device(one_device, layout, overrides):
    """Dropless routing, shared and fine-grained experts and the bias balancing: every layout takes
    the same losses and moves the routing bias the same way (the loads are exact dyadic fractions,
    so the bias agrees exactly; under pp each stage's rows of it come from its own blocks)."""
    losses, bias, _ = _run(layout, *overrides)
    np.testing.assert_allclose(losses, one_device[0], rtol=0, atol=LOSS_ATOL)
    np.testing.assert_array_equal(bias, one_device[1])


def test_circular_pipeline_places_each_chunks_load_and_bias():
    """pp=2 x repeats=2 over 4 MoE blocks: device s runs chunks s and 2 + s, so each chunk's load
    must land on its own rows of the [G, E] routing bias; losses and bias as one device's."""
    losses, bias, _ = _run("pp=2,dp=2,ep=2", "model.n_layer=4", "pipeline.repeats=2")
    want_losses, want_bias, _ = _run("dp=1", "model.n_layer=4")
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=LOSS_ATOL)
    assert len({tuple(row) for row in want_bias}) == 4  # every block's bias moved its own way
    np.testing.assert_array_equal(bias, want_bias)


def test_bias_moves_against_the_load_without_gradient_or_optimizer(one_device):
    """Each step moves each expert's bias by exactly +-RATE (or 0 at the mean load); the bias has no
    AdamW moments and is not counted as a parameter."""
    _, bias_GE, state = one_device
    assert bias_GE.shape == (2, E) and np.any(bias_GE != 0)
    steps_GE = bias_GE / RATE
    np.testing.assert_allclose(steps_GE, np.round(steps_GE), atol=1e-4)
    assert np.all(np.abs(steps_GE) <= 3 + 1e-4)
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]}
    assert names and not any("router_bias" in n for n in names)
    cfg = tiny_config(*MODERN)
    trainable = split_balance(state.params)[0]
    assert sum(x.size for x in jax.tree.leaves(trainable)) == param_count(cfg.model)


def test_bias_resumes_exactly(tmp_path):
    """ep=8 (one expert per device): a run killed after its step-2 checkpoint and resumed ends with
    the same parameters and routing bias, bit for bit, as the run that never stopped."""
    cfg = tiny_config(*MODERN, "train.steps=4", "checkpoint.every=2", mesh="ep=8")
    train(cfg, tmp_path / "whole")
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    train(cfg, tmp_path / "resumed")
    whole, _ = restore_run(tmp_path / "whole", cfg)
    resumed, _ = restore_run(tmp_path / "resumed", cfg)
    assert whole.step == resumed.step == 4
    assert np.any(np.asarray(split_balance(whole.state.params)[1]) != 0)
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gradient_all_reduce_does_not_grow_with_micro_batches():
    """ep is manual inside the step, like dp: each shard sums its micro-batches' gradients, then one
    all-reduce over dp x ep of what ep replicates and one over dp of this device's E/ep experts,
    whatever train.grad_accum (before, GSPMD all-reduced over ep once per micro-batch)."""
    def compiled(accum: int):
        cfg = tiny_config(*MODERN, f"train.grad_accum={accum}", mesh="dp=2,ep=4")
        mesh = make_mesh(validate(cfg, 8))
        with jax.set_mesh(mesh):
            setup = make_setup(cfg, mesh)
            state = abstract_state(cfg, setup)
            batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), np.int32,
                                         sharding=named(mesh, ("batch", None)))
            hlo = make_train_step(cfg, mesh, setup).lower(state, batch).compile().as_text()
        return collective_bytes(hlo)["all-reduce"], state, setup

    (one, state, setup), (two, _, _) = compiled(1), compiled(2)
    trainable = split_balance(state.params)[0]
    axes = split_balance(setup.logical_axes)[0]
    sizes = [(math.prod(x.shape), "experts" in a) for x, a in zip(jax.tree.leaves(trainable),
             jax.tree.leaves(axes, is_leaf=lambda t: isinstance(t, tuple)), strict=True)]
    expected = 4 * sum(n // 4 if expert else n for n, expert in sizes)  # fp32; experts: a quarter each
    assert one == two
    assert expected <= one < expected + 256  # + the metrics (a few scalars and the [G, E] load)

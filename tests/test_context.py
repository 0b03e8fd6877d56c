"""Context parallelism (the cp axis, jaxgpt/parallel/context.py): the window split over devices in
a causally balanced order trains exactly what one device trains, with and without document masking,
composed with fsdp, tp and pp; the compiled step gathers K/V over cp and never holds a [T, T] score
block per device; a run resumes onto another cp. fp32 on the 8 fake CPU devices."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from helpers import TINY_DOCUMENTS, layer_loops, read_metrics, step_metrics, tiny_config, train_losses

from jaxgpt.config import validate
from jaxgpt.errors import UserError
from jaxgpt.hlo import collectives
from jaxgpt.parallel.context import to_device_order, to_window_order
from jaxgpt.parallel.mesh import make_mesh, named
from jaxgpt.step import init_state, make_setup, make_train_step
from jaxgpt.train import train

MASK = (*TINY_DOCUMENTS, "model.position=rope", "model.position_reset=true")

# fp32 as in test_parallel.py: layouts reorder fp32 sums only, ~1e-6 per step on a loss of ~10.8 (~7.1 here).
LOSS_ATOL = 1e-4


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_each_device_holds_an_early_and_a_late_chunk(cp):
    T = 8 * cp
    order = np.asarray(to_device_order(np.arange(T), cp, axis=0))  # the window position at each index
    assert sorted(order) == list(range(T))
    C = T // (2 * cp)
    pairs = []
    for j, held in enumerate(order.reshape(cp, 2 * C)):
        assert list(held) == [*range(j * C, (j + 1) * C), *range((2 * cp - 1 - j) * C, (2 * cp - j) * C)]
        pairs.append(int(np.sum(held + 1)))  # causal (query, key) pairs of this device's queries
    assert len(set(pairs)) == 1, "every device attends over the same number of keys"
    x = np.arange(3 * T).reshape(3, T)
    np.testing.assert_array_equal(to_window_order(to_device_order(x, cp), cp), x)


def _steps(layout: str, devices, *overrides: str) -> list[float]:
    """The losses of two train steps on fixed batches of packed documents."""
    return [float(m["loss"]) for m in step_metrics(tiny_config("model.n_layer=4", *overrides, mesh=layout), devices)]


@pytest.fixture(scope="module")
def one_device():
    """Two steps on one device in the reference forms (model.ops=reference), masked and not."""
    return {masked: _steps("dp=1", jax.devices()[:1], "model.ops=reference", *(MASK if masked else ()))
            for masked in (False, True)}


@pytest.mark.parametrize("layout, masked, overrides", [
    ("cp=2,dp=4", False, ()),
    ("cp=8", False, ()),
    ("cp=4,dp=2", True, ()),
    ("cp=2,fsdp=2,tp=2", True, ()),
    ("dp=2,cp=2,tp=2", False, ("train.grad_accum=2",)),
    ("pp=2,cp=2,dp=2", True, ("pipeline.repeats=2",)),
])
def test_layout_matches_one_device(layout, masked, overrides, one_device):
    losses = _steps(layout, jax.devices(), *(MASK if masked else ()), *overrides)
    np.testing.assert_allclose(losses, one_device[masked], rtol=0, atol=LOSS_ATOL)
    assert one_device[True][0] != pytest.approx(one_device[False][0], abs=1e-3), "masking should matter here"


MOE = ("model.moe_experts=8", "model.moe_top_k=2", "model.moe_dispatch=dropless")


def test_experts_under_cp_and_ep_match_one_device():
    """Dropless MoE: every token reaches its experts whatever order cp puts it in."""
    np.testing.assert_allclose(_steps("cp=2,ep=4", jax.devices(), *MOE), _steps("dp=1", jax.devices()[:1], *MOE),
                               rtol=0, atol=LOSS_ATOL)


def test_capacity_dispatch_under_cp_is_refused_in_one_line():
    """Which tokens an overflowing expert drops follows the order cp changes: not the same model."""
    with pytest.raises(UserError, match="use model.moe_dispatch=dropless with cp"):
        validate(tiny_config("model.moe_experts=8", "model.moe_top_k=2", mesh="cp=2,ep=4"), 8)


def test_compiled_step_gathers_keys_and_splits_the_scores():
    """cp=2: every layer all-gathers over cp (K and V) and its attention scores are [b, H, T/2, T]
    per device (the queries split, the keys whole), never [b, H, T, T]. The layout matrix's first
    entry, whose compiled step this reads (compiled once: tests/conftest.py)."""
    cfg = tiny_config("model.n_layer=4", mesh="cp=2,dp=4")
    mesh = make_mesh(validate(cfg, 8))
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        batch = jax.ShapeDtypeStruct((16, 33), np.int32, sharding=named(mesh, ("batch", None)))
        hlo = make_train_step(cfg, mesh, setup).lower(init_state(cfg, setup), batch).compile().as_text()
    loops = layer_loops(hlo)
    assert loops and all(collectives(body)["all-gather"] >= 2 for body in loops)
    assert "f32[4,4,16,32]" in hlo and "f32[4,4,32,32]" not in hlo


def test_resume_onto_another_cp_continues_the_trajectory(tmp_path, shakespeare_dir):
    """A cp=4 run's checkpoint at step 2 resumed on cp=2 trains steps 3 and 4 as the cp=4 run did."""
    cfg = ("train.steps=4", "checkpoint.every=2")
    train(tiny_config(*cfg, mesh="cp=4,dp=2"), tmp_path)
    straight = train_losses(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    train(tiny_config(*cfg, mesh="dp=4,cp=2"), tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]
    np.testing.assert_allclose(train_losses(tmp_path), straight, rtol=0, atol=LOSS_ATOL)


def test_a_window_that_does_not_split_into_2cp_chunks_is_one_line():
    with pytest.raises(UserError, match=r"cp=8 needs model.seq_len=40 to split into 2 x cp = 16 equal chunks"):
        validate(tiny_config("model.seq_len=40", mesh="cp=8"), 8)

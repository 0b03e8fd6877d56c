"""Every parallel layout trains the same model, shards what the table says, and compiles to the
collectives the layout implies. Runs on the 8 fake CPU devices from conftest.py."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from helpers import TINY_PADDED_VOCAB, TINY_VOCAB, layer_loops, loss_loops, tiny_config, train_losses

from jaxgpt.config import validate
from jaxgpt.lowering import choose
from jaxgpt.hlo import collective_bytes, collectives
from jaxgpt.parallel.mesh import RULES, logical_to_spec, make_mesh, named
from jaxgpt.step import init_state, make_setup, make_train_step
from jaxgpt.train import train

LAYOUTS = ["dp=8", "fsdp=8", "dp=4,tp=2", "dp=2,fsdp=2,tp=2", "dp=2,ep=4"]  # ep, dense: one more batch axis

# fp32 throughout. Layouts differ only in the order of floating-point sums (a gradient summed over
# 8 shards instead of one, a matmul split in two and added), which moved a loss of ~10.8 (GPT-2's
# vocabulary; the tiny one's starts at ~7.1) by about 1e-6 per step; after 5 AdamW steps we allow 1e-4 absolute, far below the ~0.1 a step moves it.
LOSS_ATOL = 1e-4
STEPS = "train.steps=5"


def _in_gemm(cfg, sizes: dict[str, int]) -> bool:
    """Whether the tuned lowering on a mesh of `sizes` sums the weight gradients inside their GEMMs."""
    ops = choose(cfg.model, make_mesh(sizes, jax.devices()[:int(np.prod(list(sizes.values()) or [1]))]))
    return ops.grads_in_gemm(cfg.train.grad_accum, bool(cfg.model.moe_experts))


@pytest.fixture(scope="module")
def single_device_losses(tmp_path_factory, shakespeare_dir):
    """One device, the reference forms (jaxgpt/model/ops.py: model.ops=reference): the maths."""
    run_dir = tmp_path_factory.mktemp("single")
    train(tiny_config(STEPS, "model.ops=reference", mesh="dp=1"), run_dir, devices=jax.devices()[:1])
    return train_losses(run_dir)


@pytest.mark.parametrize("layout, ops", [(layout, "auto") for layout in LAYOUTS] + [("dp=2,fsdp=2,tp=2", "reference")])
def test_layout_matches_single_device(layout, ops, single_device_losses, tmp_path):
    """Every layout in the default form (model.ops=auto: tuned on this CPU, jaxgpt/lowering/)
    trains to the reference forms' one-device losses, and so does the reference on a 3D layout."""
    train(tiny_config(STEPS, f"model.ops={ops}", mesh=layout), tmp_path)
    losses = train_losses(tmp_path)
    assert len(losses) == 5
    assert single_device_losses[-1] < single_device_losses[0] - 0.05, "the model should be learning"
    np.testing.assert_allclose(losses, single_device_losses, rtol=0, atol=LOSS_ATOL)


# bf16 with the default loss chunk (model.loss_chunk=0: TINY's pin undone), which each of these
# layouts takes as one chunk of all 32 positions (2 to 4 rows per device; one device: micro-batches
# of 2). XLA:CPU could not run that step in bf16 (issue 39; jaxgpt/lowering/loss.py `pins_dwte`). Both
# steps run at the initial parameters (the first update has lr 0), so the losses are the fp32 single
# device's, held to bf16's unit roundoff as in test_pipeline.py (pipelines: its bf16 matrix; dp=8:
# test_cli.py's XLA-error test trains it first).
BF16_LAYOUTS = [("dp=1", ("train.grad_accum=8",), 1), ("dp=2,fsdp=2,tp=2", (), 8), ("dp=2,ep=4", (), 8)]


@pytest.mark.parametrize("layout, overrides, n", BF16_LAYOUTS)
def test_layout_trains_in_bf16_with_the_default_loss(layout, overrides, n, single_device_losses, tmp_path):
    cfg = tiny_config("train.steps=2", "model.dtype=bfloat16", "model.loss_chunk=0", *overrides, mesh=layout)
    train(cfg, tmp_path, devices=jax.devices()[:n])
    np.testing.assert_allclose(train_losses(tmp_path), single_device_losses[:2], rtol=2.0 ** -8, atol=0)


def test_gradients_summed_in_their_gemms_train_as_the_stacked_sums(tmp_path):
    """bf16, 2 micro-batches: with its layers unrolled the step sums each block weight's fp32
    gradient per layer inside the GEMM that computes it (trick grads_in_gemm, jaxgpt/copies.py),
    scanned it sums the stacked bf16-rounded ones. Six steps of AdamW follow the same losses to 2^-12
    relative (3.9e-6 measured): a layer's sum in another layer's place, or a micro-batch left out,
    would turn the updates. Not under fsdp, cp, or with one micro-batch."""
    losses = []
    for scan in ("true", "false"):
        cfg = tiny_config("train.steps=6", "train.grad_accum=2", "model.dtype=bfloat16", "model.loss_chunk=0",
                          f"model.scan_layers={scan}", mesh="dp=1")
        assert _in_gemm(cfg, {"dp": 1}) == (scan == "false")
        train(cfg, tmp_path / scan, devices=jax.devices()[:1])
        losses.append(train_losses(tmp_path / scan))
    assert len(losses[1]) == 6 and losses[1][-1] < losses[1][0] - 0.05
    np.testing.assert_allclose(losses[1], losses[0], rtol=2.0 ** -12, atol=0)
    unrolled = ("train.grad_accum=2", "model.dtype=bfloat16", "model.scan_layers=false")
    for other, sizes in (((), {"fsdp": 2}), ((), {"cp": 2}), (("train.grad_accum=1",), {})):
        assert not _in_gemm(tiny_config(*unrolled, *other), sizes), (other, sizes)


# bf16, unrolled, 2 micro-batches on dp=8: the remat checks' step (each policy compiled once for both)
REMAT = ("train.grad_accum=2", "model.dtype=bfloat16", "model.scan_layers=false")


def test_remat_dots_runs_no_gemm_of_the_summed_gradients_again():
    """bf16, unrolled, 2 micro-batches on dp=8: the block linears' GEMMs that sum their weight
    gradients in place are custom VJPs (jaxgpt/lowering/linear.py `_precast_einsum`), and remat=dots and
    dots_no_batch keep the dots inside them as they keep autodiff's (jax.checkpoint traces the
    forward rule). The compiled step holds as many dots under remat=dots as under none, and under
    dots_no_batch two more per layer: the XLA attention's batched einsums (a CPU's), which that
    policy does not keep. remat=full, which runs every block's forward again, holds more still."""
    cfg = tiny_config(*REMAT, "model.remat=dots")
    assert _in_gemm(cfg, {"dp": 8})
    dots = {remat: len(re.findall(r" dot\(", _compiled_hlo("dp=8", *REMAT, f"model.remat={remat}")))
            for remat in ("none", "dots", "dots_no_batch", "full")}
    assert dots["none"] > 0 and dots["dots"] == dots["none"], dots
    assert dots["dots_no_batch"] == dots["none"] + 2 * cfg.model.n_layer < dots["full"], dots


@pytest.mark.parametrize("layout", ["dp=1", "dp=2,fsdp=2,tp=2"])
def test_grad_accum_matches_one_big_batch(layout, single_device_losses, tmp_path):
    """Two micro-batches of 8 give the gradient of one batch of 16 (same tolerance, same reason),
    also when each dp shard accumulates its own gradient before the one all-reduce."""
    devices = jax.devices()[:1] if layout == "dp=1" else None
    train(tiny_config("train.steps=5", "train.grad_accum=2", mesh=layout), tmp_path, devices=devices)
    np.testing.assert_allclose(train_losses(tmp_path), single_device_losses, rtol=0, atol=LOSS_ATOL)


def _state_and_step(layout: str, *overrides: str):
    cfg = tiny_config(*overrides, mesh=layout)
    mesh = make_mesh(validate(cfg, 8))
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        return cfg, mesh, setup, init_state(cfg, setup), make_train_step(cfg, mesh, setup)


@pytest.mark.parametrize("layout", ["fsdp=8", "dp=2,fsdp=2,tp=2"])
def test_parameters_sharded_as_the_table_says(layout):
    _, mesh, setup, state, _ = _state_and_step(layout)
    flat_axes = dict(jax.tree_util.tree_flatten_with_path(setup.logical_axes, is_leaf=lambda x: isinstance(x, tuple))[0])
    for path, param in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        axes = flat_axes[path]
        assert param.sharding.is_equivalent_to(named(mesh, axes), param.ndim), (path, param.sharding)
        # each device holds exactly its slice: dims split by the mesh axes the table names
        expected = list(param.shape)
        for dim, name in enumerate(axes):
            for axis in (RULES[name],) if isinstance(RULES[name], str) else RULES[name] or ():
                expected[dim] //= mesh.shape[axis]
        assert param.addressable_shards[0].data.shape == tuple(expected), path
    if layout == "fsdp=8":
        for path, param in jax.tree_util.tree_flatten_with_path(state.params)[0]:
            if param.size >= 1024:  # every weight matrix and embedding; LayerNorm vectors are tiny
                assert not param.sharding.is_fully_replicated, path
                assert param.addressable_shards[0].data.size == param.size // 8, path


def test_optimizer_state_follows_parameter_sharding():
    _, _, _, state, _ = _state_and_step("dp=2,fsdp=2,tp=2")
    adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    for moments in (adam.mu, adam.nu):
        for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(moments)):
            assert m.sharding.is_equivalent_to(p.sharding, p.ndim)


def test_logical_axes_cannot_reuse_a_mesh_axis():
    assert logical_to_spec(("batch", "seq", "act_vocab")) == jax.sharding.PartitionSpec(("dp", "fsdp", "ep"), "cp", "tp")
    with pytest.raises(ValueError, match="both map to mesh axis"):
        logical_to_spec(("batch", "embed"))


_COMPILED: dict[tuple[str, ...], tuple] = {}


def _compiled(layout: str, *overrides: str) -> tuple:
    """(mesh, initial state, compiled step) of the layout, traced and compiled once in this module.
    The parity matrix's 5 steps: where the layout is one it trains, its compiled step is reused
    (tests/conftest.py) instead of compiled again for another learning-rate schedule."""
    if (layout, *overrides) not in _COMPILED:
        cfg, mesh, setup, state, step = _state_and_step(layout, STEPS, *overrides)
        batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), np.int32,
                                     sharding=named(mesh, ("batch", None)))
        with jax.set_mesh(mesh):
            _COMPILED[(layout, *overrides)] = mesh, state, step.lower(state, batch).compile()
    return _COMPILED[(layout, *overrides)]


def _compiled_hlo(layout: str, *overrides: str) -> str:
    return _compiled(layout, *overrides)[2].as_text()


def test_remat_lowers_temp_memory_without_changing_the_loss():
    """XLA's memory analysis of the remat checks' step: every policy that recomputes keeps fewer
    temporaries than none (full and attention, which the XLA attention of a CPU recomputes as
    full, less), and the first step's loss is the same under each."""
    temp, loss = {}, {}
    for remat in ("none", "full", "dots", "attention"):
        mesh, state, step = _compiled("dp=8", *REMAT, f"model.remat={remat}")
        batch = np.random.default_rng(0).integers(0, TINY_VOCAB, (16, 33)).astype(np.int32)
        with jax.set_mesh(mesh):  # on a copy: the step donates its state
            _, metrics = step(jax.tree.map(lambda x: x.copy(), state), jax.device_put(batch, named(mesh, ("batch", None))))
        temp[remat], loss[remat] = step.memory_analysis().temp_size_in_bytes, float(metrics["loss"])
    assert temp["full"] < temp["none"] and temp["dots"] <= temp["none"] and temp["attention"] < temp["none"], temp
    for remat in ("full", "dots", "attention"):
        assert loss[remat] == pytest.approx(loss["none"], abs=1e-5), loss


def test_dp_collectives():
    """Data parallel: gradients are all-reduced; parameters are whole, so nothing is gathered,
    and the forward layer loop talks to no other device."""
    hlo = _compiled_hlo("dp=8")
    assert collectives(hlo)["all-reduce"] >= 1
    assert collectives(hlo)["all-gather"] == 0
    assert any(sum(collectives(body).values()) == 0 for body in layer_loops(hlo))


def test_dp_reduces_gradients_once_per_step():
    """dp with gradient accumulation: each dp shard sums its own micro-batch gradients and one
    all-reduce follows the micro-batch loop, so 4 micro-batches move the same bytes as 1, and that
    is one gradient's worth (the tied embedding's lookup and head gradients are added before it)."""
    param_bytes = 4 * sum(p.size for p in jax.tree.leaves(_state_and_step("dp=8")[3].params))
    one, four = (collective_bytes(_compiled_hlo("dp=8", "train.batch_size=32", f"train.grad_accum={a}"))
                 for a in (1, 4))
    assert four == one
    assert param_bytes <= one["all-reduce"] < 1.01 * param_bytes


def test_fsdp_collectives():
    """FSDP: each layer's weights are all-gathered inside the layer loops (forward and backward),
    and gradients are reduced over the fsdp axis. XLA:CPU expresses that reduction as all-reduce
    followed by a slice of the local shard; XLA:GPU's reduce-scatter creator turns the same pattern
    into reduce-scatter, so either is accepted. The full embedding [V, D] is gathered once."""
    hlo = _compiled_hlo("fsdp=8")
    counts = collectives(hlo)
    assert counts["all-reduce"] + counts["reduce-scatter"] >= 1
    bodies = layer_loops(hlo)
    assert len(bodies) >= 2 and all(collectives(b)["all-gather"] >= 1 for b in bodies)
    assert any(collectives(b)["all-reduce"] == 0 for b in bodies), "the forward loop needs no all-reduce"
    # the fused loss's chunk loop uses the table gathered once before it: no collective inside
    assert loss_loops(hlo) and all(sum(collectives(b).values()) == 0 for b in loss_loops(hlo))
    assert f"f32[{TINY_PADDED_VOCAB},32]{{0,1}} all-gather(" in hlo or f"f32[{TINY_PADDED_VOCAB},32]{{1,0}} all-gather(" in hlo


@pytest.mark.parametrize("layout", ["dp=4,tp=2", "dp=2,fsdp=2,tp=2"])
def test_tp_collectives(layout):
    """Tensor parallel: the row-parallel matmuls (attention-out, MLP-out) leave partial sums that
    are all-reduced inside every layer, forward and backward, so every layer loop holds all-reduces."""
    hlo = _compiled_hlo(layout)
    bodies = layer_loops(hlo)
    assert len(bodies) >= 2 and all(collectives(b)["all-reduce"] >= 1 for b in bodies)
    if "fsdp" not in layout:
        assert collectives(hlo)["all-gather"] == 0

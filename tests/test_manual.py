"""jaxgpt.parallel.manual.per_shard (how cuDNN attention runs on a mesh), checked on CPU with XLA attention:
the same values and gradients as one device, inside a plain jit and inside the train step's kind of
dp-manual shard_map, with specs derived from the logical-axis table."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxgpt.parallel.manual import per_shard, spec_for
from jaxgpt.parallel.mesh import make_mesh

AXES = ("batch", "seq", "act_heads", None)
attend = partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")


def _qkv(B=8, T=16, H=4, K=8):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (B, T, H, K), jnp.float32) for k in keys]


def _loss_and_grads(attention, q, k, v):
    return jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v))), argnums=(0, 1, 2))(q, k, v)


def test_spec_follows_the_table_and_drops_manual_and_uneven_axes():
    mesh = make_mesh({"dp": 2, "fsdp": 2, "tp": 2})  # ep=1, cp=1: kept in the specs, they split nothing
    assert spec_for((8, 16, 4, 8), AXES, mesh, set()) == P(("dp", "fsdp", "ep"), "cp", "tp", None)
    assert spec_for((8, 16, 4, 8), AXES, mesh, {"dp"}) == P(("fsdp", "ep"), "cp", "tp", None)
    assert spec_for((1, 16, 4, 8), AXES, mesh, set()) == P("ep", "cp", "tp", None)  # a batch of one sample
    assert spec_for((2, 16, 3, 8), AXES, mesh, set()) == P(("dp", "ep"), "cp", None, None)
    mesh = make_mesh({"dp": 2, "cp": 2, "tp": 2})
    assert spec_for((8, 16, 4, 8), AXES, mesh, set()) == P(("dp", "fsdp", "ep"), "cp", "tp", None)
    assert spec_for((8, 15, 4, 8), AXES, mesh, set()) == P(("dp", "fsdp", "ep"), None, "tp", None)  # uneven T


@pytest.mark.parametrize("layout", [{"dp": 2, "fsdp": 2, "tp": 2}, {"dp": 8, "fsdp": 1, "tp": 1}])
def test_per_shard_matches_one_device(layout):
    """Values and gradients under jit; values inside a dp-manual shard_map (the train step's
    context). XLA attention stands in for cuDNN's here: the backward through a nested shard_map
    without the manual-axis check needs a custom_vjp kernel such as cuDNN's, compiled for H100 in
    tests/test_gpu_compile.py."""
    q, k, v = _qkv()
    want_loss, want_grads = _loss_and_grads(attend, q, k, v)
    mesh = make_mesh(layout)
    automatic = partial(per_shard, attend, AXES)
    in_dp_shard_map = jax.shard_map(automatic, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"})
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(partial(_loss_and_grads, automatic))(q, k, v)
        out = jax.jit(in_dp_shard_map)(q, k, v)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, attend(q, k, v), rtol=1e-5, atol=1e-6)

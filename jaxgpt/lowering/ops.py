"""`Lowering`: the model's ops (model/ops.py) as a run computes them, and `choose`, which builds it
once per run from the config and the mesh, where the train step is built (jaxgpt/step.py).

A lowering is the reference ops plus three choices made before anything is traced: the attention
kernel (model.attention), the fp8 linear kinds (model.fp8), and the tricks (model.ops: none, all,
or the names of some; TRICKS). Each method falls back to the reference form where its tricks are off
or do not apply (a trick for bf16 GEMMs under fp8, one for unsplit weights under fsdp). What a
trick needs from the layer after or before its op travels beside the activation in an `Operand`:
a norm's bias routed through the linears it feeds, a bound on an fp8 operand's max |x|, v's bias
folded into the attention output's projection. The model passes these on unopened.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgpt.config import TRICKS, ModelConfig
from jaxgpt.lowering import activations, loss
from jaxgpt.lowering.attention import causal_attention, select_kernel
from jaxgpt.lowering.linear import (Precast, add_bias, dense, fence_gradient, folded_bias, passes_input_bias_grad,
                                    weight_as_read)
from jaxgpt.lowering.norm import normalize, normalize_with_amax
from jaxgpt.model.ops import Ops, positions
from jaxgpt.parallel.mesh import shard

CPU_AUTO = "tuned"  # model.ops=auto on a CPU: the faster form there, measured (docs/ops.md)
_FEEDS = {"attn": "qkv", "mlp": "mlp_in"}  # Norm's `before` -> the linear kind its output feeds


class Operand(NamedTuple):
    """An activation on its way to the linear (or attention) that reads it, with what the lowering
    carries beside it; the model passes it on unopened."""
    x: jax.Array
    amax: jax.Array | None = None     # a bound on max |x|, for an fp8 cast (norm_amax, activation_amax)
    routed: jax.Array | None = None   # a bias x holds, whose gradient the linears' biases take (routed_bias)
    missing: jax.Array | None = None  # a bias x lacks, which the projection after adds (qkv_bias_drop)


def tricks_of(ops: str, platform: str) -> frozenset[str]:
    """model.ops -> the tricks on: reference none, tuned all, auto tuned on an accelerator and
    CPU_AUTO's on a CPU, or the names listed."""
    if ops == "auto":
        ops = "tuned" if platform != "cpu" else CPU_AUTO
    if ops in ("reference", "tuned"):
        return frozenset(TRICKS) if ops == "tuned" else frozenset()
    return frozenset(ops.split(","))


def compute_dtype(name: str, platform: str) -> jnp.dtype:
    """model.dtype -> the dtype matmuls run in ('auto': bf16 on GPU/TPU, fp32 on CPU)."""
    if name == "auto":
        return jnp.bfloat16 if platform in ("gpu", "tpu") else jnp.float32
    return jnp.dtype(name)


def choose(cfg: ModelConfig, mesh) -> Lowering:
    """The lowering of a run of `cfg` on `mesh`: its platform (a compile-only GPU's while compiling
    for one), compute dtype, attention kernel (UserError where the one asked for cannot run) and
    tricks, decided here once."""
    device = mesh.devices.flat[0]
    dtype = compute_dtype(cfg.dtype, device.platform)
    kernel, why = select_kernel(cfg.attention, dtype, cfg.head_dim, device, cfg.document_mask)
    tricks = tricks_of(cfg.ops, device.platform)
    return Lowering(cfg, tricks, cfg.fp8_linears(), kernel, why, device.platform, jnp.dtype(dtype).name,
                    tuple(sorted(dict(mesh.shape).items())))


@dataclasses.dataclass(frozen=True)
class Lowering(Ops):
    tricks: frozenset[str] = frozenset()
    fp8: frozenset[str] = frozenset()  # the block linear kinds in fp8 (model.fp8)
    kernel: str = "xla"                # the attention kernel, and why
    kernel_why: str = ""
    platform: str = "cpu"
    dtype: str = "float32"             # the compute dtype
    sizes: tuple = ()                  # the mesh's (axis, size) pairs

    def on(self, trick: str) -> bool:
        return trick in self.tricks

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    @property
    def form(self) -> str:
        """'reference', 'tuned', or the tricks on, as model.ops spells them."""
        if self.tricks == frozenset(TRICKS) or not self.tricks:
            return "tuned" if self.tricks else "reference"
        return ",".join(t for t in TRICKS if t in self.tricks)

    @property
    def described(self) -> str:
        """The banner's words: which form runs, and why."""
        if self.cfg.ops != "auto":
            return f"{self.form} (model.ops={self.cfg.ops})"
        why = "the faster on a CPU, docs/ops.md" if self.platform == "cpu" else f"tuned on a {self.platform.upper()}"
        return f"{self.form} (model.ops=auto: {why})"

    @property
    def fsdp(self) -> bool:
        return self.size("fsdp") > 1

    @property
    def tp(self) -> int:
        return self.size("tp")

    @property
    def qkv_apart(self) -> bool:
        """q, k and v each a GEMM of its own: not where fsdp gathers the weight for each."""
        return self.on("qkv_gemms") and not self.fsdp

    def epilogues(self, fp8: bool) -> bool:
        """Whether a compute-dtype GEMM takes the work around it into its epilogue: not an fp8 one
        (cuBLASLt's fp8 GEMM takes no residual, and fp8's backward sums its biases' gradients in the
        kernel that takes the gradient's amax), not under fsdp (the bias sums became collectives)."""
        return not fp8 and not self.fsdp

    def copies_once(self, moe: bool) -> bool:
        """Whether the train step copies the block weights once per step (copies.py)."""
        return self.size("pp") == 1 and not moe and (self.on("precast") or (self.on("prequantize") and bool(self.fp8)))

    def grads_in_gemm(self, grad_accum: int, moe: bool) -> bool:
        """Whether the block weights' gradients are summed over micro-batches inside their GEMMs:
        with micro-batches, the copies and the layers unrolled; not where automatic axes split the
        rows (fsdp, cp), whose partial gradients are reduced before the sum (fp32: twice the bytes)."""
        return (self.on("grads_in_gemm") and grad_accum > 1 and self.copies_once(moe) and not self.cfg.scan_layers
                and not self.fsdp and self.size("cp") == 1)

    # -- the ops -----------------------------------------------------------------------------

    def linear(self, name, spec, x, kernel, bias=None, parts=None):
        op = x if isinstance(x, Operand) else Operand(x)
        fp8 = name in self.fp8
        w = kernel.get_value() if hasattr(kernel, "get_value") else kernel
        axes = None if self.size("pp") > 1 else getattr(kernel, "logical_axes", None)
        b = None if bias is None else bias[...]
        if not self.tricks and not fp8:
            return super().linear(name, spec, op.x, kernel, bias, parts)
        routed = lambda b_i, w_i: passes_input_bias_grad(b_i, op.routed, w_i, 1)  # noqa: E731
        if parts is not None:
            return self._parts(name, spec, op, w, axes, fp8, b, parts, routed)
        if name in ("attn_out", "mlp_out"):  # onto the residual stream
            b = folded_bias(spec, op.missing, w, b)
            if self.on("residual_epilogue") and self.epilogues(fp8):
                return dense(name, spec, op.x, w, axes, fp8, op.amax, bias=b, fp8_tuned=bool(self.tricks))
            return add_bias(dense(name, spec, op.x, w, axes, fp8, op.amax, fp8_tuned=bool(self.tricks)), b)
        if op.routed is not None:
            b = routed(b, weight_as_read(w, op.x.dtype))
        if fp8 or name == "qkv" and self.on("qkv_gemms"):  # the bias in the epilogue (fp8: prequantized)
            y = dense(name, spec, op.x, w, axes, fp8, op.amax, bias=b, fp8_tuned=bool(self.tricks))
        else:  # bf16: the activation's kernel adds it (an epilogue would write h in fp32 first)
            y = add_bias(dense(name, spec, op.x, w, axes, fp8, op.amax, fp8_tuned=bool(self.tricks)), b)
        if name == "qkv":
            return shard(y, "batch", "seq", "act_heads", None)
        keep = self.on("gelu_derivative") and self.epilogues("mlp_out" in self.fp8)
        if name == "mlp_in" and fp8 and not keep and b is not None and self.on("h_fence"):
            y = fence_gradient(y)  # the activation's backward writes dh in bf16 for the fp8 cast to read
        return y

    def _parts(self, name, spec, op, w, axes, fp8, b, parts, routed):
        """q, k and v (or k and v) from the weight's slices along its 'qkv' axis. Where
        `qkv_bias_drop` applies, only q's GEMM adds a bias: k's adds q.b_k to all of a query's
        scores alike, which softmax ignores (not with rope or qk-norm), and since each softmax row
        sums to 1, v's adds b_v to every output row, b_v W_o, which attn_out's bias takes."""
        axis = dict(zip(axes or (), range(99))).get("qkv", 1)
        b_parts = None if b is None else [jax.lax.index_in_dim(b, i, 0, keepdims=False) for i in range(len(parts))]
        if b_parts is not None and op.routed is not None:
            w_read = weight_as_read(w, op.x.dtype)
            b_parts = [routed(b_i, jax.lax.index_in_dim(w_read, i, axis, keepdims=False))
                       for i, b_i in enumerate(b_parts)]
        missing = None
        if b_parts is not None and self.on("qkv_bias_drop") and self.epilogues(bool({"qkv", "attn_out"} & self.fp8)):
            cancels = not self.cfg.qk_norm and self.cfg.position != "rope"
            k, v = parts.index("k"), parts.index("v")
            missing, b_parts[v] = b_parts[v], None
            if cancels:
                b_parts[k] = None
        ys = dense(name, spec, op.x, w, axes, fp8, op.amax, bias=None if b_parts is None else tuple(b_parts),
                   parts=axis, apart=self.qkv_apart, fp8_tuned=bool(self.tricks))
        ys = [shard(y, "batch", "seq", "act_heads", None) for y in ys]
        if missing is not None:
            ys[parts.index("v")] = Operand(ys[parts.index("v")], missing=missing)
        return tuple(ys)

    def norm(self, x, scale, bias, rms, before=None):
        if not self.tricks:
            return super().norm(x, scale, bias, rms, before)
        flatten, feeds_fp8 = before != "scores", _FEEDS.get(before) in self.fp8
        if feeds_fp8 and flatten and self.on("norm_amax"):
            y, amax = normalize_with_amax(x.reshape(-1, x.shape[-1]), scale, bias, rms, self.cfg.norm_eps)
            return Operand(y.reshape(x.shape), amax=amax)
        routes = (self.on("routed_bias") and before in _FEEDS and bias is not None and self.epilogues(feeds_fp8))
        y = self._normalize(x, scale, jax.lax.stop_gradient(bias) if routes else bias, rms, flatten, feeds_fp8)
        return Operand(y, routed=bias) if routes else y

    def _normalize(self, x, scale, bias, rms, flatten, feeds_fp8):
        if not self.on("norm_vjp"):
            return super().norm(x, scale, bias, rms)
        x_ND = x.reshape(-1, x.shape[-1]) if flatten else x  # as [B*T, D] rows: its column sums over one axis
        keep_stats = not (self.on("norm_recompute") and self.epilogues(feeds_fp8))
        return normalize(x_ND, scale, bias, rms, keep_stats, self.cfg.norm_eps).reshape(x.shape)

    def activation(self, kind, h, gate=None, into="mlp_out"):
        dense_mlp = into == "mlp_out"
        keep = dense_mlp and self.on("gelu_derivative") and self.epilogues("mlp_out" in self.fp8)
        if kind == "gelu" and keep and jnp.dtype(h.dtype).itemsize < 4:
            a = activations.gelu_tanh_keeping_derivative(h)
        elif self.on("activation_vjps"):
            a = activations.activate(kind, h, gate)
        else:
            a = super().activation(kind, h, gate)
        if dense_mlp and "mlp_out" in self.fp8 and self.on("activation_amax"):
            amax = activations.activation_amax(kind, h)
            return a if amax is None else Operand(a, amax=amax)
        return a

    def residual(self, x, y, after=None):
        if not self.on("residual_epilogue"):
            return x + y
        barrier = after is not None and self.epilogues(after in self.fp8)
        D = x.shape[-1]
        x_ND = x.reshape(-1, D)  # added as rows [B*T, D], the GEMM's own shape
        return ((jax.lax.optimization_barrier(x_ND) if barrier else x_ND) + y.reshape(-1, D)).reshape(x.shape)

    @property
    def table_axes(self) -> tuple:
        """How a [V, D] table is read: whole rows, V kept on tp (Megatron's vocab-parallel
        embedding), except where tp > 1 meets fsdp or pp: there XLA's SPMD partitioner aborted the
        process on the lookup inside a shard_map (XLA:GPU's under fsdp x tp, inside the train step's
        dp one; XLA:CPU's under pp x tp, inside the pipelined eval step, for a 512-row table), so
        the table is read whole."""
        return (None if (self.fsdp or self.size("pp") > 1) and self.tp > 1 else "vocab", None)

    def lookup(self, table_VD, ids, dtype):
        """The table's rows for ids, in dtype (the embedding's and the loss's label rows)."""
        return shard(_read(table_VD), *self.table_axes)[ids].astype(dtype)

    def embed(self, table_VD, ids_BT, dtype, wpe_TD=None, pos=0, cp=1):
        x_BTD = self.lookup(table_VD, ids_BT, jnp.float32)
        x_BTD = x_BTD if wpe_TD is None else x_BTD + positions(_read(wpe_TD), pos, ids_BT.shape[1], cp)
        return x_BTD.astype(dtype)

    def attention(self, q_BTHK, k_BTGK, v_BTGK, docs=None):
        missing = v_BTGK.missing if isinstance(v_BTGK, Operand) else None
        v_BTGK = v_BTGK.x if isinstance(v_BTGK, Operand) else v_BTGK
        out = causal_attention(q_BTHK, k_BTGK, v_BTGK, impl=self.kernel, docs=docs,
                               max_documents=self.cfg.max_documents, cp=self.size("cp"))
        if missing is None:
            return out
        # v's bias as the output's: query head h reads kv head h // (H/G)
        return Operand(out, missing=jnp.repeat(missing, q_BTHK.shape[2] // missing.shape[0], axis=0))

    def cached_attention(self, q_BTHK, k_BTGK, v_BTGK, kv, pos, docs=None):
        if isinstance(v_BTGK, Operand):
            v_BTGK = v_BTGK.x + v_BTGK.missing.astype(v_BTGK.x.dtype)
        return super().cached_attention(q_BTHK, k_BTGK, v_BTGK, kv, pos, docs)

    def token_nats(self, x_BTD, table_VD, labels_BT, dtype):
        if not self.on("fused_loss"):
            return super().token_nats(x_BTD, table_VD, labels_BT, dtype)
        return loss.token_nats(x_BTD, table_VD, labels_BT, self, dtype)

    def cross_entropy(self, x_BTD, table_VD, labels_BT, dtype, weights_BT=None):
        if not self.on("fused_loss"):
            return super().cross_entropy(x_BTD, table_VD, labels_BT, dtype, weights_BT)
        return loss.chunked_cross_entropy(x_BTD, table_VD, labels_BT, self, dtype, weights_BT)

    def loss_chunk(self, B, T):
        return loss.chunk_positions(self.cfg, loss.rows_per_device(B), T, self.platform)


def _read(table):
    """A table's value (a Param's or an array), or with `tables_in_compute_dtype` its `Precast`
    copy (gathered in the compute dtype once per step, jaxgpt/copies.py) read in the parameter's
    dtype, its gradient the parameter's: the gather moved the compute dtype's bytes, the lookups
    and their gradients stay as autodiff of the fp32 table gives them."""
    w = table.get_value() if hasattr(table, "get_value") else table
    return _copy_read(w.w, w.c) if isinstance(w, Precast) else w


@jax.custom_vjp
def _copy_read(table, copy):
    return copy.astype(table.dtype)


_copy_read.defvjp(lambda table, copy: (_copy_read(table, copy), None), lambda _, g: (g, None))

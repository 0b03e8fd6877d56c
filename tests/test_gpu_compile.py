"""The train step compiled by XLA:GPU for 8 compile-only H100s (jaxgpt/gpu), no GPU needed.

Each layout's step is the real one (jaxgpt.plan.compile_step -> jaxgpt.step), compiled once per
module; the assertions read XLA:GPU's own HLO: cuDNN fused attention forward and backward under
every mesh (the cuDNN partitioner used to fail inside the dp shard_map: jaxgpt/parallel/manual.py), one
gradient all-reduce per step under dp, bf16 weight gathers and gradient reduce-scatters under fsdp,
tp's all-reduces inside the layer loops, MoE's all-to-alls over ep, pp's collective-permutes inside
the pipeline schedule's loop. The tiny model covers the layout matrix; gpt2-124m (2 of
its 12 layers, everything else as configured, so compiling stays short, and so with its layers
unrolled, model.scan_layers=false) covers dp=8 and fsdp=8; the tiny layouts scan theirs.
Needs the CUDA plugin (`pip install -e ".[test,gpu-compile]"`, what CI runs)."""

from __future__ import annotations

import collections
import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import pytest
from helpers import REPO, script_module
from helpers import gpt2_tiny_config as tiny_config  # the compiled programs read here are the default run's

from jaxgpt import hlo
from jaxgpt.config import load_config
from jaxgpt.gpu import cost, perf
from jaxgpt.gpu.target import INSTALL, compile_only_devices, compiling_for, device_memory_bytes, plugin_missing_reason
from jaxgpt.hlo import (BLOCK_LINEARS, collective_ops, collectives, fp8_gemm_operand_types, fused_attention_counts,
                        gemm_layers, while_bodies)
from jaxgpt.lowering import flash
from jaxgpt.plan import Compiled, lower_step, plan


needs_plugin = pytest.mark.skipif(plugin_missing_reason() is not None,
                                  reason=f"needs the CUDA plugin to compile for H100: {INSTALL}")

# (mesh, overrides): every axis alone and in products, grad_accum 1 and > 1, fp8 on and off, each remat policy
FP8 = "model.fp8=true"
TINY_LAYOUTS = {
    "dp8_accum2_fp8": ("dp=8", ["train.grad_accum=2", FP8]),
    "fsdp8_remat_full_fp8": ("fsdp=8", ["model.remat=full", FP8]),
    "fsdp8_accum2_remat_full_fp8": ("fsdp=8", ["train.grad_accum=2", "model.remat=full", FP8]),
    "fsdp8_accum2_remat_full": ("fsdp=8", ["train.grad_accum=2", "model.remat=full"]),  # its bf16 twin
    "dp2_fsdp4_accum2_remat_attention": ("dp=2,fsdp=4", ["train.grad_accum=2", "model.remat=attention"]),
    "dp2_fsdp4_accum2_remat_dots_fp8": ("dp=2,fsdp=4", ["train.grad_accum=2", "model.remat=dots", FP8]),
    "dp4_tp2_remat_dots_no_batch_fp8": ("dp=4,tp=2", ["model.remat=dots_no_batch", FP8]),
    "dp2_fsdp2_tp2_accum2_fp8_head": ("dp=2,fsdp=2,tp=2", ["train.grad_accum=2", FP8, "model.fp8_head=true"]),
    "dp2_ep4_moe_accum2": ("dp=2,ep=4", ["model.moe_experts=8", "model.moe_top_k=2", "train.grad_accum=2"]),
    "ep8_moe_dropless_bias_accum2": ("ep=8", ["model.moe_experts=8", "model.moe_top_k=2", "train.grad_accum=2",
                                              "model.moe_dispatch=dropless", "model.moe_balance=bias",
                                              "model.moe_shared_experts=1", "model.moe_mlp_hidden=64"]),
    "pp2_ep4_moe_dropless_bias_accum2": ("pp=2,ep=4", ["model.moe_experts=8", "model.moe_top_k=2", "train.grad_accum=2",
                                                      "model.moe_dispatch=dropless", "model.moe_balance=bias"]),
    "pp2_dp2_tp2": ("pp=2,dp=2,tp=2", ["model.n_layer=4"]),
    "pp2_fsdp4_circular_accum2_remat_full_fp8": ("pp=2,fsdp=4", ["model.n_layer=4", "pipeline.repeats=2",
                                                                 "train.grad_accum=2", "model.remat=full", FP8]),
}
FP8_LAYOUTS = [name for name, (_, overrides) in TINY_LAYOUTS.items() if FP8 in overrides]
GPT2 = ["model.n_layer=2", "model.remat=none", "train.grad_accum=16"]
# gpt2-124m's bundled micro-batch (128 x 1,024 rows) on one GPU, 2 of its 12 layers: the memory-bound kernels' layout
GPT2_ONE_GPU = ["model.n_layer=2", "train.batch_size=128", "train.grad_accum=1"]


@pytest.fixture(scope="module")
def h100s() -> list:
    return compile_only_devices("h100", 8)


@pytest.fixture(scope="module")
def compiled(h100s) -> dict[str, Compiled]:
    """Every step this module reads, compiled once: the TINY_LAYOUTS, gpt2-124m's 'dp=8' and 'fsdp=8',
    'gpt2_one_gpu' (bf16 and fp8), 'modern', 'documents', 'context' and 'mosaic' (below), the fp8 ones with Triton GEMMs off as jaxgpt.plan compiles
    them. Lowered one at a time (tracing holds the GIL), compiled in threads (XLA:GPU's compile
    mostly runs on one core: 172 s -> 115 s on 2 cores)."""
    jobs = {name: (lower_step(tiny_config(*overrides, mesh=mesh), h100s, "h100"), None)
            for name, (mesh, overrides) in TINY_LAYOUTS.items()}
    jobs |= {mesh: (lower_step(load_config("gpt2-124m", GPT2, mesh), h100s, "h100"), None)
             for mesh in ("dp=8", "fsdp=8")}
    jobs["gpt2_one_gpu"] = lower_step(load_config("gpt2-124m", GPT2_ONE_GPU, "dp=1"), h100s[:1], "h100"), None
    # fp8 as bundled: 4 micro-batches of the same 128 x 1,024 rows, so the weights' once-per-step e4m3 copies too
    jobs["gpt2_one_gpu_fp8"] = lower_step(load_config("gpt2-124m", ["model.n_layer=2", FP8], "dp=1"), h100s[:1], "h100"), None
    jobs["modern"] = lower_step(tiny_config(*MODERN, "train.grad_accum=2", mesh="dp=2,fsdp=2,tp=2"), h100s, "h100"), None
    jobs["documents"] = lower_step(tiny_config(*DOCUMENTS, mesh="dp=2,fsdp=2,tp=2"), h100s, "h100"), None
    jobs["context"] = lower_step(tiny_config(*DOCUMENTS, mesh="dp=2,cp=2,tp=2"), h100s, "h100"), None
    if flash.unavailable_reason() is None:  # tokamax: Python >= 3.12
        jobs["mosaic"] = lower_step(tiny_config(*MODERN, *MOSAIC, mesh="fsdp=4,tp=2"), h100s, "h100"), None
    with ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 1))) as pool:
        return dict(zip(jobs, pool.map(lambda job: job[0].compile(job[1]), jobs.values())))


@pytest.fixture(scope="module")
def tiny(compiled) -> dict[str, str]:
    """name -> compiled HLO text of each tiny layout."""
    out = {}
    for name in TINY_LAYOUTS:
        c = compiled[name]
        assert c.kernel == "cudnn" and c.dtype == jax.numpy.bfloat16, (name, c.why)
        out[name] = c.compiled.as_text()
    return out


@pytest.fixture(scope="module")
def gpt2(compiled) -> dict[str, tuple]:
    """layout -> (HLO text, parameter bytes per device in fp32) for gpt2-124m."""
    return {mesh: (c.compiled.as_text(), sum(x.size for x in jax.tree.leaves(c.state.params)) * 4)
            for mesh, c in ((m, compiled[m]) for m in ("dp=8", "fsdp=8"))}


@needs_plugin
def test_every_layout_compiles_with_cudnn_attention_forward_and_backward(tiny, gpt2):
    for name, text in [*tiny.items(), *((m, t) for m, (t, _) in gpt2.items())]:
        counts = fused_attention_counts(text)
        assert counts["forward"] >= 1 and counts["backward"] >= 1, (name, counts)


@needs_plugin
def test_only_remat_full_runs_the_attention_forward_again(tiny):
    """jaxgpt/model/remat.py: every policy but `full` keeps the cuDNN forward's output and softmax
    statistics, so each layer body holds one forward call per backward call (remat=full: two, the
    second its recompute). Before the policies named the kernel, dots and dots_no_batch ran it twice too."""
    for name, (_, overrides) in TINY_LAYOUTS.items():
        counts = fused_attention_counts(tiny[name])
        forwards = 2 if "model.remat=full" in overrides else 1
        assert counts == {"forward": forwards, "backward": 1}, (name, counts)


@needs_plugin
def test_moe_moves_tokens_with_all_to_all_in_the_layer_loops(tiny):
    """jaxgpt/model/moe.py on XLA:GPU as on XLA:CPU: 2 all-to-alls forward and their 2 transposes
    backward per MoE block (ep is manual in the step), each run once per layer and micro-batch
    (2 layers x 2 micro-batches)."""
    ops = [op for op in collective_ops(tiny["dp2_ep4_moe_accum2"])[0] if op.kind == "all-to-all"]
    assert len(ops) == 4 and all(op.times == 4 for op in ops), ops


@needs_plugin
def test_one_expert_per_device_compiles_with_ragged_all_to_alls(tiny):
    """ep=8 with 8 experts (one per GPU; under GSPMD this failed in XLA:GPU's Triton GEMM tiling),
    dropless: the tokens travel by ragged all-to-alls (the GPU branch of jaxgpt/model/dropless.py),
    in the layer loops, once per layer and micro-batch."""
    text = tiny["ep8_moe_dropless_bias_accum2"]
    assert "ragged-all-to-all" in text
    assert any("ragged-all-to-all" in body for body in while_bodies(text))


@needs_plugin
def test_moe_pipeline_stages_route_tokens_with_ragged_all_to_alls(tiny):
    """MoE x pp (each stage's experts over ep=4, dropless, bias balancing): the stage shift is a
    collective-permute and the tokens reach their experts by ragged all-to-alls, both inside the
    schedule's loops."""
    bodies = while_bodies(tiny["pp2_ep4_moe_dropless_bias_accum2"])
    assert any(collectives(body)["collective-permute"] >= 1 for body in bodies)
    assert any("ragged-all-to-all" in body for body in bodies)


@needs_plugin
def test_pipeline_stages_pass_activations_with_collective_permutes(tiny):
    """jaxgpt/parallel/pipeline.py on XLA:GPU: the stage shift is a collective-permute inside the schedule's
    loop (forward and backward); GPipe moves no weights (no all-to-all), the circular schedule
    reorders the block weights into stage-major order and back with all-to-alls."""
    for name in ("pp2_dp2_tp2", "pp2_fsdp4_circular_accum2_remat_full_fp8"):
        assert sum(collectives(body)["collective-permute"] >= 1 for body in while_bodies(tiny[name])) >= 2, name
    assert collectives(tiny["pp2_dp2_tp2"])["all-to-all"] == 0
    assert collectives(tiny["pp2_fsdp4_circular_accum2_remat_full_fp8"])["all-to-all"] > 0


@needs_plugin
def test_dp_all_reduces_gradients_once_per_step(gpt2):
    """gpt2-124m dp=8 with 16 micro-batches: every all-reduce runs once per step, not per micro-batch
    or layer, and together they are one fp32 gradient (plus scalars: loss, fp8-free here)."""
    text, param_bytes = gpt2["dp=8"]
    ops = [op for op in collective_ops(text)[0] if op.kind == "all-reduce"]
    assert ops and all(op.times == 1 for op in ops), [(op.bytes, op.times) for op in ops]
    assert param_bytes <= sum(op.bytes for op in ops) < 1.01 * param_bytes
    assert collectives(text)["all-gather"] == collectives(text)["reduce-scatter"] == 0


@needs_plugin
def test_dp_with_accumulation_and_fp8_still_all_reduces_once(tiny):
    big = [op for op in collective_ops(tiny["dp8_accum2_fp8"])[0] if op.kind == "all-reduce" and op.bytes > 64]
    assert big and all(op.times == 1 for op in big)  # per-micro-batch ones would run grad_accum times


def _instructions(text: str) -> tuple[dict, dict]:
    """The compiled HLO's computations (name -> instructions) and every instruction by name."""
    comps, _ = cost.parse_module(text)
    return comps, {i.name: i for body in comps.values() for i in body}


def _arrays_of(text: str, elements: int) -> list[tuple[str, int, int, list[str]]]:
    """The memory-bound kernels (not GEMMs, not attention) of one step that read or write an array of
    `elements` elements: (kernel, how many such operands it reads, how many such results it
    writes, their element types)."""
    from jaxgpt.gpu import cost, perf

    def sized(shape: str) -> list[str]:
        return [dtype for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]", shape)
                if math.prod(int(d) for d in dims.split(",") if d) == elements]

    _, instrs = _instructions(text)
    out = []
    for k in cost.kernels(text, perf.perf("h100"))[0]:
        if k.group not in (cost.GEMM, cost.ATTENTION):
            i = instrs[k.name]
            reads = [t for o in i.operands if o in instrs for t in sized(instrs[o].shape)]
            if reads or sized(i.shape):
                out.append((k.name, len(reads), len(sized(i.shape)), reads + sized(i.shape)))
    return out


@needs_plugin
@pytest.mark.guards("norm_vjp", "gelu_derivative")
def test_norm_and_gelu_backward_move_only_bf16_rows(compiled):
    """gpt2-124m's micro-batch on one H100 (128 x 1,024 rows of D=768, F=3072): no memory-bound
    kernel of the norms writes an fp32 [rows, D] tensor (with autodiff's norm backward these 2
    layers wrote seven, five of them g * xhat for dscale's column sum: jaxgpt/lowering/norm.py); two
    are the embedding's, its sum written in fp32 beside the rounded one and the first norm's dx in
    fp32 for its scatter (a forward barrier kept them out until it was retired: 0.1% of the step,
    docs/ops.md); and the tanh-GELU's
    [rows, F] traffic is its minimum: per layer, the forward reads h and writes gelu(h) and its
    derivative, the backward's product g gelu'(h) runs in the epilogue of the MLP out GEMM that
    writes g, which reads the derivative (jaxgpt/lowering/activations.py gelu_tanh_keeping_derivative), and
    only c_fc's bias gradient reads dh, each bf16. Keeping h instead, the backward read h and g and
    wrote dh in a pass of its own (gelu_tanh). At 4 x 1,024 rows a device (the dp=8 step) XLA still
    writes g * xhat: not asserted there."""
    text = compiled["gpt2_one_gpu"].compiled.as_text()
    _, instrs = _instructions(text)
    rows, D, F, L = 128 * 1024, 768, 3072, 2
    wide_f32 = [k for k in _arrays_of(text, rows * D) if k[2] and "f32" in k[3][k[1]:]]
    assert len(wide_f32) <= 2, wide_f32  # the embedding's two
    gelu = _arrays_of(text, rows * F)
    assert {t for k in gelu for t in k[3]} == {"bf16"}, gelu
    assert sorted((r, w) for _, r, w, _ in gelu) == [(1, 0)] * L + [(1, 2)] * L, gelu
    dx = [i for k in cost.kernels(text, perf.perf("h100"))[0] if k.group == cost.GEMM
          and "/mlp_out/" in _op_name(i := instrs[k.name]) and "transpose(" in _op_name(i)
          and _elements(i.shape) == rows * F]
    assert len(dx) == L and all(sum(_elements(instrs[o].shape) == rows * F for o in i.operands if o in instrs) == 1
                                for i in dx), [i.name for i in dx]


@needs_plugin
@pytest.mark.guards("qkv_gemms")
def test_q_k_and_v_come_from_their_own_gemms_with_the_bias_in_the_epilogue(compiled):
    """gpt2-124m's micro-batch on one H100 (2 layers, bf16): attention's q, k and v are a GEMM each,
    on its slice of c_attn [D, 3, H, K], with the bias added in the GEMM's epilogue, and cuDNN's
    kernels read them as the GEMMs wrote them (jaxgpt/lowering/ops.py `Lowering._parts`). No memory-bound
    kernel reads a q, k or v GEMM's output, nor reads or writes a [rows, 3D] array: one GEMM for all
    three wrote [B, T, 3, H, K], split with the bias by a pass of its own per layer, and the three
    gradients were joined by another for its backward GEMMs (gpt2-124m on one H100, 981.8 -> 956.6
    ms a step predicted)."""
    text = compiled["gpt2_one_gpu"].compiled.as_text()
    _, instrs = _instructions(text)
    rows, D, L = 128 * 1024, 768, 2
    assert not _arrays_of(text, rows * 3 * D)
    forward = {k.name for k in cost.kernels(text, perf.perf("h100"))[0]
               if k.group == cost.GEMM and "/qkv/" in instrs[k.name].line and "transpose(" not in instrs[k.name].line}
    assert len(forward) == 3 * L and all(_elements(instrs[g].shape) == rows * D for g in forward), forward
    read = [i.name for i in _memory_bound(text, instrs) if any(_source(instrs, o)[0] in forward for o in i.operands)]
    assert not read, read


def _op_name(instr) -> str:
    m = re.search(r'op_name="([^"]*)"', instr.line)
    return m.group(1) if m else ""


@needs_plugin
@pytest.mark.guards("norm_recompute", "residual_epilogue", "qkv_bias_drop")
def test_forward_norms_are_one_pass_and_the_residual_add_rides_in_the_gemms(compiled):
    """gpt2-124m's micro-batch on one H100 (2 layers, bf16). In each block's forward the only
    memory-bound kernels that touch a residual-stream-sized array (rows x D) are its two norms,
    each reading x once and writing y once (XLA:GPU's Triton normalization fusion: jaxgpt/lowering/norm.py
    recomputes the statistics in the backward); the residual adds run in attention's and the MLP's
    c_proj GEMMs, which read the stream beside their input (jaxgpt/lowering/ops.py `Lowering.residual`). Keeping
    the statistics each norm was three kernels (the row mean with the residual add, the variance,
    y): gpt2-124m 956.6 -> 934.9 ms a step predicted. And only q's GEMM adds a bias (k's cancels in
    softmax, v's goes into attn_out's: jaxgpt/lowering/ops.py `Lowering._parts`)."""
    text = compiled["gpt2_one_gpu"].compiled.as_text()
    _, instrs = _instructions(text)
    rows, D, F, L = 128 * 1024, 768, 3072, 2
    forward = [k for k in _arrays_of(text, rows * D)
               if "jvp()/eval_jaxpr" in (op := _op_name(instrs[k[0]])) and "transpose(" not in op]
    assert sorted((r, w) for _, r, w, _ in forward) == [(1, 1)] * 2 * L, forward
    gemms = [i for k in cost.kernels(text, perf.perf("h100"))[0] if k.group == cost.GEMM
             and "transpose(" not in _op_name(i := instrs[k.name])]
    sizes = lambda i: sorted(_elements(instrs[o].shape) for o in i.operands if o in instrs)  # noqa: E731
    for name, wide in (("/attn_out/", [rows * D, rows * D]), ("/mlp_out/", [rows * D, rows * F])):
        proj = [sizes(i)[-2:] for i in gemms if name in _op_name(i)]
        assert proj == [wide] * L, (name, proj)
    qkv = [sizes(i) for i in gemms if "/qkv/" in _op_name(i)]
    assert len(qkv) == 3 * L and sum(D in s for s in qkv) == L, qkv


@needs_plugin
@pytest.mark.guards("norm_vjp", "routed_bias")
def test_layernorm_backward_sums_dscale_and_dbias_in_the_pass_that_writes_dx(compiled):
    """gpt2-124m's micro-batch on one H100 (2 layers, bf16): the hand-written LayerNorm backward
    (jaxgpt/lowering/norm.py) sums dscale and dbias in the kernel that writes dx: no memory-bound
    kernel reads the norm's input and its incoming gradient, two [rows, D] arrays, only to sum
    columns (one such pass at most: layer 0's ln_1, whose dx goes to the embedding).

    And the residual branches' bias sums (attention's and the MLP's c_proj, whose bias is in their
    GEMMs' epilogues: jaxgpt/lowering/ops.py `Lowering.linear`) ride in the dx pass of the norm
    after them: ln_1 and ln_2 route their own bias's gradient through the linears they feed
    (`Lowering.norm`, routed_bias: a GEMV each), which leaves that pass one column sum of its own.
    At most the last block's MLP sums its bias in a pass of its own, reading the one gradient (ln_f
    routes nothing). With each norm summing its bias, each branch bias was such a pass."""
    text = compiled["gpt2_one_gpu"].compiled.as_text()
    _, instrs = _instructions(text)
    rows, D = 128 * 1024, 768
    column_sums, lone = [], []
    for k in _memory_bound(text, instrs):
        outputs = re.findall(r"\b[a-z][a-z0-9]*\[[\d,]*\]", k.shape)
        if not (all(_elements(s) <= rows * D // 64 for s in outputs) and all(s.endswith(f"{D}]") for s in outputs)):
            continue
        wide = sum(_elements(instrs[o].shape) == rows * D for o in k.operands if o in instrs)
        if wide >= 2:
            column_sums.append((k.name, k.shape))
        elif wide == 1:
            lone.append((k.name, _op_name(instrs[k.name])))
    assert len(column_sums) <= 1, column_sums
    assert len(lone) <= 1 and all("/mlp_out/" in op for _, op in lone), lone


@needs_plugin
@pytest.mark.guards("fused_loss")
def test_head_writes_bf16_logits_and_passes_over_them_twice(compiled):
    """gpt2-124m's micro-batch on one H100: each loss chunk is 8,192 rows (128 sequences x 64
    positions) of the 50,304 padded vocabulary. Its logits GEMM writes them in bf16, and two
    memory-bound kernels touch such an array, both in bf16: the one-pass max and sum reads the
    logits, the exp pass reads them and writes e for the two gradient GEMMs (jaxgpt/lowering/loss.py).
    With fp32 logits those were 4-byte arrays: 1,031.5 -> 991.2 ms predicted for the whole step."""
    text = compiled["gpt2_one_gpu"].compiled.as_text()
    head = _arrays_of(text, 8192 * 50304)
    assert sorted((r, w) for _, r, w, _ in head) == [(1, 0), (1, 1)], head
    assert {t for k in head for t in k[3]} == {"bf16"}, head
    assert re.search(r"= bf16\[8192,50304\]\S* (fusion|custom-call)\(", text)
    assert not re.search(r"= f32\[8192,50304\]", text)


@needs_plugin
@pytest.mark.guards("fp8_pins")
def test_fp8_casts_activations_and_gradients_from_bf16(compiled):
    """gpt2-124m's micro-batch on one H100 with model.fp8=true (128 x 1,024 rows, D=768, F=3072):
    every f8 copy of an activation or gradient is cast from a bf16 array, none from fp32, and no
    kernel writes an fp32 [rows, D] or [rows, F] array. Before power-of-two scales every fp8 GEMM
    wrote fp32 for the next fusion to rescale; without `quantize(pin=True)` on the incoming
    gradient XLA:GPU dropped the GELU backward's rounding and wrote dh in fp32 (1.6 GB a layer and
    micro-batch) for the e5m2 cast to read back (jaxgpt/lowering/fp8.py)."""
    text = compiled["gpt2_one_gpu_fp8"].compiled.as_text()
    rows, D, F = 128 * 1024, 768, 3072
    for n in (rows * D, rows * F):
        arrays = _arrays_of(text, n)
        casts = [k for k in arrays if any(t.startswith("f8") for t in k[3][k[1]:])]
        assert casts and not [k for k in casts if "f32" in k[3][:k[1]]], casts
        assert not [k for k in arrays if "f32" in k[3][k[1]:]], arrays


@needs_plugin
@pytest.mark.guards("activation_amax", "prequantize")
def test_fp8_gelu_is_computed_where_it_is_cast(compiled):
    """gpt2-124m's micro-batch on one H100 with model.fp8=true: the MLP's activation gelu(h) exists
    only as its two e4m3 copies (the GEMM's and the transposed one for dw), written by the kernel
    that computes it from h; per layer the only [rows, F] array a memory-bound kernel writes in bf16
    is the backward's dh. h itself, with its bias, is the MLP in GEMM's output (cuBLASLt's epilogue:
    jaxgpt/lowering/fp8.py `_pre_forward`), which its amax pass reads without writing it again; with the bias
    added after the GEMM that pass wrote h a second time (gpt2-124m fp8, 923.0 -> 908.3 ms a step
    predicted). Its amax comes from h's largest value (jaxgpt/lowering/activations.py activation_amax);
    reducing gelu(h) itself made XLA write gelu(h) in bf16 for the reduction and the cast to read
    (3 bf16 writes a layer)."""
    text = compiled["gpt2_one_gpu_fp8"].compiled.as_text()
    rows, F, L = 128 * 1024, 3072, 2
    writes = [t for k in _arrays_of(text, rows * F) for t in k[3][k[1]:]]
    assert writes.count("bf16") == L and writes.count("f8e4m3fn") == 2 * L, writes


@needs_plugin
@pytest.mark.guards("norm_amax")
def test_fp8_norm_outputs_are_cast_without_a_pass_for_their_amax(compiled):
    """gpt2-124m's micro-batch on one H100 with model.fp8=true: the two norms that feed fp8 GEMMs
    (ln_1 -> q, k, v; ln_2 -> the MLP's in) give their e4m3 casts a bound on max |y| from their own
    statistics (jaxgpt/lowering/norm.py `normalize_with_amax`: the row maxima of |x - mean| in the pass that
    sums the variance), so no forward kernel under the qkv or mlp_in scope reads a [rows, D] array
    to reduce it: each such max was a pass of its own over the norm's output (gpt2-124m fp8,
    908.3 -> 900.6 ms a step predicted; gpt2-1.3b 3,086.7 -> 3,061.6)."""
    text = compiled["gpt2_one_gpu_fp8"].compiled.as_text()
    _, instrs = _instructions(text)
    rows, D = 128 * 1024, 768
    maxima = [(k.name, op) for k in _memory_bound(text, instrs)
              if "reduce_max" in (op := _op_name(instrs[k.name])) and "transpose(" not in op
              and re.search(r"/(qkv|mlp_in)/", op)
              and any(_elements(instrs[o].shape) == rows * D for o in k.operands if o in instrs)]
    assert not maxima, maxima


def _source(instrs: dict, name: str) -> tuple[str, int]:
    """The kernel result (instruction, tuple index) an operand is, through tuples and bitcasts."""
    i = instrs[name]
    if i.opcode == "get-tuple-element":
        return i.operands[0], int(re.search(r"index=(\d+)", i.line).group(1))
    if i.opcode in ("bitcast", "copy") and i.operands[0] in instrs:
        return _source(instrs, i.operands[0])
    return name, 0


def _elements(shape: str) -> int:
    """The element count of an array shape ('bf16[128,768]{1,0}' -> 98304)."""
    return math.prod(int(d) for d in re.search(r"\[([\d,]*)\]", shape).group(1).split(",") if d)


def _memory_bound(text: str, instrs: dict) -> list:
    """The instructions of the step's memory-bound kernels (not GEMMs, not attention)."""
    return [instrs[k.name] for k in cost.kernels(text, perf.perf("h100"), 1)[0]
            if k.group not in (cost.GEMM, cost.ATTENTION) and k.name in instrs]


def _reducers(comps: dict, fusion_line: str) -> set[str]:
    """The ops ('add', 'maximum', ...) the reductions inside a fusion combine with."""
    called = re.search(r"calls=%([\w.\-]+)", fusion_line)
    body = comps.get(called.group(1), []) if called else []
    regions = [re.search(r"to_apply=%([\w.\-]+)", i.line).group(1) for i in body if i.opcode == "reduce"]
    return {next(i.opcode for i in comps[r] if i.root) for r in regions}


@needs_plugin
@pytest.mark.guards("fp8_pins")
def test_fp8_gradient_is_read_once_for_its_amax_and_bias_gradient(compiled):
    """gpt2-124m's micro-batch on one H100 with model.fp8=true: no memory-bound kernel reads a bf16
    gradient that is cast to e5m2 only to take its maximum. The amax is reduced over the rows first,
    the bias gradient's shape, so XLA:GPU computes it in the kernel that sums the bias gradient
    (jaxgpt/lowering/fp8.py `_column_amax`). As one full reduction it took a kernel of its own: the qkv
    gradient [rows, 3D] and attn_out's and mlp_out's [rows, D] were each read once more per layer
    and micro-batch (gpt2-1.3b fp8: 3,333.4 -> 3,277.6 ms predicted)."""
    text = compiled["gpt2_one_gpu_fp8"].compiled.as_text()
    comps, instrs = _instructions(text)
    source = lambda name: _source(instrs, name)  # noqa: E731
    kernels = _memory_bound(text, instrs)
    rows = 128 * 1024
    gradients = {source(o) for k in kernels if "f8e5m2[" in k.shape for o in k.operands
                 if o in instrs and re.match(r"bf16\[", instrs[o].shape)
                 and _elements(instrs[o].shape) % rows == 0}
    assert len(gradients) == 2 * 4, gradients  # per layer: qkv, attn_out, mlp_in, mlp_out
    max_only = [(k.name, g) for k in kernels for g in gradients
                if any(source(o) == g for o in k.operands if o in instrs) and _reducers(comps, k.line) == {"maximum"}]
    assert not max_only, max_only


@needs_plugin
@pytest.mark.guards("fp8_pins", "prequantize")
def test_fp8_gemm_outputs_are_rescaled_inside_the_gemm_or_their_consumer(compiled):
    """gpt2-124m's micro-batch on one H100 with model.fp8=true: no memory-bound kernel reads an fp8
    GEMM's output and nothing else but scalars, only to multiply it by the two scales (the GELU
    backward reads two, the MLP out dx GEMM's g and the MLP in GEMM's h). A forward
    GEMM's rescale rides in the fusion that adds its bias; a dx GEMM's is cuBLASLt's own scale
    operand (`scaled_dot(fold=True)`): attn_out's dx is cuDNN's dO, and a custom call takes no
    fused producer, so its rescale was a [rows, D] pass of its own per layer and micro-batch
    (gpt2-1.3b fp8: 3,277.6 -> 3,256.4 ms predicted)."""
    text = compiled["gpt2_one_gpu_fp8"].compiled.as_text()
    _, instrs = _instructions(text)
    fp8_gemms = {i.name for i in instrs.values() if "__cublas$lt$matmul$f8" in i.line}
    rescales = []
    for k in _memory_bound(text, instrs):
        big = [o for o in k.operands if o in instrs and _elements(instrs[o].shape) > 1]
        if len(big) == 1 and _source(instrs, big[0])[0] in fp8_gemms and "(" not in k.shape \
                and _elements(k.shape) == _elements(instrs[big[0]].shape):
            rescales.append((k.name, k.shape))
    assert fp8_gemms and not rescales, rescales


def _f8_only_kernels(text: str, gpus: int) -> list[tuple[str, int, str, list[int], set[str], list]]:
    """The kernels of a compiled step that read only fp8 arrays (and s32 indices) and write fp8:
    copies, slices, transposes of e4m3/e5m2 arrays. Each as (name, executions a step, result
    type, operand element counts, the ops it runs besides bitcasts and index arithmetic, and for
    each operand where its data comes from: (instruction or None, its ops, whether it is in the
    kernel's own computation)). Where it comes from is traced through get-tuple-elements, bitcasts, copies and loops:
    a loop body's parameter is what the loop was given (a weight's once-a-step copy, made by the
    cast before the loop), and a loop's result is the loop itself (a stack of saved activations
    its iterations wrote)."""
    comps, instrs = _instructions(text)
    types = lambda shape: re.findall(r"\b([a-z][a-z0-9]*)\[", shape)  # noqa: E731
    caller = {}  # loop body -> the while instruction that runs it
    for i in instrs.values():
        if i.opcode == "while" and (m := re.search(r"body=%([\w.\-]+)", i.line)):
            caller[m.group(1)] = i
    home = {j.name: comp for comp, body in comps.items() for j in body}

    def ops(i) -> set[str]:
        if not (m := re.search(r"calls=%([\w.\-]+)", i.line)):
            return {i.opcode}
        return {o for j in comps[m.group(1)] for o in (ops(j) if j.opcode == "fusion" else {j.opcode})
                if o not in ("parameter", "constant", "bitcast", "tuple", "get-tuple-element")
                and not re.match(r"(s32|u32|pred)\[\]", j.shape)}

    def origin(name: str, index: list[int] | None = None):
        i, index = instrs.get(name), list(index or [])
        while i is not None:
            if i.opcode == "get-tuple-element":
                index.append(int(re.search(r"index=(\d+)", i.line).group(1)))
                i = instrs.get(i.operands[0])
            elif i.opcode == "tuple" and index:
                i = instrs.get(i.operands[index.pop()])
            elif i.opcode == "parameter" and index and home.get(i.name) in caller:
                i = instrs.get(caller[home[i.name]].operands[0])  # the loop's own operand
            elif i.opcode in ("bitcast", "copy") and i.operands:
                i = instrs.get(i.operands[0])
            else:
                return i
        return None

    out = []
    for k in cost.kernels(text, perf.perf("h100"), gpus)[0]:
        i = instrs.get(k.name)
        if k.group in (cost.GEMM, cost.ATTENTION) or i is None or i.opcode.startswith(("all-", "collective")):
            continue
        operands = [instrs[o].shape for o in i.operands if o in instrs]
        ins = [t for shape in operands for t in types(shape)]
        if ins and all(t.startswith("f8") or t == "s32" for t in ins) and any(t.startswith("f8") for t in types(i.shape)):
            sources = [origin(o) for o in i.operands if not re.match(r"s32\[", instrs[o].shape)]
            out.append((k.name, k.times, i.shape, [_elements(s) for s in operands], ops(i),
                        [(p, set(), False) if p is None else (p, ops(p), home.get(p.name) == home.get(k.name))
                         for p in sources]))
    return out


@needs_plugin
@pytest.mark.guards("prequantize", "fp8_pieces")
def test_fp8_moves_no_standalone_f8_copy_per_micro_batch(compiled):
    """gpt2-124m with model.fp8=true as bundled (2 of its layers, 4 micro-batches of 128 x 1,024
    rows, one H100): no kernel of the micro-batch loop reads only fp8 arrays and writes fp8 ones (a
    copy or a transpose of an e4m3/e5m2 array, issue 38 item 1). Every f8 copy is written by the
    kernel that casts it, with its transposed twin for the dw GEMM where one is needed. What
    remains runs once a step and reads a block weight's e4m3 copy: attn_out's transposed per layer,
    each layer's QKV weight, and its q, k and v slices for their own forward GEMMs (once a step,
    where slicing the copy in the loop copied each slice every micro-batch)."""
    D, F, L = 768, 3072, 2
    weights = {n * layers for n in (D * 3 * D, D * D, D * F) for layers in (1, L)}
    f8_only = _f8_only_kernels(compiled["gpt2_one_gpu_fp8"].compiled.as_text(), 1)
    assert f8_only and all(times == 1 and any(n in weights for n in reads) for _, times, _, reads, *_ in f8_only), f8_only


@needs_plugin
def test_xla_slices_a_stacked_bf16_gemm_operand_in_place_but_copies_an_fp8_one(h100s):
    """Why a scanned model in fp8 copies f8 arrays inside its layer loop (the layer's slice of each
    weight's once-a-step e4m3 copy, and its saved e4m3 activations into and out of their stack),
    where a bf16 model reads them in place: XLA:GPU's dynamic-slice fusion hands a cuBLASLt GEMM
    the address of its operand's slice, for `__cublas$lt$matmul` but not for the fp8 call
    `__cublas$lt$matmul$f8`, so an fp8 GEMM reads a copy of the slice. The llama-8b slice with
    fp8 (4 scanned layers, one H100) spends 19.9 of its 5,679.8 ms a step predicted on such
    copies. When XLA extends the fusion to fp8 calls this fails: then drop the allowance for loop
    slices in test_fp8_layouts_copy_block_weights_only_where_the_loop_or_the_gather_must."""
    from jaxgpt.gpu.target import FP8_OPTIONS

    def layers(x, ws):
        def body(i, acc):
            w = jax.lax.dynamic_index_in_dim(ws, i, keepdims=False)
            return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jax.numpy.bfloat16)
        return jax.lax.fori_loop(0, ws.shape[0], body, jax.numpy.zeros((x.shape[0], ws.shape[1]), jax.numpy.bfloat16))

    one = jax.sharding.SingleDeviceSharding(h100s[0])
    in_place = {}
    for dtype, gemm in ((jax.numpy.bfloat16, "__cublas$lt$matmul"), (jax.numpy.float8_e4m3fn, "__cublas$lt$matmul$f8")):
        x = jax.ShapeDtypeStruct((1024, 512), dtype, sharding=one)
        ws = jax.ShapeDtypeStruct((4, 768, 512), dtype, sharding=one)
        text = jax.jit(layers).lower(x, ws).compile(FP8_OPTIONS).as_text()
        assert f'custom_call_target="{gemm}"' in text, dtype
        in_place[jax.numpy.dtype(dtype).name] = '"custom_fusion_config":{"name":"dynamic_slice_fusion"' in text
    assert in_place == {"bfloat16": True, "float8_e4m3fn": False}


@needs_plugin
@pytest.mark.guards("prequantize")
def test_fp8_layouts_copy_block_weights_only_where_the_loop_or_the_gather_must(compiled):
    """Issue 38 item 1 on every fp8 layout: a kernel that runs more than once a step (in the
    micro-batch or the layer loop) and moves only fp8 data is one of the kinds XLA needs:
    - a scanned layer's slice of a stacked f8 array, or its write into one (and the stack's
      initial fill): a GEMM cannot read an f8 slice in place (the test above). A slice of saved
      activations (a stack the forward loop wrote) may be transposed for the dw GEMM as it is
      copied; a slice of a weight's once-a-step copies may not (it is made in the GEMM's layout);
    - under fsdp, the transpose of a weight the all-gather returned (grouped-query q and kv joined
      in it), for the forward GEMM's K-major operand. Gathering a transposed copy as well
      (prequantize's q_t) would trade it for a second gather a use: llama-8b on 8 H100s, fsdp=8,
      5,282.3 -> 5,250.8 ms predicted, but 1.36x the all-gather bytes, not item 2's half of bf16's.
    Never a copy or transpose of a block weight's e4m3 copy otherwise (making q_t nowhere: dp8's
    scanned layers transpose a weight's slice per layer, which fails here). On the strict layouts
    also no activation's or gradient's: each cast writes its transposed twin itself. Not so on
    the layouts with 2 sequences a device and micro-batch (fsdp8_remat_full_fp8,
    dp4_tp2_remat_dots_no_batch_fp8, modern), where XLA transposes a cast's output in a kernel of
    its own at these widths (at gpt2-124m's, 2 layers on fsdp=8 with remat=full, it does so for the
    recomputed norms' outputs: 0.41 of 95.8 ms a step predicted), nor on the pipeline's and the
    fp8 head's (the head transposes its e4m3 table once a micro-batch, in a kernel of its own, for
    its dx GEMMs; unpinned, in every chunk: jaxgpt/lowering/loss.py): there a kernel may also
    transpose the output of a cast in its own loop body (or the fp8 head's table), no more."""
    strict = {"dp8_accum2_fp8", "fsdp8_accum2_remat_full_fp8", "dp2_fsdp4_accum2_remat_dots_fp8"}
    assert strict <= set(FP8_LAYOUTS)
    for name in [*FP8_LAYOUTS, "modern"]:
        mesh, overrides = TINY_LAYOUTS.get(name) or ("dp=2,fsdp=2,tp=2", MODERN)
        m = tiny_config(*overrides, mesh=mesh).model
        table = m.padded_vocab * m.n_embd // (2 if "tp=2" in mesh else 1)  # the fp8 head's, split over tp
        moved = []
        for kernel, times, shape, reads, ops, sources in _f8_only_kernels(compiled[name].compiled.as_text(), 8):
            sliced = bool(ops & {"dynamic-slice", "dynamic-update-slice"})
            loop = sliced and ops <= {"dynamic-slice", "dynamic-update-slice", "slice", "concatenate", "copy"}
            saved = sliced and ops <= {"dynamic-slice", "transpose"} and all(
                p is not None and p.opcode == "while" for p, _, _ in sources)  # a saved activation's slice
            fill = ops == {"copy"} and all(p_ops == {"broadcast"} for _, p_ops, _ in sources)
            gathered = "transpose" in ops and ops <= {"transpose", "concatenate"} and all(
                p is not None and p.opcode.startswith("all-gather") for p, _, _ in sources)
            if times == 1 or loop or saved or fill or gathered:
                continue
            # elsewhere only a cast's output, transposed apart (or the fp8 head's table, each chunk)
            cast = all(p is not None and p.opcode == "fusion" and "convert" in p_ops and own
                       for p, p_ops, own in sources)
            if name in strict or not (cast or (m.fp8_head and reads == [table])):
                moved.append((kernel, times, shape, sorted(ops), [p and p.name for p, _, _ in sources]))
        assert not moved, (name, moved)


@needs_plugin
@pytest.mark.guards("prequantize")
def test_fp8_weights_are_quantized_once_per_step_not_per_micro_batch(compiled):
    """With micro-batches (grad_accum 2) under dp, dp x fsdp and dp x fsdp x tp, GPT-2's block and
    the modern one (grouped-query q and kv weights, SwiGLU's gate), every kernel that casts a block
    weight to e4m3 runs once per step, before the micro-batch loop, and writes the layouts the GEMMs
    read (jaxgpt/copies.py). Quantized inside the loop, as before, each ran
    once per micro-batch and layer (4 times here)."""
    for name in ("dp8_accum2_fp8", "dp2_fsdp4_accum2_remat_dots_fp8", "fsdp8_accum2_remat_full_fp8",
                 "dp2_fsdp2_tp2_accum2_fp8_head", "modern"):
        c = compiled[name]
        text = c.compiled.as_text()
        weights = {",".join(map(str, leaf.sharding.shard_shape(leaf.shape)))
                   for path, leaf in jax.tree_util.tree_leaves_with_path(c.state.params)
                   if path[0].key == "blocks" and str(path[-1].key).endswith("_kernel")}
        _, instrs = _instructions(text)
        casts = [(k.name, k.times) for k in cost.kernels(text, perf.perf("h100"), 8)[0]
                 if (i := instrs.get(k.name)) and "f8e4m3fn" in i.shape
                 and any(dims in weights and not dtype.startswith("f8") for o in i.operands if o in instrs
                         for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]", instrs[o].shape))]
        assert len(casts) >= 4 and all(times == 1 for _, times in casts), (name, casts)


def _gathered(text: str) -> list[tuple[str, str]]:
    """(element type, dims) of every array an all-gather returns, e.g. ('bf16', '768,3072')."""
    out = []
    for line in text.splitlines():
        if m := re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.*?) all-gather(?:-start)?\(", line):
            out += re.findall(r"\b([a-z0-9]+)\[([\d,]+)\]", m.group(1))
    return out


@needs_plugin
@pytest.mark.guards("grads_in_gemm", "precast")
def test_weight_gradients_are_summed_inside_their_gemms(compiled):
    """gpt2-124m on dp=8 (2 unrolled layers, 16 micro-batches, bf16): the sum of each block weight's
    gradient over the micro-batches is taken in the GEMM that computes it (jaxgpt/step.py sums them
    per layer, jaxgpt/lowering/linear.py `_precast_einsum` writes them in fp32): the MLP weights'
    gradient GEMMs read their fp32 sums, and no kernel of the micro-batch loop writes an fp32 array
    of a stacked [L, ...] weight's shape (q, k and v's gradients are summed each on its own,
    `gemm_pieces`: their GEMMs split K at this size, and the kernel that adds the parts adds the
    sum too). Summed as stacks, every micro-batch gathered the layers' gradients into one and
    added it in a pass of its own (gpt2-1.3b: 4,111.6 -> 4,037.5 ms predicted)."""
    c = compiled["dp=8"]
    text = c.compiled.as_text()
    _, instrs = _instructions(text)
    kernels = [(i, k) for k in cost.kernels(text, perf.perf("h100"), 8)[0] if (i := instrs.get(k.name))]
    blocks = [leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(c.state.params)
              if path[0].key == "blocks" and str(path[-1].key).endswith("_kernel")]
    stacked = {",".join(map(str, shape)) for shape in blocks}
    written = [(i.name, d) for i, k in kernels if k.times == 16 for d in re.findall(r"\bf32\[([\d,]*)\]", i.shape)
               if d in stacked]
    assert not written, written
    summing = [i.name for i, k in kernels if k.group == cost.GEMM and k.times == 16
               and (out := re.match(r"f32\[([\d,]*)\]", i.shape))
               and any(instrs[o].shape.startswith(f"f32[{out.group(1)}]") for o in i.operands if o in instrs)]
    assert len(summing) >= 2 * 2, summing  # MLP in and out in each layer (attention-out's, q's, k's and v's split K)


@needs_plugin
def test_fsdp_gathers_bf16_weights_and_reduce_scatters_gradients(gpt2):
    """gpt2-124m fsdp=8: every block weight matrix (QKV, attention-out, MLP in and out) is cast to
    bf16 before it is gathered, half the bytes of fp32, and gradients leave the micro-batch loop
    as reduce-scatters (XLA:GPU; XLA:CPU writes all-reduce + slice)."""
    text, _ = gpt2["fsdp=8"]
    block = [dtype for dtype, dims in _gathered(text) if dims in ("768,3,12,64", "768,64,12", "768,3072")]
    assert len(block) >= 4 and set(block) == {"bf16"}, block
    assert any(collectives(body)["reduce-scatter"] >= 1 for body in while_bodies(text))


FSDP_LAYOUTS = [name for name, (mesh, _) in TINY_LAYOUTS.items() if "fsdp" in mesh]


@needs_plugin
@pytest.mark.guards("tables_in_compute_dtype")
def test_fsdp_gathers_no_fp32_table(compiled):
    """Issue 59 item 1, on every fsdp layout compiled here (GPT-2's and the modern block, fp8,
    micro-batches, remat, a pipeline, the fp8 head, document masking, gpt2-124m): the embedding and
    head tables (wte, wpe, lm_head) are gathered in bf16, once a step, from copies cast where each
    shard lives (jaxgpt/copies.py `table_copies`), never in fp32: no all-gather returns an
    fp32 array of a table's shard size or more (wte's [V, D] split at most over fsdp x tp) or of
    wpe's [T, D]; and a bf16 one does. Before, XLA's sharding propagation carried the gathered
    layout back through the cast and gathered the fp32 parameters: llama-tiny on fsdp=4,tp=2, 49.1
    of the 50.5 MiB gathered a step (docs/ops.md)."""
    names = [*FSDP_LAYOUTS, "fsdp=8", "modern", "documents", *(["mosaic"] if "mosaic" in compiled else [])]
    for name in names:
        mesh, overrides = TINY_LAYOUTS.get(name) or {"modern": ("dp=2,fsdp=2,tp=2", MODERN),
                                                      "documents": ("dp=2,fsdp=2,tp=2", DOCUMENTS),
                                                      "mosaic": ("fsdp=4,tp=2", [*MODERN, *MOSAIC])}.get(name, (name, GPT2))
        m = (load_config("gpt2-124m", overrides, mesh) if name == "fsdp=8" else tiny_config(*overrides, mesh=mesh)).model
        shard = m.padded_vocab * m.n_embd // 16
        gathered = [(dtype, dims) for dtype, dims in _gathered(compiled[name].compiled.as_text())]
        tables = [(dtype, dims) for dtype, dims in gathered if dtype in ("f32", "bf16") and (
                  math.prod(map(int, dims.split(","))) >= shard or dims in (f"{m.seq_len},{m.n_embd}", f"{m.n_embd},{m.seq_len}"))]
        assert tables and {dtype for dtype, _ in tables} == {"bf16"}, (name, tables)


@needs_plugin
def test_a_recomputed_block_casts_with_the_forwards_fp8_scales(tiny):
    """Every remat policy keeps fp8's per-tensor scales (jaxgpt/model/remat.py): the forward that a
    recomputing block runs again in the backward pass casts its activations with them, and takes no
    amax of its own (no reduce_max under the rematerialised computation's name). Without them each
    recomputed activation was read once more for its amax, and under fsdp all-reduced again."""
    remats = [name for name in FP8_LAYOUTS if any(o.startswith("model.remat=") for o in TINY_LAYOUTS[name][1])]
    assert len(remats) >= 3, remats
    for name in remats:
        again = [line for line in tiny[name].splitlines() if "reduce_max" in line and "rematted_computation" in line]
        assert not again, (name, again[0][:300])


@needs_plugin
def test_tp_collectives_sit_inside_the_layer_loop(tiny):
    for name in ("dp4_tp2_remat_dots_no_batch_fp8", "dp2_fsdp2_tp2_accum2_fp8_head"):
        tp_in_loops = [op for op in collective_ops(tiny[name])[0] if op.kind == "all-reduce" and op.times >= 2]
        assert tp_in_loops, name  # the 2 layers' row-parallel partial sums


def _block_gemms(text: str) -> collections.Counter:
    """(layer, role) -> how many GEMM calls of the blocks' linear layers the HLO writes (a loop
    body's once); asserts that each is fp8."""
    block = [g for g in gemm_layers(text) if g.layer in BLOCK_LINEARS]
    assert block and all(g.fp8 for g in block), [g for g in block if not g.fp8]
    return collections.Counter((g.layer, g.role) for g in block)


@needs_plugin
def test_fp8_runs_every_block_gemm_in_fp8_on_every_layout(tiny):
    """model.fp8=true under dp, fsdp, tp, their products, pp (circular), grad_accum > 1 and every
    remat policy: each of the four block linears has its forward GEMM (e4m3 x e4m3), both gradient
    GEMMs (dx and dw, with the e5m2 gradient) and, under remat=full, the recomputed forward GEMMs
    in fp8 (qkv, attn_out and mlp_in, whose outputs the backward pass needs; mlp_out's is not
    recomputed). The only GEMMs left in bf16 are the tied head's (attention is cuDNN's kernel),
    and with model.fp8_head=true (under dp x fsdp x tp, the vocabulary split over tp) none is."""
    for name in FP8_LAYOUTS:
        text = tiny[name]
        count = _block_gemms(text)
        for layer in ("qkv", "attn_out", "mlp_in", "mlp_out"):
            assert count[layer, "forward"] >= 1 and count[layer, "backward"] >= 2, (name, layer, count)
        recomputed = {layer for layer, role in count if role == "recompute"}
        assert recomputed == ({"qkv", "attn_out", "mlp_in"} if "model.remat=full" in TINY_LAYOUTS[name][1] else set())
        fp8_head = "model.fp8_head=true" in TINY_LAYOUTS[name][1]
        assert {g.layer for g in gemm_layers(text) if not g.fp8} == (set() if fp8_head else {"head"}), name
        assert sum(g.layer == "head" for g in gemm_layers(text)) == 3, name  # logits, dx, dwte (chunk loop)
        assert fp8_gemm_operand_types(text) == {"f8e4m3fn", "f8e5m2"}, name
    # one layer loop forward and one backward: exactly 4 forward and 8 backward block GEMMs
    assert sum(_block_gemms(tiny["dp8_accum2_fp8"]).values()) == 12
    assert collections.Counter(g.role for g in gemm_layers(tiny["dp8_accum2_fp8"])) == {"forward": 7, "backward": 8}


@needs_plugin
def test_fp8_gemms_are_cublaslt_fp8_calls(tiny):
    """A real H100's autotuner picks cuBLASLt for the fp8 GEMMs (144 calls in gpt2-124m's measured
    step), so a step with fp8 is compiled with Triton GEMMs off (jaxgpt.gpu.target.FP8_OPTIONS):
    every block GEMM is a cuBLASLt fp8 call, `__cublas$lt$matmul$f8`, and the target description
    carries the CUDA toolkit version that the rewrite needs. Each call writes the compute dtype
    (bf16), rounded once inside the GEMM, not an fp32 result for the next fusion to rescale and
    cast (power-of-two scales, jaxgpt/lowering/fp8.py)."""
    text = tiny["dp8_accum2_fp8"]
    assert _block_gemms(text) == {(layer, role): n for layer in ("qkv", "attn_out", "mlp_in", "mlp_out")
                                  for role, n in (("forward", 1), ("backward", 2))}
    assert text.count('custom_call_target="__cublas$lt$matmul$f8"') == 12
    results = re.findall(r"= \((\w+)\[[\d,]*\]\{[\d,]*\}, s8\[\d+\]\{0\}\) custom-call\([^)]*\), "
                         r'custom_call_target="__cublas\$lt\$matmul\$f8"', text)
    assert results == ["bf16"] * 12, results


def _block_weights(cfg, tp: int) -> dict[str, tuple[int, ...]]:
    """Each block linear's weight as one tp shard holds it whole over fsdp (heads and MLP units
    split over tp): name -> its dimensions, sorted and without 1s (a gather may lay them out in
    another order, and drops a dimension of 1: grouped-query kv with one kv head per tp shard)."""
    m = cfg.model
    D, H, G, K, F = m.n_embd, m.n_head // tp, m.kv_heads // tp, m.head_dim, m.mlp_width // tp
    qkv = {"qkv": (D, 3, H, K)} if G == H else {"q": (D, H, K), "kv": (D, 2, G, K)}
    gate = {"mlp_gate": (D, F)} if m.mlp == "swiglu" else {}
    return {name: tuple(sorted(d for d in dims if d != 1)) for name, dims in
            {**qkv, "attn_out": (H, K, D), "mlp_in": (D, F), **gate, "mlp_out": (F, D)}.items()}


@needs_plugin
def test_fsdp_gathers_fp8_block_weights(tiny, modern, gpt2):
    """Under fsdp with model.fp8=true each block weight is quantized on its shard and gathered as
    e4m3 (jaxgpt/lowering/fp8.py): every all-gather of a block weight returns f8e4m3fn, 1 byte an
    element, half the bytes of the bf16 gathers without fp8 (gpt2-124m fsdp=8, for comparison: every
    block weight gathered in bf16). A pipeline gathers its stage's fp32 weights once per round
    instead (pipeline.gather_once), fp8 or not."""
    layouts = {name: (tiny[name], TINY_LAYOUTS[name]) for name in FP8_LAYOUTS
               if "fsdp" in TINY_LAYOUTS[name][0] and "pp" not in TINY_LAYOUTS[name][0]}
    layouts["modern"] = (modern, ("dp=2,fsdp=2,tp=2", MODERN))
    assert len(layouts) == 5
    for name, (text, (mesh, overrides)) in layouts.items():
        tp = int(m.group(1)) if (m := re.search(r"tp=(\d+)", mesh)) else 1
        weights = _block_weights(tiny_config(*overrides, mesh=mesh), tp)
        gathered = [(dtype, tuple(sorted(int(d) for d in dims.split(",") if d != "1"))) for dtype, dims in _gathered(text)]
        of_weights = [(dtype, dims) for dtype, dims in gathered if dims in weights.values()]
        assert {dtype for dtype, _ in of_weights} == {"f8e4m3fn"}, (name, of_weights)
        assert {dims for _, dims in of_weights} == set(weights.values()), (name, weights, of_weights)
    bf16 = [dtype for dtype, dims in _gathered(gpt2["fsdp=8"][0]) if dims in ("768,3,12,64", "768,64,12", "768,3072")]
    assert bf16 and set(bf16) == {"bf16"}


def _weight_gather_bytes(c: Compiled, layout: str) -> float:
    """Bytes per step that the all-gathers of a tiny layout's block weights return (each execution
    counted; the layout has no tp)."""
    mesh, overrides = TINY_LAYOUTS[layout]
    text = c.compiled.as_text()
    weights = set(_block_weights(tiny_config(*overrides, mesh=mesh), 1).values())
    _, instrs = _instructions(text)
    total = 0.0
    for k in cost.kernels(text, perf.perf("h100"), 8)[0]:
        i = instrs.get(k.name)
        if i is not None and i.opcode.startswith("all-gather"):
            result = i.shape[cost._balanced(i.shape, 1):] if i.shape.startswith("((") else i.shape
            for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([\d,]+)\]", result):
                if tuple(sorted(int(d) for d in dims.split(",") if d != "1")) in weights:
                    total += k.times * hlo.shape_bytes(f"{dtype}[{dims}]")
    return total


@needs_plugin
def test_fsdp_fp8_weight_gathers_move_half_the_bf16_bytes(compiled):
    """Issue 38 item 2: under fsdp the block weights' all-gathers move half the bytes a step that
    the same step's gathers move in bf16, counted over every execution, with micro-batches and
    remat=full (the weights quantized once per step, the forward GEMMs recomputed in the backward):
    each GEMM's gathered e4m3 weight stands for one bf16 gather. A transposed e4m3 copy made before
    the loop (jaxgpt/lowering/fp8.py prequantize) was gathered besides the weight's own: 0.67x."""
    fp8, bf16 = (_weight_gather_bytes(compiled[name], name) for name in ("fsdp8_accum2_remat_full_fp8",
                                                                            "fsdp8_accum2_remat_full"))
    assert bf16 > 0 and fp8 == bf16 / 2, (fp8, bf16)


@needs_plugin
def test_plan_command_for_8_h100():
    """The user's command: a plan from XLA:GPU with cuDNN attention and fp8, fitting an H100, for
    gpt2-124m's shapes (one layer) under dp=2,fsdp=2,tp=2 with 32 sequences per device. XLA:GPU's
    partitioner aborted the process there (a CHECK in ExpandDeviceGroupsWithIota, from
    PartitionGather) on the token and label lookups from the vocab-split table inside the dp
    shard_map; the tiny model's smaller batches took another gather strategy and compiled. Where
    fsdp and tp are both > 1 the lookups now read the table whole (jaxgpt/lowering/ops.py
    `Lowering.table_axes`). In a subprocess: an abort would end the test session."""
    proc = subprocess.run([sys.executable, "-m", "jaxgpt.plan", "--target", "h100", "--gpus", "8",
                           "--config", "gpt2-124m", "--mesh", "dp=2,fsdp=2,tp=2", "model.n_layer=1",
                           "train.grad_accum=4", "model.remat=auto", "model.fp8=true"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cudart_stub" not in proc.stderr and "absl::InitializeLog" not in proc.stderr  # jaxgpt/_quiet.py
    out = proc.stdout
    assert "on 8 gpu devices (NVIDIA H100 80GB HBM3)" in out and "compiled by XLA:GPU" in out
    assert "attention: cudnn" in out and "fused attention calls: 1 forward, 1 backward" in out
    assert "GEMM calls: 12 fp8, 3 other\n" in out  # the block's 4 forward + 8 backward; the head's 3
    assert "remat: none (auto: none, the least recompute that fits 79.1 GiB" in out
    assert f"of {device_memory_bytes('h100') / 2**20:,.1f} MiB: fits" in out
    assert "reduce-scatter" in out and "predicted step time on NVIDIA H100" in out


@needs_plugin
def test_remat_auto_takes_the_least_recompute_that_fits(h100s):
    """A device one byte smaller than the no-remat step needs: auto compiles 'none', sees that it
    does not fit, and takes the next policy that does."""
    from jaxgpt.model import remat
    cfg = tiny_config("model.remat=auto", mesh="dp=8")
    plans: dict[str, dict] = {}  # policy -> its plan, each compiled once
    limit = None

    def plan_fn(c):
        if c.model.remat not in plans:
            plans[c.model.remat] = plan(c, h100s, None, "h100")
        p = plans[c.model.remat]
        return {**p, "fits": limit is not None and p["memory"]["peak"] <= limit}

    limit = plan_fn(remat.with_remat(cfg, "none"))["memory"]["peak"] - 1
    chosen, why, p = remat.resolve(cfg, limit, plan_fn)
    assert chosen.model.remat != "none" and p["fits"], why
    assert why.startswith(f"auto: {chosen.model.remat}, the least recompute that fits")
    assert remat.resolve(cfg, None, None)[0].model.remat == "none"  # a CPU: memory unknown


def test_without_the_plugin_the_command_says_what_to_install():
    code = ("import sys; sys.modules['jax_plugins.xla_cuda12'] = None; from jaxgpt.plan import main; "
            "sys.exit(main(['--target', 'h100', '--gpus', '8']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: compiling for a GPU without one needs the CUDA plugin: {INSTALL}"]


# The modern block (issue 21): RMSNorm, RoPE, SwiGLU, grouped-query attention (4 query heads over 2
# kv heads, so 2 and 1 per device under tp=2), QK-norm, no biases, fp8, Muon, under dp x fsdp x tp.
MODERN = ["model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.mlp_hidden=64",
          "model.n_kv_head=2", "model.qk_norm=true", "model.bias=false", "optimizer.name=muon", FP8]


@pytest.fixture(scope="module")
def modern(compiled) -> str:
    c = compiled["modern"]
    assert c.kernel == "cudnn" and c.dtype == jax.numpy.bfloat16, c.why
    return c.compiled.as_text()


def _fmha_operand_heads(text: str) -> list[list[int]]:
    """For every cuDNN fused-attention call: the head count of each of its first three operands
    (q, k, v, [B, T, heads, K] per device; the head count is the dimension after B and T)."""
    shapes = {m.group(1): [int(d) for d in m.group(2).split(",")]
              for m in re.finditer(r"%([\w.\-]+) = \w+\[([\d,]+)\]", text)}
    out = []
    for line in text.splitlines():
        if "__cudnn$fmha" in line and "custom-call(" in line:
            operands = re.search(r"custom-call\(([^)]*)\)", line).group(1)
            names = re.findall(r"%([\w.\-]+)", operands)[:3]
            out.append([shapes[n][2] for n in names if n in shapes])
    return out


@needs_plugin
def test_modern_block_runs_grouped_query_cudnn_attention_and_fp8_swiglu(modern):
    """cuDNN attention forward and backward with K and V at their own head count (1 per device)
    next to q's 2: the kv heads are never repeated to the query heads' count in memory. The gated
    MLP's three matmuls (mlp_in, mlp_gate, mlp_out) are fp8 forward and backward like the rest;
    under fsdp XLA:GPU merges the in and gate GEMMs, which read one cast of the same input, into one
    forward GEMM and one dx GEMM, each keeping its own dw GEMM (a barrier kept them apart until it
    was retired: it lost 0.1% on llama-8b fsdp=8, docs/ops.md)."""
    counts = fused_attention_counts(modern)
    assert counts["forward"] >= 1 and counts["backward"] >= 1, counts
    heads = _fmha_operand_heads(modern)
    assert heads and all(h[:3] == [2, 1, 1] for h in heads), heads
    count = _block_gemms(modern)
    for layer in ("qkv", "attn_out", "mlp_out"):
        assert count[layer, "backward"] >= 2 and count[layer, "forward"] >= 1, (layer, count)
    in_gate = ("mlp_in", "mlp_gate")
    assert all(count[layer, "backward"] >= 1 for layer in in_gate), count  # each its dw
    assert sum(count[layer, "backward"] for layer in in_gate) >= 3, count  # and dx, merged or not
    assert sum(count[layer, "forward"] for layer in in_gate) >= 1, count


# Document masking (model.document_mask, issue 41) with rotary positions restarting per document and
# grouped-query attention, at T = 96 (a size no other dimension of the tiny model has) and M = 4 documents.
DOCUMENTS = ["model.document_mask=true", "model.position=rope", "model.position_reset=true", "model.n_kv_head=2",
             "model.seq_len=96", "model.max_documents=4"]


@needs_plugin
def test_document_masking_stays_a_cudnn_flash_kernel(compiled):
    """Forward and backward are cuDNN fused attention in its packed layout: q, k, v plus each
    row's document lengths and offsets (7 operands, where the unmasked call has 3), and no array
    of the compiled step has two T-sized dimensions: no [T, T] mask, bias or score matrix exists,
    in any dtype. The softmax statistics are [B*M, H, T] per device: [4*4, 2, 96]."""
    c = compiled["documents"]
    assert c.kernel == "cudnn", c.why
    text = c.compiled.as_text()
    counts = fused_attention_counts(text)
    assert counts["forward"] >= 1 and counts["backward"] >= 1, counts
    for line in text.splitlines():
        if "__cudnn$fmha" in line and "custom-call(" in line:
            operands = re.search(r"custom-call\(([^)]*)\)", line).group(1)
            n = len(re.findall(r"%[\w.\-]+", operands))
            assert n >= 7, (n, line[:300])  # backward adds the output, its gradient and the statistics
    T = 96
    square = {shape for shape in re.findall(r"\w+\[([\d,]+)\]", text) if shape.split(",").count(str(T)) >= 2}
    assert not square, square
    assert re.search(r"f32\[16,2,96\]", text), "softmax statistics of B*M = 4*4 packed sequences"


@needs_plugin
def test_context_parallel_document_masking_is_a_cudnn_kernel_on_each_devices_queries(compiled):
    """cp=2 with document masking (jaxgpt/parallel/context.py): forward and backward are cuDNN
    fused attention of each device's 48 queries against the 96 gathered keys, the causal and
    document mask its [b, 1, 48, 96] bias (T^2/cp per row), K and V gathered over cp inside the
    layer loop (the backward reduce-scatters their gradients), and no array holds [T, T]."""
    c = compiled["context"]
    assert c.kernel == "cudnn", c.why
    text = c.compiled.as_text()
    counts = fused_attention_counts(text)
    assert counts["forward"] >= 1 and counts["backward"] >= 1, counts
    assert re.search(r"bf16\[\d+,1,48,96\]", text), "the mask as cuDNN's bias, one device's queries x all keys"
    loops = [collectives(body) for body in while_bodies(text)]
    assert any(n["all-gather"] >= 2 for n in loops) and any(n["reduce-scatter"] >= 1 for n in loops), loops
    by_axes = cost.estimate(text, perf.perf("h100"), 8, mesh=c.sizes)["collectives_by_axes"]
    assert by_axes["cp"]["seconds"] > 0 and by_axes["cp"]["bytes"] > 0, by_axes  # what `plan` prints per axis
    T = 96
    square = {shape for shape in re.findall(r"\w+\[([\d,]+)\]", text) if shape.split(",").count(str(T)) >= 2}
    assert not square, square


MOSAIC = ["model.attention=mosaic", "train.grad_accum=2", "model.remat=attention"]  # remat: one forward kept


@needs_plugin
@pytest.mark.skipif(flash.unavailable_reason() is not None, reason=f"model.attention=mosaic {flash.unavailable_reason()}")
def test_mosaic_attention_is_tokamaxs_flash_kernels_costed_as_attention(compiled):
    """model.attention=mosaic (jaxgpt/lowering/flash.py) on the modern block (grouped K/V, fp8) under
    fsdp x tp: forward and backward are tokamax's Mosaic GPU kernels (for the H100 its sm90 ones:
    the forward, then dQ and dK/dV), no cuDNN call remains, remat=attention keeps the forward's
    outputs (one forward kernel, not a second recomputed one), K and V reach the kernels at their own
    head count (1 per device, q 2), and the step-time model costs every one as attention with its
    FLOPs (none falls to 'other', bytes only)."""
    c = compiled["mosaic"]
    assert c.kernel == "mosaic", c.why
    text = c.compiled.as_text()
    counts = fused_attention_counts(text)
    assert counts["forward"] == 1 and counts["backward"] == 2, counts  # per layer loop body, as written
    assert "__cudnn$fmha" not in text
    for line in text.splitlines():
        if 'custom_call_target="mosaic_gpu' in line and "custom-call(" in line:
            q, k = re.findall(r"[a-z0-9]+\[([\d,]+)\]", line.split("operand_layout_constraints={", 1)[1])[:2]
            assert q.split(",")[2] == "2" and k.split(",")[2] == "1", (q, k)
    # the backward's two reach the model inside XLA's dynamic-slice fusions (their statistics read in place)
    flash_kernels = [k for k in cost.kernels(text, perf.perf("h100"), 8)[0] if k.group == cost.ATTENTION]
    assert len(flash_kernels) == 3 and all(k.flops > 0 for k in flash_kernels), flash_kernels


@needs_plugin
@pytest.mark.skipif(flash.unavailable_reason() is not None, reason=f"tokamax: {flash.unavailable_reason()}")
def test_attention_bench_kernels_compile_for_h100_forward_and_backward(h100s):
    """scripts/attention_bench.py (the GPU checks' attention group) traces and compiles every
    kernel it times, forward and backward, for an H100: each is the custom call it names, so a GPU's
    minutes go to timing, not to a script that fails."""
    bench = script_module("attention_bench")
    targets = {"cudnn": "__cudnn$fmha", "cudnn-bnth": "__cudnn$fmha", "mosaic": "mosaic_gpu",
               "triton": "__gpu$xla.gpu.triton", "xla": None}
    assert set(targets) == set(bench.KERNELS)
    B, T, H, K = 2, 256, 2, 64
    cudnn, mosaic = bench.predicted_ms("cudnn", B, T, H, K), bench.predicted_ms("mosaic", B, T, H, K)
    assert mosaic[0] == cudnn[0] and mosaic[1] > cudnn[1]  # the model's backward: 7 matmuls in 2 kernels, not 5 in 1
    for kernel, target in targets.items():
        shape = (B, H, T, K) if kernel == "cudnn-bnth" else (B, T, H, K)
        arg = jax.ShapeDtypeStruct(shape, jax.numpy.bfloat16, sharding=jax.sharding.SingleDeviceSharding(h100s[0]))
        attend = bench.attend_fn(kernel)
        with compiling_for(h100s, "h100"), jax.default_device(h100s[0]):  # tokamax reads the default device
            text = jax.jit(lambda q, k, v, d, attend=attend: jax.vjp(attend, q, k, v)[1](d)).lower(
                arg, arg, arg, arg).compile().as_text()
        calls = set(re.findall(r'custom_call_target="([^"]+)"', text))
        kernels = {c for c in calls if c.startswith(("__cudnn$fmha", "mosaic_gpu", "__gpu$xla.gpu.triton"))}
        assert (kernels and all(c.startswith(target) for c in kernels)) if target else not kernels, (kernel, calls)

"""`model.fp8=auto`: fp8 for the block linears the step-time model predicts faster, bf16 for the rest.

fp8 halves a GEMM's time where it is compute-bound, but every fp8 GEMM needs its operands
quantized (jaxgpt/lowering/fp8.py): an amax reduction and a scaled cast per operand, and the
transposed f8 copies cuBLASLt's fp8 kernels need (jaxgpt/gpu/target.py FP8_OPTIONS). That work
is memory-bound and grows with the operands (M x K + K x N + M x N elements), the saving with
the FLOPs (M x N x K), so fp8 pays on wide layers and loses on narrow ones: gpt2-124m in fp8 was
0.835x bf16 on an H100, gpt2-1.3b 1.067x and the llama-8b slice 1.21x (measured 2026-11-27, before
the fp8 GEMMs wrote bf16; docs/benchmarks.md).

The choice is per linear kind (the named scopes of `fp8.linear`: qkv, attn_out, mlp_in, mlp_gate,
mlp_out and the experts' three), from the shapes alone, so that it needs no compile and is the
same in `jaxgpt.plan --target` and in training on that GPU. For one use of a kind on one device
(the micro-batch's tokens M, the weight K x N as tp leaves it) and each of its three GEMMs
(forward x.w, backward dy.w^T and x^T.dy), the estimate uses the step-time model's own pieces
(jaxgpt/gpu/cost.py `gemm_seconds`, `memory_seconds`, the device constants of jaxgpt/gpu/perf.py):

    bf16  = the three GEMMs in bf16 (2-byte operands)
    fp8   = the three GEMMs in fp8 (twice the peak, 1-byte operands)
            + (M K + K N / A + M N) x QUANT_BYTES bytes at the HBM efficiency + QUANT_KERNELS launches

(A = train.grad_accum where the step quantizes the weights once per step, `weights_once_per_step`:
trick `prequantize` of jaxgpt/copies.py; else 1)

and the kind takes fp8 where fp8 < bf16, summed over its uses in a step. The fp8 GEMM writes its
result in the compute dtype, as a bf16 GEMM does (power-of-two scales, jaxgpt/lowering/fp8.py). With
that, each kind's GEMM time, bf16 and fp8, is the compiled program's to 0.1 ms (gpt2-124m and
gpt2-1.3b on an H100: docs/benchmarks.md; tests/test_fp8_choice.py).

QUANT_BYTES: 7 bytes an element would do (read for the amax 2, read and cast 2 + 1, the transposed
f8 copy 1 + 1), and XLA:GPU's programs move less: an amax is taken in the fusion that produces its
operand where it can be (the GELU's, the gradients' with `quantize(pin=True)`), or recomputes a
LayerNorm instead of reading its output. What qkv, mlp_in and mlp_out in fp8 add outside the GEMMs
in the compiled gpt2-124m and gpt2-1.3b steps (the step less its GEMMs, against bf16's, less
launches; docs/benchmarks.md, "fp8 GEMMs write bf16") is 5.1 and 5.2 bytes an element of this count
(9.0-9.4 while the fp8 GEMMs wrote fp32 for the consumers to read back). Measured, it is more:
gpt2-124m with those three kinds in fp8 ran 1,072.4 ms on an H100 against 1,037.4 in bf16 on the
same machine (2026-11-27), where the compiled programs predict 1,004.7 against 1,031.5; its
quantization kernels run below the bandwidth the model gives them (the 124M fp8 profile: 356.5 ms
measured, 315.3 predicted). 7.5 bytes an element accounts for that measured step, so QUANT_BYTES is
7.5: auto does not take what the GPU measured as a loss.

attn_out takes the same constant. With GPT-2's biases it once moved more (10.6 and 14.2 bytes an
element in the compiled gpt2-124m and gpt2-1.3b steps, each fp8 step against the same step with
attn_out in bf16, 2026-11-27): its incoming gradient was read once more for its amax beside the bias
gradient's column sum, and its dx GEMM's rescale ran as a pass of its own because cuDNN's attention
backward, a custom call, reads that dx. Both went at stop 52 (jaxgpt/lowering/fp8.py `_column_amax`,
`scaled_dot(fold=True)`), and the compiled programs now move 5.2 and 4.7 bytes an element for it,
under the other kinds' QUANT_BYTES (gpt2-1.3b: all four kinds in fp8 3,256.4 ms against 3,296.3
with attn_out in bf16 on an H100, 3,121.7 against 3,168.3 on an H200; gpt2-124m 943.8 against
935.9). Read off the compiled programs, not measured on a GPU. Collective traffic is left out:
fsdp's all-gathers of e4m3 weights move half the bytes, which only favours fp8 more than estimated.

Where the model is not told a GPU (a CPU run, a plan without --target, a GPU other than an H100 or
H200) auto is bf16 everywhere, and says so.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jaxgpt.config import TRICKS, Config, pipeline_microbatches, round_rows
from jaxgpt.gpu import cost
from jaxgpt.gpu.perf import Perf, perf
from jaxgpt.hlo import BLOCK_LINEARS

QUANT_BYTES = 7.5    # HBM bytes per operand element an fp8 GEMM's quantization moves, in effect (module docstring)
QUANT_KERNELS = 10   # its kernels per use: three amax reductions and their scalars, casts, transposed copies


class Shape(NamedTuple):
    """One forward GEMM of a linear on one device: [batch x] (m x k) . (k x n)."""
    batch: int
    m: int
    k: int
    n: int


class Choice(NamedTuple):
    kind: str
    uses: int             # per step on one device (layers x micro-batches)
    bf16_seconds: float   # per step: the kind's GEMMs, forward and both gradients, in bf16
    fp8_seconds: float    # the same in fp8, with the quantization around them

    @property
    def gain_seconds(self) -> float:
        return self.bf16_seconds - self.fp8_seconds

    @property
    def fp8(self) -> bool:
        return self.gain_seconds > 0


def linear_shapes(cfg: Config, sizes: dict[str, int]) -> dict[str, tuple[list[Shape], int]]:
    """Each block linear kind the model has -> (its forward GEMMs in one use on one device, uses per
    step). M is a pipeline micro-batch's (else a gradient-accumulation round's) tokens on one device;
    tp splits the heads and the MLP width."""
    m, tp = cfg.model, sizes["tp"]
    chunks = pipeline_microbatches(cfg, sizes)
    M = round_rows(cfg, sizes) // chunks * m.seq_len
    layers = m.n_layer // sizes["pp"]
    rounds = cfg.train.grad_accum * chunks
    D, H, G, K = m.n_embd, m.n_head, m.kv_heads, m.head_dim
    moe_layers = layers // m.moe_every if m.moe_experts else 0
    qkv = [Shape(1, M, D, 3 * H * K // tp)] if G == H else [Shape(1, M, D, H * K // tp), Shape(1, M, D, 2 * G * K // tp)]
    out = {"qkv": (qkv, layers * rounds), "attn_out": ([Shape(1, M, H * K // tp, D)], layers * rounds)}
    mlp = {"mlp_in": Shape(1, M, D, m.mlp_width // tp), "mlp_out": Shape(1, M, m.mlp_width // tp, D)}
    if m.mlp == "swiglu":
        mlp["mlp_gate"] = mlp["mlp_in"]
    if dense := layers - moe_layers:
        out.update({k: ([s], dense * rounds) for k, s in mlp.items()})
    if m.moe_shared_experts and moe_layers:  # a dense MLP of S expert widths (jaxgpt/model/blocks.py), same scopes
        width = m.moe_shared_experts * m.expert_width // tp
        shared = {"mlp_in": Shape(1, M, D, width), "mlp_out": Shape(1, M, width, D)}
        if m.mlp == "swiglu":
            shared["mlp_gate"] = shared["mlp_in"]
        out.update({f"{k}+shared": ([s], moe_layers * rounds) for k, s in shared.items()})
    if moe_layers and m.moe_dispatch == "capacity":  # dropless experts are ragged_dot GEMMs: no fp8 form
        E = m.moe_experts // sizes["ep"]
        slots = M * m.moe_top_k * m.moe_capacity_factor * sizes["ep"] // m.moe_experts  # tokens per local expert
        F = m.expert_width // tp
        experts = {"expert_in": Shape(E, int(slots), D, F), "expert_out": Shape(E, int(slots), F, D)}
        if m.mlp == "swiglu":
            experts["expert_gate"] = experts["expert_in"]
        out.update({k: ([s], moe_layers * rounds) for k, s in experts.items()})
    return out


def _gemm(batch: int, m: int, k: int, n: int, fp8: bool, p: Perf) -> float:
    """One GEMM as cost.py costs it: bf16 or f8 operands, and a result in the compute dtype (bf16),
    which cuBLASLt's fp8 calls write directly (jaxgpt/lowering/fp8.py `scaled_dot`)."""
    g = cost.Gemm(batch, m, n, k, fp8, "", batch > 1)
    operand, result = (1, 2) if fp8 else (2, 2)
    return cost.gemm_seconds(g, batch * (operand * (m * k + k * n) + result * m * n), p)


def gemm_seconds(gemms: list[Shape], p: Perf, fp8: bool) -> float:
    """One use of a linear kind's GEMMs: each forward GEMM and both its gradients (dx = dy.w^T, dw = x^T.dy)."""
    return sum(_gemm(s.batch, *mkn, fp8, p) for s in gemms for mkn in ((s.m, s.k, s.n), (s.m, s.n, s.k), (s.k, s.m, s.n)))


def quantize_seconds(gemms: list[Shape], p: Perf, quant_bytes: float = QUANT_BYTES, weight_share: float = 1.0) -> float:
    """What one use of a linear kind adds around its fp8 GEMMs: amax, casts, transposed copies.
    weight_share: the share of the weight's quantization one use carries (1 / grad_accum where the
    step quantizes the weights once per step)."""
    elements = sum(s.batch * (s.m * s.k + weight_share * s.k * s.n + s.m * s.n) for s in gemms)
    return cost.memory_seconds(quant_bytes * elements, p) + (QUANT_KERNELS * len(gemms) - 1) * p.launch_seconds


def use_seconds(gemms: list[Shape], p: Perf, fp8: bool, quant_bytes: float = QUANT_BYTES,
                weight_share: float = 1.0) -> float:
    """One use of a linear kind: its GEMMs, with fp8 the quantization of their operands too."""
    return gemm_seconds(gemms, p, fp8) + (quantize_seconds(gemms, p, quant_bytes, weight_share) if fp8 else 0.0)


def weights_once_per_step(cfg: Config, sizes: dict[str, int]) -> bool:
    """Whether the train step on a GPU quantizes its block weights once per step (the lowering's
    `prequantize`: model.ops tuned or auto, or a list naming it; a dense model without a pipeline)."""
    tricks = TRICKS if cfg.model.ops in ("auto", "tuned") else cfg.model.ops.split(",")
    return "prequantize" in tricks and sizes.get("pp", 1) == 1 and not cfg.model.moe_experts


def choices(cfg: Config, sizes: dict[str, int], p: Perf) -> list[Choice]:
    """The estimate for every block linear kind of cfg's model on device p, in BLOCK_LINEARS order."""
    by_kind: dict[str, list[float]] = {}
    share = 1 / cfg.train.grad_accum if weights_once_per_step(cfg, sizes) else 1.0
    for name, (gemms, uses) in linear_shapes(cfg, sizes).items():
        kind = name.split("+")[0]
        row = by_kind.setdefault(kind, [0, 0.0, 0.0])
        row[0] += uses
        row[1] += uses * use_seconds(gemms, p, False)
        row[2] += uses * use_seconds(gemms, p, True, QUANT_BYTES, share)
    return [Choice(kind, *by_kind[kind]) for kind in BLOCK_LINEARS if kind in by_kind]


def target_of(device) -> str | None:
    """'h100' or 'h200' for such a GPU (its device_kind), else None: the step-time model knows no other."""
    kind = str(getattr(device, "device_kind", "")).upper()
    return "h200" if "H200" in kind else "h100" if "H100" in kind else None


def resolve(cfg: Config, sizes: dict[str, int], target: str | None) -> tuple[Config, list[Choice], str]:
    """(cfg with model.fp8=auto replaced by the kinds that take fp8, or false; the estimate per kind;
    one line saying what auto chose). Any other model.fp8 comes back as it is, with no line."""
    if cfg.model.fp8 != "auto":
        return cfg, [], ""
    if target is None:
        chosen, rows = [], []
        why = ("model.fp8=auto: no layer in fp8, the compute dtype everywhere (the step-time model costs fp8 on "
               "an H100 or H200 only, and this run has neither)")
    else:
        p = perf(target)
        rows = choices(cfg, sizes, p)
        chosen = [c.kind for c in rows if c.fp8]
        gain = sum(c.gain_seconds for c in rows if c.fp8)
        what = (f"fp8 for {', '.join(chosen)}, bf16 for the rest: predicted {1e3 * gain:,.1f} ms/step faster "
                f"than bf16" if chosen else "bf16 everywhere: fp8 is predicted slower for every layer")
        why = f"model.fp8=auto on {p.name}: {what} (jaxgpt/gpu/fp8_choice.py, a model, not a measurement)"
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8=",".join(chosen) or False)), rows, why


def format_choices(rows: list[Choice]) -> list[str]:
    """One line per linear kind: fp8 or bf16, and the predicted gain of fp8 over bf16."""
    return [f"  {c.kind:<12}{'fp8' if c.fp8 else 'bf16':<6}predicted gain of fp8 {1e3 * c.gain_seconds:+,.1f} ms/step "
            f"(bf16 {1e3 * c.bf16_seconds:,.1f} ms, fp8 {1e3 * c.fp8_seconds:,.1f} ms, {c.uses} uses)" for c in rows]

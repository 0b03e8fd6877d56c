"""A step-time model read from XLA:GPU's compiled program: no GPU needed.

`python -m jaxgpt.plan --target h100|h200` compiles the real train step for a compile-only GPU
(jaxgpt/gpu/target.py). This module walks the optimized HLO of that step and costs every kernel
the GPU would launch, one step's worth:

    kernel time = max(FLOPs / (peak x efficiency), bytes moved / (HBM bandwidth x efficiency))
                  + a per-launch overhead

summed in program order (one stream; only async collectives overlap, below). Loops multiply: a kernel in a
`while` body runs trip-count times (the layer scans inside the gradient-accumulation scan: 12 x
16), the trip count read as jaxgpt.hlo reads it for collectives. The device constants (peaks,
efficiencies, launch overhead, link bandwidth) are in jaxgpt/gpu/perf.py, the same for every
config.

What a kernel is, and what it costs
-----------------------------------
- A GEMM: a Triton GEMM fusion (`kind=kCustom`, what XLA writes without autotuning) or a cuBLAS /
  cuBLASLt custom call. FLOPs = 2 x batch x M x N x K from the dot's shapes and dimension numbers;
  the efficiency is the device's GEMM efficiency times wave quantization: the work, output tiles
  of `gemm_tile` times its K steps, is spread over the SMs as cuBLAS's stream-K kernels on Hopper
  do (a K-long GEMM with few output tiles, such as a weight gradient of a 768-wide layer, still
  fills the GPU; a tiny GEMM does not: 1.2 waves run as 2). Bytes = operands + result. A deviceless
  compile has no autotuning, so its Triton tile choices are ignored: the model costs what an
  autotuned kernel (cuBLAS, as measured) does, from the shapes alone.
- cuDNN fused attention (`__cudnn$fmha*`): FLOPs = 4 x B x H x Tq x Tk x D forward (QK^T and PV),
  halved for a causal mask, 2.5x that backward (dQ, dK, dV and the recomputed scores), at an
  efficiency that depends on the head dimension D (perf.attention_efficiency).
- tokamax's Mosaic GPU flash attention (`model.attention=mosaic`, a `mosaic_gpu` custom call whose
  metadata names the tokamax op and its q and k): the same forward FLOPs; its backward is two
  kernels, dQ (3 matmuls: 1.5x the forward) and dK/dV (4 matmuls: 2x), as FlashAttention-2/3 split
  it. No GPU has timed them yet: they are costed at cuDNN's efficiencies per FLOP (an assumption
  scripts/attention_bench.py is there to replace).
- Any other fusion, copy or unfused op: bytes only. A fusion reads each operand whole, except one
  it only slices (a scan reading layer l of stacked weights reads that slice) or updates in place
  (dynamic-update-slice into a scan's stacked outputs writes only the update).
- Collectives: wire bytes (ring algorithms, jaxgpt.hlo) over the link bandwidth of where the
  replica groups live: NVLink when every group lies inside one node (device id // gpus_per_node:
  a deviceless compile numbers the devices in the mesh's process order), the network (InfiniBand /
  RoCE, one NIC per GPU) when a group spans nodes. Across nodes a ring collective (all-reduce,
  all-gather, reduce-scatter) whose groups hold k GPUs of each node runs k rings, one per NIC:
  min(NVLink, k x one NIC) (`ring_nics`); an all-to-all cannot aggregate NICs (NCCL's maintainers)
  and takes one NIC's rate, as a permute does. Each collective also pays the link's latency per
  ring step (2(n-1) for an all-reduce, n-1 otherwise).
- Overlap: only where XLA's schedule overlaps. An async collective (`*-start` ... `*-done`) runs
  while the kernels scheduled between its start and its done run; collectives in flight share
  the link in the order they started. What the compute between them covers is hidden; the rest,
  and every synchronous collective, is exposed and adds to the step.

Groups
------
Each kernel lands in one group: GEMMs (the tied head's included), attention (cuDNN calls; with
XLA attention its batched einsums and softmax), norms/elementwise (inside the differentiated
model), loss (the chunked head's softmax and cross-entropy, named scope `head`), grad
accumulation (inside the accumulation loop but outside the differentiated model: the gradient
sums), optimizer update (outside every loop and the model: clipping, AdamW), data movement
(fusions that only copy, cast, transpose, slice or fill: zero-init of scan buffers, layout
changes, bf16 weight copies), fp8 quantization (below), collectives, other (loop conditions,
unknown custom calls).

fp8 (`model.fp8`)
-----------------
An fp8 GEMM runs at twice the bf16 peak, at the same efficiency and wave quantization. What the
fp8 path adds around it is read from the program like everything else: every non-GEMM kernel that
writes or reads an f8 array (the scaled casts, the transposed f8 copies) or takes an amax for a
scale (a max reduction under a GEMM's named scope) is costed by its bytes in the group "fp8
quantization"; a norm or activation fused with its cast lands there whole. jaxgpt.plan compiles a
step with fp8 with Triton GEMMs off (jaxgpt/gpu/target.py FP8_OPTIONS), the cuBLASLt route a real
GPU's autotuner took, so the transposed copies cuBLASLt needs are in the program. On the four fp8
steps measured on 2026-11-26 (gpt2-124m and gpt2-1.3b on an H100 and an H200) the predictions are
within -3.9% to +0.1% (docs/benchmarks.md, "fp8 in the step-time model"); the Triton program the
deviceless compile writes by default has no such copies and was predicted 16-20% short.

Known blind spots: kernels other than async collectives are serialised (an upper bound where XLA
overlaps other async work), cache reuse between kernels is ignored (a lower bound's opposite: small operands
that stay in the 50 MiB L2 are charged to HBM), and elementwise FLOPs are not counted.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Any, NamedTuple

from jaxgpt import hlo
from jaxgpt.gpu.perf import Perf, attention_efficiency

GROUPS = ("GEMMs", "attention", "norms/elementwise", "loss (head softmax, cross-entropy)", "grad accumulation",
          "optimizer update", "data movement (copy, cast, transpose, zero-init)",
          "fp8 quantization (amax, scaled cast, f8 copies)", "collectives", "other")
GEMM, ATTENTION, ELEMENTWISE, LOSS, ACCUMULATE, OPTIMIZER, MOVEMENT, FP8, COLLECTIVE, OTHER = GROUPS

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "domain"}
_MOVEMENT = _FREE | {"copy", "transpose", "convert", "broadcast", "slice", "dynamic-slice", "dynamic-update-slice",
                     "reshape", "concatenate", "pad", "iota"}
# an amax for an fp8 scale: a max reduction under one of jaxgpt's GEMM scopes (jaxgpt/lowering/fp8.py quantize)
_AMAX = re.compile(r"/(" + "|".join(hlo.LAYERS) + r")/reduce_max$")
_COLLECTIVE = re.compile(r"^(" + "|".join(hlo.COLLECTIVES) + r")(-start)?$")
# XLA attention (jax.nn.dot_product_attention, implementation='xla'): its einsums and softmax
_XLA_ATTENTION = re.compile(r"BTNH,BSNH->BNTS|BNTS,BSNH->BTNH|dot_product_attention|_softmax|/softmax")


class Instr(NamedTuple):
    name: str
    shape: str       # the result type, e.g. 'bf16[8,128]{1,0}' or a tuple '(f32[2], s32[])'
    opcode: str
    operands: tuple  # operand instruction names
    line: str
    root: bool


class Kernel(NamedTuple):
    name: str
    group: str
    times: int        # executions per step
    flops: float      # per execution
    bytes: float      # per execution
    seconds: float    # per execution, launch included
    axes: str = ""    # a collective's mesh axes ('cp', 'fsdp+tp'; '?' unread), when the mesh is known


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group that opens at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


_LHS = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def parse_instr(line: str) -> Instr | None:
    """One HLO instruction line -> Instr (None for anything else)."""
    if not (m := _LHS.match(line)):
        return None
    rest = line[m.end():]
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    if not (op := re.match(r"([\w\-]+)\(", rest)):
        return None
    close = _balanced(rest, op.end() - 1)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[op.end():close - 1]))
    return Instr(m.group(2), shape, op.group(1), operands, line, bool(m.group(1)))


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str | None]:
    """HLO text -> ({computation: its instructions}, the entry computation's name)."""
    comps = {name: [i for line in body.splitlines() if (i := parse_instr(line))]
             for name, body in hlo.hlo_computations(text).items()}
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
    return comps, entry.group(1) if entry else None


def _dims(shape: str) -> list[int]:
    m = re.search(r"\[([^\]]*)\]", shape)
    return [int(d.lstrip("<=")) for d in m.group(1).split(",") if d.strip()] if m else []


def _attr_dims(line: str, key: str) -> list[int]:
    if m := re.search(key + r"=\{([\d,]*)\}", line):  # HLO attribute: lhs_contracting_dims={1}
        return [int(d) for d in m.group(1).split(",") if d]
    camel = {"lhs_contracting_dims": "lhs_contracting_dimensions", "rhs_contracting_dims": "rhs_contracting_dimensions",
             "lhs_batch_dims": "lhs_batch_dimensions", "rhs_batch_dims": "rhs_batch_dimensions"}[key]
    if m := re.search(rf'"{camel}":\[([^\]]*)\]', line):  # cuBLAS backend_config
        return [int(d) for d in re.findall(r"\d+", m.group(1))]
    return []


class Gemm(NamedTuple):
    batch: int
    m: int
    n: int
    k: int
    fp8: bool
    op_name: str
    batched: bool  # has batch dimensions (attention's einsums do; linear layers do not)


def _gemm(line: str, lhs: str, rhs: str) -> Gemm:
    """The GEMM a dot (or cuBLAS call) with operand types lhs, rhs performs."""
    ld, rd = _dims(lhs), _dims(rhs)
    lc, rc = _attr_dims(line, "lhs_contracting_dims"), _attr_dims(line, "rhs_contracting_dims")
    lb, rb = _attr_dims(line, "lhs_batch_dims"), _attr_dims(line, "rhs_batch_dims")
    batch = math.prod(ld[d] for d in lb)
    k = math.prod(ld[d] for d in lc)
    m = math.prod(s for d, s in enumerate(ld) if d not in lc and d not in lb)
    n = math.prod(s for d, s in enumerate(rd) if d not in rc and d not in rb)
    name = op.group(1) if (op := re.search(r'op_name="([^"]*)"', line)) else ""
    return Gemm(batch, m, n, k, "f8e" in lhs + rhs, name, bool(lb))


def gemm_seconds(g: Gemm, nbytes: float, p: Perf) -> float:
    """One GEMM's time: its FLOPs at the device's GEMM efficiency and wave quantization, or its
    bytes at HBM speed if that is longer, plus the launch."""
    tm, tn, tk = p.gemm_tile
    work = g.batch * math.ceil(g.m / tm) * math.ceil(g.n / tn) * math.ceil(g.k / tk)  # stream-K units
    waves = work / (math.ceil(work / p.sms) * p.sms)
    peak = p.peak_flops * (2 if g.fp8 else 1) * p.gemm_efficiency * waves
    memory = nbytes / (p.hbm_bytes_per_s * p.hbm_efficiency)
    return max(2.0 * g.batch * g.m * g.n * g.k / peak, memory) + p.launch_seconds


def memory_seconds(nbytes: float, p: Perf) -> float:
    return nbytes / (p.hbm_bytes_per_s * p.hbm_efficiency) + p.launch_seconds


# An attention backward's FLOPs in forward FLOPs, per kernel: cuDNN's one call (dQ, dK, dV and the
# recomputed scores: 5 matmuls to the forward's 2); tokamax's two, dQ (3 matmuls) and dK/dV (4)
CUDNN_BACKWARD = 2.5
TOKAMAX_BACKWARD = {"dq": 1.5, "dkv": 2.0}


def attention_seconds(flops: float, backward: bool, head_dim: int, nbytes: float, p: Perf) -> float:
    """One fused-attention kernel on `p`, launch included: its FLOPs at the attention efficiency
    of its direction and head dim, or its bytes, whichever takes longer."""
    points = p.attention_backward_efficiency if backward else p.attention_forward_efficiency
    return max(flops / (p.peak_flops * attention_efficiency(points, head_dim)),
               nbytes / (p.hbm_bytes_per_s * p.hbm_efficiency)) + p.launch_seconds


def attention_flops(line: str, operand_types: list[str]) -> float:
    """FLOPs of one cuDNN fused-attention call: 4 B H Tq Tk D forward, half for a causal mask,
    2.5x backward."""
    inter = re.search(r'"intermediate_tensor_shape":\s*\{[^{]*?"dimensions":\s*\[([^\]]*)\]', line)
    b, h, tq, tk = (int(d) for d in re.findall(r"\d+", inter.group(1))) if inter else (0, 0, 0, 0)
    d = _dims(operand_types[0])[-1] if operand_types else 0
    flops = 4.0 * b * h * tq * tk * d
    if re.search(r'"mask_type":\s*"CAUSAL', line):
        flops /= 2
    return flops * (CUDNN_BACKWARD if "Backward" in line else 1.0)


def tokamax_attention_flops(line: str, operand_types: list[str], result: str) -> tuple[float, bool, int] | None:
    """(FLOPs, backward?, head dim) of one kernel of tokamax's flash attention (model.attention=mosaic),
    from its first two operands, q [B, T, H, K] and k [B, S, G, K] as the kernel takes them (padded
    to its tiles: T and S to 64-row blocks, K to 64 features), causal as jaxgpt calls it; None for
    any other custom call."""
    kind = hlo.tokamax_attention_kind(line)
    q, k = (_dims(t) for t in (operand_types + ["", ""])[:2])
    if kind is None or len(q) < 4 or len(k) < 4:
        return None
    *_, t, h, d = q
    flops = 4.0 * math.prod(q[:-3]) * h * t * k[-3] * d / 2  # causal: half the blocks
    if kind == "forward":
        return flops, False, d
    return flops * TOKAMAX_BACKWARD["dkv" if result.startswith("(") else "dq"], True, d  # dK, dV: a tuple


def _fused_bytes(comp: list[Instr]) -> float:
    """Bytes a fusion moves: each parameter read whole, or only the slices taken of it, or not at
    all when it is the buffer a dynamic-update-slice writes in place; the root written whole, or
    only the update of an in-place dynamic-update-slice."""
    by_name = {i.name: i for i in comp}
    users = collections.defaultdict(list)
    for i in comp:
        for o in i.operands:
            users[o].append(i)

    def uses(name: str) -> list[Instr]:  # users, looking through bitcasts
        return [v for u in users[name] for v in (uses(u.name) if u.opcode == "bitcast" else [u])]

    total = 0.0
    for param in (i for i in comp if i.opcode == "parameter"):
        us = uses(param.name)
        if us and all(u.opcode == "dynamic-update-slice" and by_name.get(u.operands[0], u).name in
                      (param.name, *[b.name for b in users[param.name]]) for u in us):
            continue  # updated in place
        if us and all(u.opcode in ("dynamic-slice", "slice", "gather") for u in us):
            total += sum(hlo.shape_bytes(u.shape) for u in us)
        else:
            total += hlo.shape_bytes(param.shape)
    root = next((i for i in comp if i.root), None)
    outputs = [by_name[o] for o in root.operands if o in by_name] if root and root.opcode == "tuple" else [root]
    for out in filter(None, outputs):
        while out.opcode == "bitcast" and out.operands and out.operands[0] in by_name:
            out = by_name[out.operands[0]]
        if out.opcode == "dynamic-update-slice" and len(out.operands) > 1 and out.operands[1] in by_name:
            total += hlo.shape_bytes(by_name[out.operands[1]].shape)
        else:
            total += hlo.shape_bytes(out.shape)
    return total


def _fp8_work(shape: str, body: list[Instr], op_names: list[str]) -> bool:
    """A kernel (other than a GEMM) that the fp8 path adds: it writes or reads an f8 array (a scaled
    cast, a transposed f8 copy for cuBLASLt) or takes an amax. A norm or activation fused with its
    cast counts here whole: the bytes of such a fusion are the producer's and the cast's together."""
    return "f8e" in shape or any("f8e" in d.shape for d in body) or any(_AMAX.search(n) for n in op_names)


def _called(line: str) -> list[str]:
    return re.findall(r"\bcalls=%?([\w.\-]+)", line)


def _is_gemm_call(i: Instr) -> bool:
    """A cuBLAS / cuBLASLt GEMM custom call (bf16 or fp8)."""
    if i.opcode != "custom-call":  # asked of every instruction in every fusion: no regex for the rest
        return False
    target = m.group(1) if (m := re.search(r'custom_call_target="([^"]*)"', i.line)) else ""
    return re.search(r"gemm|matmul", target) is not None


def _gemm_call(i: Instr, operand_types: list[str], times: int, p: Perf) -> Kernel:
    """A cuBLAS GEMM call's kernel: its FLOPs, and the bytes of its two matrices and its result."""
    g = _gemm(i.line, operand_types[0], operand_types[1])
    first = re.match(r"\(?([a-z0-9]+\[[^\]]*\])", i.shape).group(1)  # result, not the workspace
    nbytes = hlo.shape_bytes(operand_types[0]) + hlo.shape_bytes(operand_types[1]) + hlo.shape_bytes(first)
    return Kernel(i.name, GEMM, times, 2.0 * g.batch * g.m * g.n * g.k, nbytes, gemm_seconds(g, nbytes, p))


def _attention_call(i: Instr, operand_types: list[str], times: int, p: Perf) -> Kernel | None:
    """A fused-attention custom call (cuDNN's, tokamax's) costed by its FLOPs, else None."""
    target = m.group(1) if (m := re.search(r'custom_call_target="([^"]*)"', i.line)) else ""
    # the operands' types as the call wants them (an operand itself is often a bitcast of another layout)
    constraints = i.line.split("operand_layout_constraints={", 1)
    laid_out = re.findall(r"[a-z0-9]+\[[^\]]*\]", constraints[1]) if len(constraints) > 1 else operand_types
    if "fmha" in target:
        attention = (attention_flops(i.line, laid_out), "Backward" in target, _dims(laid_out[0])[-1] if laid_out else 0)
    elif target.startswith("mosaic_gpu"):
        attention = tokamax_attention_flops(i.line, laid_out, i.shape)
    else:
        return None
    if attention is None:
        return None
    flops, backward, head_dim = attention
    nbytes = sum(map(hlo.shape_bytes, operand_types)) + hlo.shape_bytes(i.shape)
    return Kernel(i.name, ATTENTION, times, flops, nbytes, attention_seconds(flops, backward, head_dim, nbytes, p))


class _Walker:
    def __init__(self, text: str, p: Perf, n_devices: int, mesh: dict[str, int] | None = None):
        self.comps, self.entry = parse_module(text)
        self.texts = hlo.hlo_computations(text)
        self.p, self.n_devices, self.mesh = p, n_devices, mesh
        self.kernels: list[Kernel] = []
        self.unknown_trips: list[str] = []
        # async collectives started and not yet done: name -> [seconds left per execution, executions]
        self.inflight: dict[str, list[float]] = {}
        self.hidden_seconds = 0.0  # collective time the compute between start and done covered

    def _overlap(self, k: Kernel) -> None:
        """Compute kernel k runs while the collectives in flight move data (in the order they started)."""
        spare = k.seconds * k.times  # over every execution of k
        for c in self.inflight.values():
            if spare <= 0:
                break
            used = min(c[0], spare / c[1])
            c[0] -= used
            spare -= used * c[1]
            self.hidden_seconds += used * c[1]

    def _all(self, name: str, seen: set | None = None) -> list[Instr]:
        """A fused computation's instructions and those of computations it calls (nested fusions)."""
        seen = seen if seen is not None else set()
        if name in seen or name not in self.comps:
            return []
        seen.add(name)
        out = list(self.comps[name])
        for i in self.comps[name]:
            for callee in _called(i.line):
                out += self._all(callee, seen)
        return out

    def visit(self, name: str, times: int, depth: int, condition: bool = False) -> None:
        if name not in self.comps or depth > 64:
            return
        types = {i.name: i.shape for i in self.comps[name]}
        for i in self.comps[name]:
            op = i.opcode
            if op.endswith("-done"):
                self.inflight.pop(i.operands[0] if i.operands else "", None)
                continue
            if op in _FREE or op == "async-update":
                continue
            if op == "while":
                trips = hlo._trip_count(i.line, self.texts)
                if trips is None:
                    self.unknown_trips.append(i.name)
                body = re.search(r"\bbody=%?([\w.\-]+)", i.line).group(1)
                cond = re.search(r"\bcondition=%?([\w.\-]+)", i.line).group(1)
                self.visit(body, times * (trips or 1), depth + 1)
                self.visit(cond, times * (trips or 1), depth + 1, condition=True)
            elif op in ("call", "async-start") or (op == "conditional"):
                callees = re.findall(r"\b(?:to_apply|calls)=%?([\w.\-]+)", i.line)
                callees += [c for b in re.findall(r"branch_computations=\{([^}]*)\}", i.line)
                            for c in re.findall(r"%?([\w.\-]+)", b)]
                for callee in callees:
                    self.visit(callee, times, depth + 1, condition)
            else:
                k = self._kernel(i, types, times, depth)
                self.kernels.append(k._replace(group=OTHER) if condition else k)  # a loop's test
                if k.group == COLLECTIVE and op.endswith("-start"):
                    self.inflight[i.name] = [k.seconds - self.p.launch_seconds, times]
                elif k.group != COLLECTIVE:
                    self._overlap(k)

    def _kernel(self, i: Instr, types: dict[str, str], times: int, depth: int) -> Kernel:
        p, op = self.p, i.opcode
        operand_types = [types.get(o, "") for o in i.operands]
        own_name = m.group(1) if (m := re.search(r'op_name="([^"]*)"', i.line)) else ""
        if _COLLECTIVE.match(op):
            kind = _COLLECTIVE.match(op).group(1)
            n = hlo._group_size(i.line) or self.n_devices
            result = i.shape
            if op.endswith("-start") and i.shape.startswith("(("):  # ((inputs), outputs): the outputs
                result = i.shape[_balanced(i.shape, 1):]
            wire = hlo.shape_bytes(result) * hlo._WIRE[kind](n) if n > 1 else 0.0
            axes = mesh_axes(i.line, self.n_devices, self.mesh) if self.mesh else ""
            if n <= 1:
                return Kernel(i.name, COLLECTIVE, times, 0.0, 0.0, p.launch_seconds, axes)
            if not spans_nodes(i.line, self.n_devices, p.gpus_per_node):
                bandwidth, latency = p.link_bytes_per_s, p.link_latency_seconds
            else:  # one ring per NIC for ring collectives; all-to-all and permutes: each GPU's own NIC
                nics = ring_nics(i.line, self.n_devices, p.gpus_per_node) if kind in _RINGS else 1
                bandwidth, latency = min(p.link_bytes_per_s, nics * p.network_bytes_per_s), p.network_latency_seconds
            steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
            return Kernel(i.name, COLLECTIVE, times, 0.0, wire, wire / bandwidth + steps * latency + p.launch_seconds,
                          axes)
        if op == "custom-call":
            nbytes = sum(map(hlo.shape_bytes, operand_types)) + hlo.shape_bytes(i.shape)
            if k := _attention_call(i, operand_types, times, p):
                return k
            if _is_gemm_call(i) and len(operand_types) >= 2:
                return _gemm_call(i, operand_types, times, p)
            return Kernel(i.name, OTHER, times, 0.0, nbytes, memory_seconds(nbytes, p))
        if op in ("fusion", "fusion-start"):
            callee = _called(i.line)[0]
            body = self._all(callee)
            calls = [d for d in body if _is_gemm_call(d) and len(d.operands) >= 2]
            inner = {d.name: d.shape for d in body}
            if calls:  # XLA's dynamic-slice fusion: a cuBLAS call that reads its operands' slices in place
                k = _gemm_call(calls[0], [inner.get(o, "") for o in calls[0].operands], times, p)
                return k._replace(name=i.name)
            for d in body:  # the same around an attention kernel (tokamax's backward, reading its statistics)
                if d.opcode == "custom-call" and (k := _attention_call(d, [inner.get(o, "") for o in d.operands], times, p)):
                    return k._replace(name=i.name)
            nbytes = _fused_bytes(self.comps.get(callee, []))
            dots = [d for d in body if d.opcode in ("dot", "scaled-dot")]
            if dots:
                inner = {d.name: d.shape for d in body}
                gs = [_gemm(d.line, inner.get(d.operands[0], ""), inner.get(d.operands[1], "")) for d in dots]
                flops = sum(2.0 * g.batch * g.m * g.n * g.k for g in gs)
                big = max(gs, key=lambda g: g.batch * g.m * g.n * g.k)
                group = GEMM
                if big.batched and _XLA_ATTENTION.search(big.op_name):
                    group = ATTENTION  # XLA attention's batched einsums (not Muon's, batched over layers)
                seconds = sum(gemm_seconds(g, nbytes / len(gs), p) for g in gs) - (len(gs) - 1) * p.launch_seconds
                return Kernel(i.name, group, times, flops, nbytes, seconds)
            names = [own_name] + [m.group(1) for d in body if (m := re.search(r'op_name="([^"]*)"', d.line))]
            group = FP8 if _fp8_work(i.shape, body, names) else self._group(names, {d.opcode for d in body}, depth)
            return Kernel(i.name, group, times, 0.0, nbytes, memory_seconds(nbytes, p))
        # an unfused op: copy, transpose, an in-place dynamic-update-slice, a reduce, ...
        if op in ("dynamic-update-slice",) and len(operand_types) > 1:
            nbytes = 2.0 * hlo.shape_bytes(operand_types[1])
        elif op in ("copy", "copy-start", "dynamic-slice", "slice", "transpose", "broadcast", "iota"):
            nbytes = 2.0 * hlo.shape_bytes(i.shape.split(")")[-1] if op == "copy-start" else i.shape)
        else:
            nbytes = sum(map(hlo.shape_bytes, operand_types)) + hlo.shape_bytes(i.shape)
        group = MOVEMENT if op in _MOVEMENT or op == "copy-start" else self._group([own_name], {op}, depth)
        if _fp8_work(i.shape, [i], [own_name]):
            group = FP8
        return Kernel(i.name, group, times, 0.0, nbytes, memory_seconds(nbytes, self.p))

    @staticmethod
    def _group(op_names: list[str], opcodes: set[str], depth: int) -> str:
        if opcodes <= _MOVEMENT:
            return MOVEMENT
        if any("/head/" in n for n in op_names):
            return LOSS
        if any(_XLA_ATTENTION.search(n) for n in op_names):
            return ATTENTION
        if any("jvp(" in n or "transpose(" in n for n in op_names):
            return ELEMENTWISE
        return ACCUMULATE if depth > 0 else OPTIMIZER


def replica_groups(line: str, n_devices: int) -> list[list[int]] | None:
    """A collective's groups of device ids: explicit ({{0,1},{2,3}}), iota ([G,n]<=[dims]T(perm)),
    over named mesh axes (mesh['a'=2,'b'=4] {'b'}, what collectives inside a shard_map print) or
    every device ({} or none given); None for a form not read here."""
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=(\S+))? \{([^}]*)\}", line):
        return _mesh_form_groups(m.group(1), m.group(2), m.group(3))
    if m := re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line):
        return [[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
        groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        perm = [int(x) for x in m.group(4).split(",")] if m.group(4) else list(range(len(dims)))
        strides = [math.prod(dims[j + 1:]) for j in range(len(dims))]
        order = [sum(idx[k] * strides[perm[k]] for k in range(len(dims)))
                 for idx in _indices([dims[q] for q in perm])]
        return [order[g * size:(g + 1) * size] for g in range(groups)]
    if re.search(r"replica_groups=\{\}", line) or "replica_groups" not in line:
        return [list(range(n_devices))]
    return None


def mesh_axes(line: str, n_devices: int, mesh: dict[str, int]) -> str:
    """The mesh axes a collective talks over, '+'-joined in mesh order ('cp', 'fsdp+tp'): those
    along which the devices of its first replica group (or first source-target pair) differ.
    Device ids are positions in the mesh's device order, as XLA numbers partitions; '?' where the
    groups are in a form not read here."""
    if m := re.search(r"source_target_pairs=\{\{(\d+),(\d+)\}", line):
        group = [int(m.group(1)), int(m.group(2))]
    else:
        groups = replica_groups(line, n_devices)
        group = groups[0] if groups else None
    if group is None:
        return "?"
    names, sizes = list(mesh), list(mesh.values())

    def coords(d: int) -> list[int]:
        out = []
        for size in reversed(sizes):
            d, r = divmod(d, size)
            out.append(r)
        return out[::-1]

    at = [coords(d) for d in group]
    return "+".join(a for k, a in enumerate(names) if len({c[k] for c in at}) > 1) or "none"


def _mesh_form_groups(axes: str, device_ids: str | None, named: str) -> list[list[int]] | None:
    """The groups of `replica_groups=mesh['a'=2,'b'=4] {'b'}`: the devices along the named axes of
    XLA's own mesh (its names need not be ours: the partitioner writes 'axis_0', ...), one group
    per position on the others; through `device_ids=[...]` where given."""
    sizes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", axes)]
    along = set(re.findall(r"'([^']+)'", named))
    strides = [math.prod(n for _, n in sizes[k + 1:]) for k in range(len(sizes))]
    members = _indices([n if a in along else 1 for a, n in sizes])
    groups = [[sum((o + i) * strides[k] for k, (o, i) in enumerate(zip(start, idx, strict=True))) for idx in members]
              for start in _indices([1 if a in along else n for a, n in sizes])]
    if device_ids:
        ids = [int(x) for x in re.findall(r"\d+", device_ids)]
        if len(ids) != math.prod(n for _, n in sizes):
            return None
        groups = [[ids[d] for d in g] for g in groups]
    return groups


def _indices(dims: list[int]) -> list[tuple[int, ...]]:
    """Every index of an array of shape dims, in row-major order."""
    out: list[tuple[int, ...]] = [()]
    for d in dims:
        out = [idx + (j,) for idx in out for j in range(d)]
    return out


_RINGS = ("all-reduce", "all-gather", "reduce-scatter")  # what NCCL runs as rings, one per NIC across nodes


def ring_nics(line: str, n_devices: int, gpus_per_node: int) -> int:
    """The NICs a ring collective over this op's replica groups drives at once where they span
    nodes: NCCL runs one ring per NIC, so a group with k of its GPUs in every node it touches
    sends k NICs' worth (the fewest over its nodes and groups; unknown forms: 1)."""
    groups = replica_groups(line, n_devices)
    if groups is None:
        return 1
    per_node = [collections.Counter(d // gpus_per_node for d in g) for g in groups]
    return max(1, min(min(c.values()) for c in per_node))


def spans_nodes(line: str, n_devices: int, gpus_per_node: int) -> bool:
    """Whether any replica group of this collective holds devices of two nodes (unknown forms: by
    the group size alone)."""
    groups = replica_groups(line, n_devices)
    if groups is None:
        return (hlo._group_size(line) or n_devices) > gpus_per_node
    return any(len({d // gpus_per_node for d in g}) > 1 for g in groups)


def kernels(text: str, p: Perf, n_devices: int = 1) -> tuple[list[Kernel], list[str]]:
    """Every kernel one step of the compiled program `text` launches, costed on device `p`, and the
    loops whose trip count was unreadable (counted once)."""
    w = _Walker(text, p, n_devices)
    if w.entry:
        w.visit(w.entry, 1, 0)
    return w.kernels, w.unknown_trips


def estimate(text: str, p: Perf, n_devices: int = 1, tokens_per_step: int | None = None,
             model_flops_per_token: float | None = None, mesh: dict[str, int] | None = None) -> dict[str, Any]:
    """The predicted step: seconds, the kernels grouped (GROUPS), the costliest kernels, and with
    tokens_per_step / model_flops_per_token (jaxgpt.metrics.flops_per_token) tokens/s and MFU
    against the device's bf16 peak (per device: tokens_per_step is the global batch). With the
    `mesh` (axis -> size, in mesh order), the collectives' time and wire bytes per mesh axis."""
    w = _Walker(text, p, n_devices, mesh)
    if w.entry:
        w.visit(w.entry, 1, 0)
    ks, unknown = w.kernels, w.unknown_trips
    total = sum(k.seconds * k.times for k in ks) - w.hidden_seconds
    groups = {g: {"seconds": 0.0, "launches": 0, "flops": 0.0, "bytes": 0.0} for g in GROUPS}
    for k in ks:
        row = groups[k.group]
        row["seconds"] += k.seconds * k.times
        row["launches"] += k.times
        row["flops"] += k.flops * k.times
        row["bytes"] += k.bytes * k.times
    top = sorted(ks, key=lambda k: -k.seconds * k.times)[:12]
    out = {"device": p.name, "step_seconds": total, "launches": sum(k.times for k in ks), "groups": groups,
           "top_kernels": [{"name": k.name, "group": k.group, "times": k.times,
                            "ms_per_step": 1e3 * k.seconds * k.times, "flops": k.flops, "bytes": k.bytes} for k in top],
           "unknown_trip_counts": sorted(set(unknown)), "tokens_per_sec": None, "mfu": None,
           "collectives_hidden_seconds": w.hidden_seconds,
           "collectives_exposed_seconds": groups[COLLECTIVE]["seconds"] - w.hidden_seconds,
           "collectives_by_axes": _by_axes(ks) if mesh else {}}
    if tokens_per_step and total:
        out["tokens_per_sec"] = tokens_per_step / total
        if model_flops_per_token:
            out["mfu"] = out["tokens_per_sec"] * model_flops_per_token / (n_devices * p.peak_flops)
    return out


def _by_axes(ks: list[Kernel]) -> dict[str, dict[str, float]]:
    """Collective seconds (before overlap), wire bytes and launches per step by mesh axes, costliest first."""
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"seconds": 0.0, "bytes": 0.0, "launches": 0})
    for k in ks:
        if k.group == COLLECTIVE and k.axes not in ("", "none"):
            row = out[k.axes]
            row["seconds"] += k.seconds * k.times
            row["bytes"] += k.bytes * k.times
            row["launches"] += k.times
    return dict(sorted(out.items(), key=lambda item: -item[1]["seconds"]))


def format_estimate(e: dict[str, Any]) -> str:
    """The estimate as the plan prints it."""
    rate = f" | {e['tokens_per_sec']:,.0f} tokens/s" if e["tokens_per_sec"] else ""
    mfu = f" | MFU {100 * e['mfu']:.1f}%" if e["mfu"] is not None else ""
    lines = [f"predicted step time on {e['device']} (jaxgpt/gpu/cost.py, a model, not a measurement): "
             f"{1e3 * e['step_seconds']:,.1f} ms{rate}{mfu} | {e['launches']:,} kernel launches",
             f"{'group':<52}{'ms/step':>10}{'share':>8}{'launches':>10}{'TFLOP':>9}{'GB':>9}"]
    for g, row in e["groups"].items():
        if row["launches"]:
            lines.append(f"{g:<52}{1e3 * row['seconds']:>10,.1f}{100 * row['seconds'] / e['step_seconds']:>7.1f}%"
                         f"{row['launches']:>10,}{row['flops'] / 1e12:>9,.1f}{row['bytes'] / 1e9:>9,.1f}")
    if e["groups"][COLLECTIVE]["launches"]:
        lines.append(f"collectives: {1e3 * e['collectives_hidden_seconds']:,.1f} ms of them overlap compute in "
                     f"XLA's schedule (not in the step time), {1e3 * e['collectives_exposed_seconds']:,.1f} ms exposed")
    if e.get("collectives_by_axes"):
        lines.append("collectives by mesh axis (before overlap): " + "; ".join(
            f"{axes} {1e3 * row['seconds']:,.1f} ms ({100 * row['seconds'] / e['step_seconds']:.1f}% of the step), "
            f"{row['bytes'] / 1e9:,.1f} GB sent" for axes, row in e["collectives_by_axes"].items()))
    if e["unknown_trip_counts"]:
        lines.append(f"warning: loop trip count unreadable ({', '.join(e['unknown_trip_counts'])}): counted once")
    return "\n".join(lines)

"""Reading compiled HLO text: which collectives a step runs and how many bytes they move.

`compiled.as_text()` (after `jit(...).lower(...).compile()`) is the program XLA will run on each
device, with the collectives GSPMD inserted. This module reads it without JAX:

    collectives(text)         how many instructions of each kind the text holds
    collective_bytes(hlo)     bytes per step of each kind (the convention below)
    wire_bytes(hlo, n)        an estimate of the bytes each device sends per step, ring algorithms

What "bytes" means
------------------
`collective_bytes` counts, for every all-reduce / all-gather / reduce-scatter / all-to-all /
collective-permute, the size of its RESULT on one device: the product of the output shape times
the element size, summed over the elements of a tuple-shaped output (XLA combines many small
all-reduces into one tuple-shaped instruction). Asynchronous pairs are counted once, at the
`-done` instruction, whose shape is the result (the `-start` is often a tuple that also holds
the input). So an all-gather of a weight counts the gathered
weight, an all-reduce of a gradient counts the gradient, and a reduce-scatter counts the one
shard each device keeps.

That is not the traffic on the wire. With ring algorithms over a group of n devices each device
sends (the factors nccl-tests uses to turn algorithm bandwidth into bus bandwidth):

    all-reduce          2(n-1)/n x result        (reduce-scatter, then all-gather)
    all-gather           (n-1)/n x result
    reduce-scatter       (n-1)   x result        (= (n-1)/n x the input)
    all-to-all           (n-1)/n x result
    collective-permute         1 x result

`wire_bytes` applies these with n read from each instruction's `replica_groups` (the explicit
`{{0,1},...}` list, the iota form `[groups,n]<=[...]`, or the mesh form `mesh[...] {'axis'}`),
falling back to the caller's device count where the groups are not written out.

Loops
-----
A collective inside a `while` body (the scanned layers, the gradient-accumulation scan) runs once
per iteration, so it counts trip-count times; nested loops multiply. The trip count comes from
the loop's `known_trip_count` in its backend_config, which XLA writes for scans; failing that,
from the loop condition when it compares the counter with a single integer constant (a scan's
length). If neither can be read the loop is counted ONCE and `collective_bytes` warns, so the
figure is then a lower bound. Both branches of a `conditional` are counted, an upper bound.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import NamedTuple

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
         "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
         "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8,
         "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s*\b(" + "|".join(COLLECTIVES) + r")(-start|-done)?\(")
_CALLEES = re.compile(r"\b(calls|to_apply|body|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


class Collective(NamedTuple):
    kind: str         # one of COLLECTIVES
    bytes: int        # the result's size on one device
    group: int | None  # devices taking part, when replica_groups says
    times: int        # executions per step (the product of the enclosing loops' trip counts)


def hlo_computations(hlo: str) -> dict[str, str]:
    """Compiled HLO text -> {computation name: its body text}."""
    comps, name, lines = {}, None, []
    for line in hlo.splitlines():
        if name is None and line.endswith("{") and not line.startswith(" "):
            name, lines = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%"), []
        elif name is not None and line == "}":
            comps[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return comps


def collectives(text: str) -> dict[str, int]:
    """How many instructions of each collective kind `text` holds (async -start forms included)."""
    found = re.findall(r" (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", text)
    return {kind: found.count(kind) for kind in COLLECTIVES}


def while_bodies(hlo: str) -> list[str]:
    """Bodies of the while loops (the scanned layers), with the computations they call."""
    comps = hlo_computations(hlo)
    out = []
    for body_name in set(re.findall(r"body=%?([\w.\-]+)", hlo)):
        text, seen, todo = "", set(), [body_name]
        while todo:
            c = todo.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            text += comps[c] + "\n"
            todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[c])
        out.append(text)
    return out


def shape_bytes(shape: str) -> int:
    """'(f32[8,4]{1,0}, bf16[3])' -> 134: every array in the (tuple) shape, at its element size."""
    total_bits = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _BITS:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
        sizes = [int(d.lstrip("<=")) for d in dims.split(",") if d.strip()]
        total_bits += _BITS[dtype] * math.prod(sizes)
    return (total_bits + 7) // 8


def _group_size(line: str) -> int | None:
    if m := re.search(r"replica_groups=\{(\{[\d,]+\})", line):  # {{0,2},{1,3}}
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):  # [groups, n]<=[devices]
        return int(m.group(1))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\S+)? \{('[^}]*)\}", line):
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}  # mesh['a'=8,'b'=2] {'a'}
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", m.group(2)))
    return None  # {} (every device) or a form not read here


def _trip_count(line: str, comps: dict[str, str]) -> int | None:
    if m := re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line):
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", line)
    consts = re.findall(r"s(?:32|64)\[\] constant\((\d+)\)", comps.get(cond.group(1), "") if cond else "")
    return int(consts[0]) if len(consts) == 1 else None


def collective_ops(hlo: str) -> tuple[list[Collective], list[str]]:
    """Every collective the entry computation reaches, and the loops whose trip count was unreadable."""
    comps = hlo_computations(hlo)
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo, re.M)
    ops: list[Collective] = []
    unknown: list[str] = []

    def visit(name: str, times: int, depth: int) -> None:
        if depth > 64 or name not in comps:
            return
        started: dict[str, int | None] = {}  # async -start name -> its group (the -done has none)
        for line in comps[name].splitlines():
            if m := _INSTR.match(line):
                instr, shape, kind, phase = m.groups()
                if phase == "-start":
                    started[instr] = _group_size(line)
                else:
                    source = re.search(r"-done\(%?([\w.\-]+)", line) if phase else None
                    group = started.get(source.group(1)) if source else _group_size(line)
                    ops.append(Collective(kind, shape_bytes(shape), group, times))
            if re.search(r" async-(?:update|done)\(", line):
                continue  # the async-start already led into the wrapped computation
            for key, callee in _CALLEES.findall(line):
                if key == "body":
                    trips = _trip_count(line, comps)
                    if trips is None:
                        unknown.append(callee)
                    visit(callee, times * (trips or 1), depth + 1)
                elif key != "to_apply":  # reducers hold no collectives
                    visit(callee, times, depth + 1)
            for branches in _BRANCHES.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", branches):
                    visit(callee, times, depth + 1)

    if entry:
        visit(entry.group(1), 1, 0)
    return ops, unknown


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes of collective results per device per step, by kind (see the module docstring)."""
    ops, unknown = collective_ops(hlo)
    if unknown:
        warnings.warn(f"trip count unreadable for while loop(s) {', '.join(sorted(set(unknown)))}: "
                      "counted once, so collective bytes are a lower bound", stacklevel=2)
    return {kind: sum(op.bytes * op.times for op in ops if op.kind == kind) for kind in COLLECTIVES}


_WIRE = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
         "reduce-scatter": lambda n: n - 1, "all-to-all": lambda n: (n - 1) / n,
         "collective-permute": lambda n: 1.0}


def wire_bytes(hlo: str, n_devices: int) -> dict[str, int]:
    """Estimated bytes each device sends per step, by kind, for ring algorithms (module docstring);
    a group size the HLO does not write out is taken to be all `n_devices`."""
    ops, _ = collective_ops(hlo)
    out = dict.fromkeys(COLLECTIVES, 0)
    for op in ops:
        n = op.group or n_devices
        if n > 1:
            out[op.kind] += round(op.bytes * op.times * _WIRE[op.kind](n))
    return out


_GEMM_TARGET = re.compile(r'custom_call_target="__cu(?:blas|dnn)\$[\w$]*(?:gemm|matmul)[\w$]*"')
_FP8 = re.compile(r"\bf8e[45]m[23]\w*\[")


_GEMM_FUSION = re.compile(r'\bkind=kCustom\b.*"fusion_backend_config":\{"kind":"__\w*gemm')  # Triton GEMMs
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ARRAY_RESULT = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ([a-z][a-z0-9]*\[[^\]]*\])", re.M)
# The named scopes jaxgpt puts around its GEMMs (jaxgpt/lowering/fp8.py `linear`, jaxgpt/lowering/loss.py)
BLOCK_LINEARS = ("qkv", "attn_out", "mlp_in", "mlp_gate", "mlp_out", "expert_in", "expert_gate", "expert_out")
LAYERS = (*BLOCK_LINEARS, "head")


def _gemm_calls(hlo: str):
    """(instruction line, its operands' text) for every GEMM call: a cuBLAS/cuDNN GEMM custom call
    or a GEMM fusion (Triton), not a fusion that merely consumes one. Compiled HLO often names a
    fusion's operands without their types; the fused computation's parameters carry them."""
    signatures = {m.group(1): m.group(2) for m in re.finditer(r"^%?([\w.\-]+) \((.*)\) -> ", hlo, re.M)}
    types = {m.group(1): m.group(2) for m in _ARRAY_RESULT.finditer(hlo)}  # instruction -> its array type
    for line in hlo.splitlines():
        if _GEMM_TARGET.search(line) or (" fusion(" in line and _GEMM_FUSION.search(line)):
            call = re.search(r"(?:custom-call|fusion)\(([^)]*)\)", line)  # the operands, not a tuple result
            operands = call.group(1) if call else ""
            operands += " " + " ".join(types.get(name, "") for name in re.findall(r"%([\w.\-]+)", operands))
            if callee := re.search(r"\bcalls=%?([\w.\-]+)", line):
                operands += " " + signatures.get(callee.group(1), "")
            yield line, operands


def _is_fp8(line: str, operands: str) -> bool:
    return "$f8" in line or bool(_FP8.search(operands))


def gemm_counts(hlo: str) -> dict[str, int]:
    """GEMM library calls in XLA:GPU's compiled HLO: {'fp8': n, 'other': m}.

    jaxgpt's fp8 matmuls are dots with fp8 operands (jaxgpt/lowering/fp8.py); XLA:GPU compiles them to a
    cuBLASLt fp8 call (`__cublas$lt$matmul$f8`) or a Triton GEMM fusion whose operands are fp8
    (what it picks without autotuning, i.e. in a deviceless compile). Both count as fp8. A loop
    body's call counts once, as written. XLA:CPU has neither, so both counts are 0 there."""
    out = {"fp8": 0, "other": 0}
    for line, operands in _gemm_calls(hlo):
        out["fp8" if _is_fp8(line, operands) else "other"] += 1
    return out


class Gemm(NamedTuple):
    layer: str   # one of LAYERS, or "other" (a GEMM outside jaxgpt's named scopes)
    role: str    # "forward", "recompute" (a forward GEMM rerun in the backward pass by remat), "backward"
    fp8: bool


def gemm_layers(hlo: str) -> list[Gemm]:
    """Every GEMM call of the compiled HLO with the layer it belongs to, read from the named scope
    in its op_name metadata. A GEMM under `transpose(...)` is backward work; one there whose
    operands are all e4m3 is a forward GEMM that remat recomputes (gradients are e5m2)."""
    out = []
    for line, operands in _gemm_calls(hlo):
        name = m.group(1) if (m := _OP_NAME.search(line)) else ""
        scopes = name.split("/")
        layer = next((s for s in reversed(scopes) if s in LAYERS), "other")
        fp8 = _is_fp8(line, operands)
        role = "forward"
        if "transpose(" in name:
            role = "recompute" if fp8 and "f8e5m2" not in operands else "backward"
        out.append(Gemm(layer, role, fp8))
    return out


def fp8_gemm_operand_types(hlo: str) -> set[str]:
    """The fp8 element types that reach GEMMs as operands (e.g. {'f8e4m3fn', 'f8e5m2'})."""
    return {t.rstrip("[") for _, operands in _gemm_calls(hlo) for t in _FP8.findall(operands)}


_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')
# tokamax's flash attention (model.attention=mosaic, jaxgpt/lowering/flash.py), jaxgpt's only Mosaic GPU
# kernels: the forward is traced as .../flash_attention_smNN/..., the backward's two (dQ; dK and dV)
# under other names; the op's own metadata does not survive a sharded compile
_MOSAIC_GPU = re.compile(r'custom_call_target="mosaic_gpu[^"]*"')
_FLASH_FORWARD = re.compile(r'op_name="[^"]*/flash_attention_sm\d+/')


def tokamax_attention_kind(line: str) -> str | None:
    """'forward' or 'backward' for a kernel of tokamax's flash attention, else None."""
    if not _MOSAIC_GPU.search(line):
        return None
    return "forward" if _FLASH_FORWARD.search(line) else "backward"


def fused_attention_counts(hlo: str) -> dict[str, int]:
    """Fused-attention kernels in XLA:GPU's compiled HLO: {'forward': n, 'backward': m}: cuDNN's
    custom calls `__cudnn$fmha...` (one backward call per layer) and tokamax's (model.attention=mosaic:
    two backward kernels per layer, dQ and dK/dV); a loop body's call is counted once, as written."""
    out = {"forward": 0, "backward": 0}
    for kind in _FMHA.findall(hlo):
        out["backward" if "Backward" in kind else "forward"] += 1
    for line in hlo.splitlines():
        if kind := tokamax_attention_kind(line):
            out[kind] += 1
    return out

"""`python -m jaxgpt.plan --search --target h100|h200 --gpus N`: every layout ranked, without GPUs.

A layout here is a mesh (pp x dp x fsdp x ep x tp over the N GPUs), a recompute policy
(model.remat: none, dots, attention, full) and a micro-batch count (train.grad_accum); everything else comes
from the config and its overrides. The search has three stages:

1. Enumerate: every product of N over the five axes that `config.validate` accepts for the model
   (heads, kv heads, MLP width and vocabulary divisible by tp; n_embd by fsdp; layers by pp;
   micro-batches by dp x fsdp x ep), each with every policy and every divisor of the batch as
   grad_accum. tp and ep are the mesh's fastest-varying axes (distributed.py), so tp x ep must
   divide the GPUs of one node (--gpus-per-node, default 8) unless mesh.allow_tp_across_hosts=true;
   a dense model takes ep=1 (there ep would only be another name for dp).
2. Prune with shapes alone (`analytic`): a lower bound on memory per GPU (the fp32 state sharded
   over fsdp x tp x pp, plus each layer's input for one micro-batch, what even remat=full keeps)
   drops what cannot fit; the rest are ordered, per remat policy, by whether an estimate of their
   memory (the state and the activations the policy saves, `activation_bytes`) fits, then by a
   rough step time (FLOPs at a typical efficiency, recompute, the pipeline bubble, a per-kernel
   overhead per micro-batch, and the ring traffic of tp, fsdp and dp over NVLink inside a node or
   between nodes one NIC per GPU of the group in each node, `ring_bandwidth`), and the policies
   take turns (`pick`).
3. Compile the first `--compile-top` of that order with XLA:GPU for compile-only GPUs (the real
   train step, jaxgpt.plan), drop those whose compiled peak memory exceeds the GPU's, and rank the
   rest by the step-time model's prediction (jaxgpt/gpu/cost.py); a candidate XLA cannot compile
   is listed with its error. Each compiled result is cached
   on disk (JAXGPT_CACHE, else ~/.cache/jaxgpt, `plan-search/`), keyed by the config, target, GPU
   count and the sources of the cost model, so a second search compiles only what is new.

The ranking is deterministic: candidates are ordered by their estimate, ties broken by the
layout's text. Ctrl-C during the compiles stops the search about a second later, dropping the
compile in progress, and prints the ranking of what was compiled before; those are cached, so the
same command goes on from them (`interrupted_line`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from jaxgpt import __version__
from jaxgpt.config import Config, MeshConfig, validate
from jaxgpt.errors import UserError
from jaxgpt.gpu.perf import Perf

REMATS = ("none", "dots", "attention", "full")
GIB = 2**30
STATE_BYTES_PER_PARAM = 16  # fp32 parameters, gradients and two AdamW moments
# The rough step time of stage 2 (only orders candidates; the compiled prediction ranks them)
TYPICAL_EFFICIENCY = 0.5     # of the bf16 peak, for a whole step's FLOPs
RECOMPUTE = {"none": 1.0, "dots": 1.1, "full": 4 / 3}  # FLOPs relative to no recompute (attention: `recompute`)
KERNELS_PER_LAYER = 40       # launches per layer per micro-batch, forward and backward


class Candidate(NamedTuple):
    sizes: dict[str, int]   # pp, dp, fsdp, ep, tp
    remat: str
    grad_accum: int

    @property
    def mesh(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.sizes.items() if s > 1 or a == "dp")

    def key(self) -> str:
        return f"{self.mesh} {self.remat} {self.grad_accum}"

    def overrides(self) -> list[str]:
        return [f"model.remat={self.remat}", f"train.grad_accum={self.grad_accum}"]

    def config(self, cfg: Config) -> Config:
        return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **self.sizes),
                                   model=dataclasses.replace(cfg.model, remat=self.remat),
                                   train=dataclasses.replace(cfg.train, grad_accum=self.grad_accum))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(n: int, gpus_per_node: int, moe: bool, across_nodes: bool = False) -> list[dict[str, int]]:
    """Every pp x dp x fsdp x ep x tp = n, tp x ep inside a node unless across_nodes (see the docstring);
    cp stays 1 (a long-context layout is chosen by hand: `jaxgpt.plan --mesh ...,cp=N`)."""
    out = []
    for pp, fsdp, ep, tp in itertools.product(_divisors(n), repeat=4):
        if n % (pp * fsdp * ep * tp) or (ep > 1 and not moe):
            continue
        if not across_nodes and n > gpus_per_node and gpus_per_node % (ep * tp):
            continue
        if not across_nodes and n <= gpus_per_node and n % (ep * tp):
            continue
        out.append({"pp": pp, "dp": n // (pp * fsdp * ep * tp), "fsdp": fsdp, "cp": 1, "ep": ep, "tp": tp})
    return out


def candidates(cfg: Config, n: int, gpus_per_node: int) -> list[Candidate]:
    """Every valid (layout, remat, grad_accum) for cfg on n GPUs, in a fixed order."""
    out = []
    for sizes in layouts(n, gpus_per_node, bool(cfg.model.moe_experts), cfg.mesh.allow_tp_across_hosts):
        for remat, accum in itertools.product(REMATS, _divisors(cfg.train.batch_size)):
            c = Candidate(sizes, remat, accum)
            try:
                validate(c.config(cfg), n)
            except UserError:
                continue
            out.append(c)
    return out


def _stride(sizes: dict[str, int], axis: str) -> int:
    """Device-id distance between neighbours of an `axis` group: the mesh is cut from devices in
    process order (distributed.py), so it is the product of the sizes of the axes after it."""
    return math.prod(sizes.get(a, 1) for a in MeshConfig.AXES[MeshConfig.AXES.index(axis) + 1:])


def inside_node(sizes: dict[str, int], axis: str, gpus_per_node: int) -> bool:
    """Whether each group of `axis` lies inside one node (it spans its size times its stride)."""
    return _stride(sizes, axis) * sizes[axis] <= gpus_per_node


def ring_bandwidth(sizes: dict[str, int], axis: str, gpus_per_node: int, p: Perf) -> float:
    """Bytes/s of a ring collective over `axis`: NVLink inside a node; across nodes one NIC per
    GPU of the group in each node, NCCL's rings running side by side (cost.ring_nics), at most NVLink."""
    if inside_node(sizes, axis, gpus_per_node):
        return p.link_bytes_per_s
    per_node = max(1, min(sizes[axis], gpus_per_node // _stride(sizes, axis)))
    return min(p.link_bytes_per_s, per_node * p.network_bytes_per_s)


def _ring(k: int) -> float:
    """All-reduce wire bytes per byte of the buffer, ring algorithm over k GPUs."""
    return 2 * (k - 1) / k


def activation_bytes(cfg: Config, c: Candidate) -> float:
    """Estimated bytes per GPU that one micro-batch's saved activations take, by remat policy: per
    token and layer, the layer input (full), the matmul outputs (dots) or every intermediate
    (none), the parts inside attention and the MLP split over tp. `none` matched llama-1b's
    compiled fsdp=8 step (XLA's memory analysis, 2026-11-26) within 3%; full also holds one layer's
    intermediates while it recomputes it."""
    m, s = cfg.model, c.sizes
    D, F, kv, tp = m.n_embd, m.mlp_width, 2 * m.kv_heads * m.head_dim, s["tp"]
    up = 2 * F if m.mlp == "swiglu" else F
    none = 3 * (5 * D + (2 * D + kv + 2 * up + F) / tp)  # bf16 and fp32 pieces: ~3 bytes per value
    per_layer = {"full": 2 * D, "attention": 2 * D + 2 * D / tp, "dots": 2 * (3 * D + (2 * D + kv + up) / tp),
                 "none": none}[c.remat]
    rows = cfg.train.batch_size // c.grad_accum // (s["dp"] * s["fsdp"] * s["ep"])
    layers = m.n_layer // s["pp"]
    return rows * m.seq_len * (layers * per_layer + (none if c.remat in ("full", "attention") else 0))


def recompute(cfg: Config, remat: str) -> float:
    """A step's FLOPs under `remat` relative to none. `attention` recomputes each block's forward but
    its attention (jaxgpt/model/remat.py): 6N + 12LTD per token (jaxgpt.metrics.flops_per_token)
    plus the forward's weight matmuls, 2N, where `full` adds the whole forward, 2N + 4LTD."""
    if remat != "attention":
        return RECOMPUTE[remat]
    from jaxgpt.metrics import flops_per_token
    from jaxgpt.model import param_count
    return 1 + 2 * param_count(cfg.model, include_position=False, active=True) / flops_per_token(cfg.model)


def analytic(cfg: Config, c: Candidate, p: Perf, gpus_per_node: int) -> dict[str, float]:
    """Shapes-only estimates for candidate c: `floor_bytes` (a lower bound on memory per GPU: the
    state and each layer's input), `bytes` (an estimate: the state and `activation_bytes`) and
    `seconds` (a rough step time, to order candidates; module docstring)."""
    from jaxgpt.config import pipeline_microbatches
    from jaxgpt.metrics import flops_per_token
    from jaxgpt.model import param_count
    m, t, s = cfg.model, cfg.train, c.sizes
    n = math.prod(s.values())
    P = param_count(m)
    state = STATE_BYTES_PER_PARAM * P / (s["fsdp"] * s["tp"] * s["pp"])
    rows = t.batch_size // c.grad_accum // (s["dp"] * s["fsdp"] * s["ep"])  # per GPU per micro-batch
    layers = m.n_layer // s["pp"]
    floor = state + rows * m.seq_len * m.n_embd * 2 * layers
    tokens = t.batch_size * m.seq_len
    compute = flops_per_token(m) * tokens * recompute(cfg, c.remat) / (n * p.peak_flops * TYPICAL_EFFICIENCY)
    M = pipeline_microbatches(c.config(cfg), s)
    compute *= 1 + (s["pp"] - 1) / (cfg.pipeline.repeats * M)
    overhead = c.grad_accum * M * layers * KERNELS_PER_LAYER * 5e-6
    link = {a: ring_bandwidth(s, a, gpus_per_node, p) for a in s}
    comm = 0.0
    if s["tp"] > 1:  # 4 all-reduces of the activations per layer and micro-batch (2 forward, 2 backward)
        act = rows * m.seq_len * m.n_embd * 2
        comm += c.grad_accum * layers * 4 * act * _ring(s["tp"]) / link["tp"]
    if s["fsdp"] > 1:  # bf16 weights gathered forward and backward, fp32 gradients reduce-scattered
        shard = P / (s["tp"] * s["pp"])
        comm += c.grad_accum * shard * (2 + 2 + 4) * _ring(s["fsdp"]) / 2 / link["fsdp"]
    if s["dp"] > 1:  # one gradient all-reduce per step
        comm += 4 * P / (s["fsdp"] * s["tp"] * s["pp"]) * _ring(s["dp"]) / link["dp"]
    return {"floor_bytes": floor, "bytes": state + activation_bytes(cfg, c), "seconds": compute + overhead + comm}


def _cache_key(cfg: Config, target: str, n: int, memory: int, gpus_per_node: int) -> str:
    from jaxgpt.gpu import cost, perf
    h = hashlib.sha256(json.dumps([cfg.to_dict(), target, n, memory, gpus_per_node, __version__], sort_keys=True,
                                  default=str).encode())
    for module in (cost, perf):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:24]


def compiled_row(cfg: Config, c: Candidate, target: str, n: int, memory: int, gpus_per_node: int,
                 plan_fn: Callable[[Config], dict], cache: Path | None) -> tuple[dict[str, Any], bool]:
    """(the compiled candidate's row, whether it came from the cache)."""
    key = _cache_key(c.config(cfg), target, n, memory, gpus_per_node)
    path = cache / f"{key}.json" if cache else None
    if path and path.is_file():
        return json.loads(path.read_text()), True
    p = plan_fn(c.config(cfg))
    e = p["predicted"]
    row = {"step_seconds": e["step_seconds"], "tokens_per_sec": e["tokens_per_sec"], "mfu": e["mfu"],
           "peak_bytes": p["memory"]["peak"], "fits": p["fits"], "compile_seconds": p["compile_seconds"],
           "collective_seconds": e["groups"]["collectives"]["seconds"],
           "collective_exposed_seconds": e["collectives_exposed_seconds"]}
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(row))
        tmp.replace(path)
    return row, False


def pick(fitting: list[Candidate], estimates: dict[str, dict], memory: int, k: int) -> list[Candidate]:
    """The k candidates to compile: per remat policy, those estimated to fit first, then by the rough
    step time; the policies taken in turn (none, dots, attention, full, none, ...), because the rough time
    knows least about what recompute and XLA's own rematerialisation cost."""
    def order(c: Candidate):
        e = estimates[c.key()]
        return e["bytes"] > memory, e["seconds"], c.key()
    queues = [sorted((c for c in fitting if c.remat == r), key=order) for r in REMATS]
    turns = itertools.chain.from_iterable(itertools.zip_longest(*queues))
    return [c for c in turns if c is not None][:k]


def search(cfg: Config, n: int, target: str, plan_fn: Callable[[Config], dict], *, gpus_per_node: int = 8,
           compile_top: int = 12, memory_bytes: int | None = None, cache: Path | None = None,
           progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The ranked layouts: {'ranked': [(Candidate, row)], 'dropped': [...], 'counts': {...},
    'interrupted': bool}. plan_fn(cfg) compiles cfg's step for the n compile-only GPUs and says
    whether it fits (jaxgpt.plan.plan); memory_bytes: per GPU (default: the target's)."""
    from jaxgpt.gpu import perf
    from jaxgpt.gpu import target as gpu_target
    memory = memory_bytes or gpu_target.device_memory_bytes(target)
    device = perf.perf(target, gpus_per_node)
    everything = candidates(cfg, n, gpus_per_node)
    estimates = {c.key(): analytic(cfg, c, device, gpus_per_node) for c in everything}
    fitting = [c for c in everything if estimates[c.key()]["floor_bytes"] <= memory]
    chosen = pick(fitting, estimates, memory, compile_top)
    ranked, dropped, interrupted = [], [], False
    try:
        for i, c in enumerate(chosen, 1):
            progress(f"search: compiling {i}/{len(chosen)}: --mesh {c.mesh} model.remat={c.remat} "
                     f"train.grad_accum={c.grad_accum}")
            try:
                row, cached = compiled_row(cfg, c, target, n, memory, gpus_per_node, plan_fn, cache)
            except (UserError, RuntimeError) as e:  # XLA's compile errors are RuntimeErrors
                dropped.append((c, {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:160]}))
                progress(f"search: {i}/{len(chosen)} failed: {dropped[-1][1]['error']}")
                continue
            (ranked if row["fits"] else dropped).append((c, row))
            progress(f"search: {i}/{len(chosen)} {'(cached) ' if cached else ''}{1e3 * row['step_seconds']:,.1f} ms, "
                     f"{row['peak_bytes'] / GIB:.1f} GiB{'' if row['fits'] else ': does not fit'}")
    except KeyboardInterrupt:
        interrupted = True
    ranked.sort(key=lambda cr: (cr[1]["step_seconds"], cr[0].key()))
    return {"ranked": ranked, "dropped": dropped, "interrupted": interrupted, "memory_bytes": memory,
            "counts": {"valid": len(everything), "fit_estimate": len(fitting), "compiled": len(ranked) + len(dropped)}}


def train_command(config: str | None, overrides: Sequence[str], c: Candidate) -> str:
    """The `python -m jaxgpt.train` line that trains candidate c (what the search compiled)."""
    kept = [o for o in overrides if not o.startswith(("model.remat=", "train.grad_accum="))]
    parts = ["python -m jaxgpt.train", *([f"--config {config}"] if config else []), f"--mesh {c.mesh}", *kept,
             *c.overrides()]
    return " ".join(parts)


def format_search(result: dict[str, Any], name: str, target: str, n: int, config: str | None,
                  overrides: Sequence[str]) -> str:
    k, capacity = result["counts"], result["memory_bytes"] / GIB
    lines = [f"search: {name} on {n} x {target.upper()} | {k['valid']} valid layouts x remat x micro-batches, "
             f"{k['fit_estimate']} not ruled out by the memory estimate, {k['compiled']} compiled, "
             f"{len(result['ranked'])} need at most the {capacity:.1f} GiB a GPU has (GiB/GPU: what each needs)"
             + (" | interrupted: the ranking of what was compiled" if result["interrupted"] else ""),
             "predicted by jaxgpt/gpu/cost.py from XLA:GPU's compiled program (a model, not a measurement)", "",
             f"{'#':>2}  {'mesh':<28}{'remat':<10}{'accum':>6}{'step ms':>10}{'tokens/s':>12}{'MFU':>7}"
             f"{'GiB/GPU':>9}{'coll ms':>9}{'exposed ms':>11}"]
    for i, (c, r) in enumerate(result["ranked"], 1):
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        lines.append(f"{i:>2}  {c.mesh:<28}{c.remat:<10}{c.grad_accum:>6}{1e3 * r['step_seconds']:>10,.1f}"
                     f"{r['tokens_per_sec'] or 0:>12,.0f}{mfu:>7}{r['peak_bytes'] / GIB:>9.1f}"
                     f"{1e3 * r['collective_seconds']:>9,.1f}{1e3 * r['collective_exposed_seconds']:>11,.1f}")
    for c, r in result["dropped"]:
        why = f"error: {r['error']}" if "error" in r else \
            f"does not fit: needs {r['peak_bytes'] / GIB:.1f} of {capacity:.1f} GiB"
        lines.append(f" -  {c.mesh:<28}{c.remat:<10}{c.grad_accum:>6}   {why}")
    if result["ranked"]:
        lines += ["", "fastest: " + train_command(config, overrides, result["ranked"][0][0])]
    else:
        lines += ["", "no compiled layout fits; raise --compile-top, or use more GPUs"]
    return "\n".join(lines)


def as_json(result: dict[str, Any]) -> dict[str, Any]:
    """The search result with each candidate written out (for --json)."""
    def rows(pairs):
        return [{"mesh": c.sizes, "remat": c.remat, "grad_accum": c.grad_accum, **r} for c, r in pairs]
    return {**result, "ranked": rows(result["ranked"]), "dropped": rows(result["dropped"])}


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_args(args) -> None:
    """jaxgpt.plan's arguments for --search: a UserError before anything compiles."""
    if args.target is None:
        raise UserError("--search ranks layouts by the GPU step-time model: give --target h100 or h200 and --gpus N")
    if args.mesh is not None:
        raise UserError("--search chooses the mesh itself; drop --mesh")
    if args.compile_top is not None and args.compile_top < 1:
        raise UserError(f"--compile-top must be positive, got {args.compile_top}")


def interrupted_line(result: dict[str, Any], cache: Path) -> str:
    """The last line after a Ctrl-C: what was lost, and how to go on."""
    kept = sum("error" not in row for _, row in result["ranked"] + result["dropped"])
    return (f"interrupted; the compile in progress was dropped: run the same command to go on from the {kept} "
            f"layout(s) compiled so far (cached in {cache})")


def run(args, n: int, plan_fn: Callable[[Config], dict], cfg: Config, memory_bytes: int | None) -> None:
    """`python -m jaxgpt.plan --search ...` (args: jaxgpt.plan's): search, print the table, write --json;
    after a Ctrl-C, the ranking so far and then KeyboardInterrupt with `interrupted_line` (exit 130)."""
    from jaxgpt.files import cache_dir
    cache = cache_dir() / "plan-search"
    result = search(cfg, n, args.target, plan_fn, gpus_per_node=args.gpus_per_node or 8,
                    compile_top=args.compile_top or 12, memory_bytes=memory_bytes, cache=cache, progress=say)
    print(format_search(result, args.config or "shakespeare", args.target, n, args.config, args.overrides), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(as_json(result), f, indent=1)
    if result["interrupted"]:
        raise KeyboardInterrupt(interrupted_line(result, cache))

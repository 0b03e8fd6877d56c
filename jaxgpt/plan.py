"""`python -m jaxgpt.plan [--config FILE] [--mesh dp=2,fsdp=4] [--fake-devices N] [section.key=value ...]`

Will this config and layout fit, and how much will it talk? The train step is compiled ahead of
time for the mesh, from shapes alone (`jax.eval_shape`: nothing is allocated and nothing trains),
and the plan reports per device:

    parameters, gradients, optimizer state   from the state's shapes and shardings (exact), with
                                             an MoE model's expert weights on their own line
    arguments, outputs, temporaries, code    from XLA's memory analysis of the compiled step
    collectives per step                     from the compiled HLO (jaxgpt.hlo), and the time
                                             their ring traffic takes on common links

`--fake-devices N` plans a layout bigger than this machine: it sets
`XLA_FLAGS=--xla_force_host_platform_device_count=N` and `JAX_PLATFORMS=cpu` before JAX is
imported (which is why JAX is imported inside the functions here, not at the top). The step is
then compiled by XLA:CPU, so its memory analysis and collectives are estimates of what a GPU
compile would give: XLA:GPU fuses differently, combines small collectives, and turns the fsdp
gradient all-reduce + slice into a reduce-scatter. The state sizes are exact either way.

`--target h100|h200 [--gpus N]` compiles for N GPUs this machine does not have (jaxgpt/gpu): the
same step, compiled by XLA:GPU for compile-only devices, so memory, collectives, the attention
kernel (cuDNN fused attention, counted in the HLO) and fp8 GEMMs are the GPU's own, checked against
the device memory the target states. It needs `pip install -e ".[gpu-compile]"`. With a target the
plan also predicts the step time, tokens/s and MFU on that GPU from the compiled program, kernel by
kernel, with each group's share (jaxgpt/gpu/cost.py: a model calibrated on measured H100 steps).

`model.remat=auto` is resolved here as in training (jaxgpt/model/remat.py) against the device's
memory (a target's, a GPU's, or --device-memory-gib; CPU devices here stand for GPUs, so without
that flag they fit nothing and auto means none): the plan names the policy it chose and why.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from jaxgpt import files, hlo
from jaxgpt.cli import ArgumentParser, run_main
from jaxgpt.config import POSITIVE, Config, help_text, load_config, validate
from jaxgpt.errors import UserError
from jaxgpt.gpu import fp8_choice, search
from jaxgpt.hf.classes import check_init_from_hf

GIB, MIB = 2**30, 2**20
# Bandwidth in one direction, bytes/s: what one device's sends can use.
LINKS = {"PCIe 4 x16": 25e9, "PCIe 5 x16": 50e9, "NVLink 4 (H100/H200)": 450e9, "InfiniBand 400 Gb/s": 50e9}


def abstract_inputs(cfg: Config, mesh, setup) -> tuple[Any, Any]:
    """The train step's (state, batch) as ShapeDtypeStructs carrying their shardings."""
    import jax
    import numpy as np

    from jaxgpt.parallel.mesh import named
    from jaxgpt.step import abstract_state
    state = abstract_state(cfg, setup)
    batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), np.int32,
                                 sharding=named(mesh, ("batch", None)))
    if cfg.data.chat:  # fine-tuning: (tokens, loss weights), jaxgpt/step.py
        batch = (batch, jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len), np.float32,
                                             sharding=named(mesh, ("batch", None))))
    return state, batch


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays or ShapeDtypeStructs (the largest shard)."""
    import jax
    import numpy as np
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def expert_bytes(params) -> int:
    """Bytes one device holds of the MoE experts' weights (E/ep experts each; 0 for a dense model)."""
    mlp = params.get("groups", {}).get("moe", {}).get("mlp", {})
    return per_device_bytes({k: v for k, v in mlp.items() if k != "router_kernel"})


def memory_analysis(compiled) -> dict[str, int]:
    """XLA's per-device buffer sizes for a compiled step; `peak` = arguments + outputs - aliased
    (donated inputs reused as outputs) + temporaries + generated code."""
    m = compiled.memory_analysis()
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
           "generated_code": m.generated_code_size_in_bytes}
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"] + out["generated_code"]
    return out


def collective_summary(hlo_text: str, n_devices: int) -> dict[str, Any]:
    """Per kind: result bytes, ring wire bytes and executions per step; seconds on each of LINKS."""
    ops, unknown = hlo.collective_ops(hlo_text)
    wire = hlo.wire_bytes(hlo_text, n_devices)
    return {"bytes": hlo.collective_bytes(hlo_text), "wire_bytes": wire,
            "count": {k: sum(op.times for op in ops if op.kind == k) for k in hlo.COLLECTIVES},
            "link_seconds": {link: sum(wire.values()) / bw for link, bw in LINKS.items()},
            "unknown_trip_counts": sorted(set(unknown))}


def local_device(devices: Sequence):
    """The first of `devices` that this process drives: only those answer memory_stats(), and every
    process must reach the same verdict from its own (devices[0] is process 0's on every process)."""
    import jax
    return next((d for d in devices if d.process_index == jax.process_index()), devices[0])


def device_memory(device) -> int | None:
    """What one device says it can hold (memory_stats()['bytes_limit']); None where it does not say
    (CPUs, compile-only GPUs)."""
    try:
        return (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - compile-only devices refuse memory_stats()
        return None


def memory_per_device(devices: Sequence) -> int | None:
    """What one of `devices` may use, as `model.remat=auto` and the training run see it: a GPU's
    allocator limit; on a CPU, the host memory this process can still allocate (`host_memory_available`)
    shared by its local devices, as check_memory counts it (fake CPU devices each hold their own
    copy or shard). None where neither is known, and for a CPU job of several processes: each would
    read its own host's free memory at its own moment, and processes that chose different remat
    policies would compile different programs around the same collectives."""
    import jax

    device = local_device(devices)
    if device.platform != "cpu":
        return device_memory(device)
    if jax.process_count() > 1:
        return None
    available = host_memory_available()
    local = sum(d.process_index == device.process_index for d in devices)
    return None if available is None else available // local


def resolve_remat(cfg: Config, devices: Sequence) -> tuple[Config, str, int | None]:
    """(cfg with a concrete model.remat, why, the memory per device it was fitted to) for a run on
    `devices`, as training resolves model.remat=auto (jaxgpt/model/remat.py, `memory_per_device`)."""
    from jaxgpt.model import remat
    memory = memory_per_device(devices)
    cfg, why, _ = remat.resolve(cfg, memory, lambda c: plan(c, devices, memory))
    return cfg, why, memory


def host_memory_available() -> int | None:
    """Bytes this process can still allocate on the host: /proc/meminfo's MemAvailable, capped by
    the cgroup's (a container's) memory.max less its memory.current; None where Linux does not say."""
    available = []
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            available.append(1024 * int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]))
    with contextlib.suppress(OSError, ValueError):
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available.append(int(limit) - int((cgroup / "memory.current").read_text()))
    return min(available) if available else None


def activation_floor(cfg: Config, sizes: dict[str, int]) -> int:
    """Bytes per device that any train step of cfg needs beyond its state, at least: each layer's
    input for one micro-batch, in 2-byte floats (what the backward pass keeps even with
    model.remat=full). check_memory holds the run to this before compiling: XLA:CPU's compiler
    itself crashed (SIGFPE) on a step of a billion tokens a micro-batch."""
    m, t = cfg.model, cfg.train
    rows = t.batch_size // t.grad_accum // (sizes["dp"] * sizes["fsdp"] * sizes["ep"])
    tokens = rows * (m.seq_len // sizes.get("cp", 1))  # cp splits each sequence
    return tokens * m.n_embd * (m.n_layer // sizes["pp"] or 1) * 2


def check_memory(step, state, batch, mesh, device, per_device: int | None = None, floor: int = 0) -> None:
    """A UserError, before anything runs, when the run cannot fit its devices' memory.

    On a CPU the devices' memory is the host's, and running out ends the process with no word (the
    kernel's OOM killer): the train state's shapes are checked first (before compiling), then XLA's
    memory analysis of `step`, against what the host has available. On an accelerator that says
    what it holds (`device_memory`: a GPU's allocator limit), the memory analysis against that: a
    step whose buffers exceed it would fail at its first call with XLA's RESOURCE_EXHAUSTED. `step`
    is the train loop's own jitted step, so the compile here is the one its first call reuses.
    state and batch: the step's inputs as ShapeDtypeStructs with their shardings (`abstract_inputs`).
    per_device: `memory_per_device`'s figure where the caller already read it (train: the one
    `model.remat=auto` chose against, so the two never disagree); default: read now.
    floor: `activation_floor`'s bytes per device, checked with the state before compiling."""
    import jax

    cpu = device.platform == "cpu"
    local = len(mesh.local_devices) if cpu else 1  # fake CPU devices each hold their own copy or shard
    if per_device is not None:
        available = per_device * local
    else:
        available = host_memory_available() if cpu else device_memory(device)
    if available is None:
        return
    where = f"host memory over {local} CPU device(s)" if cpu else f"memory per {device.platform.upper()} device"
    state_bytes = per_device_bytes(state) * local
    if state_bytes > available:
        raise UserError(f"the train state alone (parameters and optimizer moments) needs {state_bytes / GIB:.1f} "
                        f"GiB of {where}, but {available / GIB:.1f} GiB is available; use a smaller model, an "
                        f"fsdp axis (each device then holds a shard of the state, not a copy), or "
                        + ("a machine with more memory" if cpu else "more devices"))
    if state_bytes + floor * local > available:
        raise UserError(f"the train step needs more than {(state_bytes + floor * local) / GIB:,.1f} GiB of {where} "
                        f"(train state {state_bytes / GIB:.1f} GiB, each layer's input for one micro-batch "
                        f"{floor * local / GIB:,.1f} GiB), but {available / GIB:.1f} GiB is available; use smaller "
                        f"micro-batches (train.batch_size, train.grad_accum), a smaller model, or "
                        + ("a machine with more memory" if cpu else "more devices"))
    with jax.set_mesh(mesh):
        memory = memory_analysis(step.lower(state, batch).compile())
    need = memory["peak"] * local
    if need > available:
        raise UserError(f"the train step needs {need / GIB:.1f} GiB of {where} (train state "
                        f"{state_bytes / GIB:.1f} GiB, the step's temporaries {memory['temporaries'] * local / GIB:.1f} "
                        f"GiB), but {available / GIB:.1f} GiB is available; use smaller micro-batches "
                        f"(train.grad_accum), model.remat=full, a smaller model, or "
                        + ("a machine with more memory" if cpu else "more devices (an fsdp axis)"))


class Compiled(NamedTuple):
    compiled: Any          # jax.stages.Compiled of the train step (cannot run on compile-only GPUs)
    state: Any             # the abstract TrainState it takes
    batch: Any             # the abstract batch it takes
    sizes: dict[str, int]  # the mesh
    dtype: Any             # the compute dtype
    kernel: str            # the attention kernel
    why: str               # why that kernel
    seconds: float         # tracing + compiling
    ops: str = "reference"  # the form the ops ran in (jaxgpt/lowering/: reference, tuned or tricks)


class Lowered(NamedTuple):
    """The train step traced and lowered, not yet compiled: tracing holds the GIL and swaps the
    cuDNN version check (jaxgpt.gpu.target.compiling_for), compiling does neither, so several steps
    are lowered one at a time and may then compile in threads (tests/test_gpu_compile.py)."""
    lowered: Any           # jax.stages.Lowered of the train step
    state: Any
    batch: Any
    sizes: dict[str, int]
    dtype: Any
    kernel: str
    why: str
    seconds: float         # tracing + lowering
    target: str | None     # 'h100' or 'h200' for compile-only GPUs
    fp8: bool = False      # the step has fp8 GEMMs (model.fp8 or model.fp8_head)
    ops: str = "reference"

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Compiled:
        from jaxgpt.gpu import target as gpu_target
        started = time.perf_counter()
        base = {}
        if self.target:  # fp8 GEMMs as the cuBLASLt calls a real GPU's autotuner picks (gpu/target.py)
            base = gpu_target.FP8_OPTIONS if self.fp8 else gpu_target.DEVICELESS_OPTIONS
        options = {**base, **(compiler_options or {})}
        compiled = self.lowered.compile(options or None)
        return Compiled(compiled, self.state, self.batch, self.sizes, self.dtype, self.kernel, self.why,
                        self.seconds + time.perf_counter() - started, self.ops)


def lower_step(cfg: Config, devices: Sequence, target: str | None = None) -> Lowered:
    """jaxgpt.step's train step for `devices`, traced from shapes alone and lowered.

    target: 'h100' or 'h200' when `devices` are compile-only GPUs (jaxgpt.gpu.target)."""
    import jax

    import jax.numpy as jnp

    from jaxgpt.gpu import target as gpu_target
    from jaxgpt.parallel.mesh import make_mesh
    from jaxgpt.step import make_setup, make_train_step
    if cfg.model.remat == "auto":
        raise ValueError("resolve model.remat=auto first (jaxgpt.remat.resolve)")
    sizes = validate(cfg, len(devices))
    cfg = fp8_choice.resolve(cfg, sizes, target)[0]  # model.fp8=auto, as `plan` resolves it
    mesh = make_mesh(sizes, list(devices))
    started = time.perf_counter()
    with gpu_target.compiling_for(devices, target) if target else contextlib.nullcontext():
        # Shapes are built outside set_mesh: optax's init runs small eager ops, which a mesh of
        # compile-only GPUs cannot run; only tracing needs the mesh.
        setup = make_setup(cfg, mesh)
        dtype, kernel, why = jnp.dtype(setup.ops.dtype), setup.ops.kernel, setup.ops.kernel_why
        state, batch = abstract_inputs(cfg, mesh, setup)
        # the default device too: what tokamax's kernels are chosen by (jaxgpt/lowering/flash.py)
        with jax.set_mesh(mesh), jax.default_device(devices[0]) if target else contextlib.nullcontext():
            lowered = make_train_step(cfg, mesh, setup).lower(state, batch)
    return Lowered(lowered, state, batch, sizes, dtype, kernel, why, time.perf_counter() - started, target,
                   bool(cfg.model.fp8_linears()) or cfg.model.fp8_head, setup.ops.form)


def compile_step(cfg: Config, devices: Sequence, target: str | None = None,
                 compiler_options: dict[str, Any] | None = None) -> Compiled:
    """jaxgpt.step's train step for `devices`, compiled ahead of time from shapes alone.

    target: 'h100' or 'h200' when `devices` are compile-only GPUs (jaxgpt.gpu.target).
    compiler_options: XLA debug options for this compile (e.g. {'xla_gpu_enable_triton_gemm': False})."""
    return lower_step(cfg, devices, target).compile(compiler_options)


def _not_fp8(text: str, kinds: frozenset[str]) -> list[str]:
    """The block GEMMs that model.fp8 should have made fp8 (those of `kinds`) but XLA did not, e.g.
    ['qkv backward x2']."""
    missed = collections.Counter(f"{g.layer} {g.role}" for g in hlo.gemm_layers(text)
                                 if g.layer in kinds and not g.fp8)
    return [name + (f" x{n}" if n > 1 else "") for name, n in sorted(missed.items())]


def plan(cfg: Config, devices: Sequence, device_memory_bytes: int | None = None,
         target: str | None = None, gpus_per_node: int = 8) -> dict[str, Any]:
    """Compiles cfg's train step for `devices` without running it; everything the plan prints.

    device_memory_bytes: what one device has (default: the target's, else its memory_stats()).
    target: 'h100' or 'h200' when `devices` are compile-only GPUs (jaxgpt.gpu.target).
    gpus_per_node: with a target, which collectives cross nodes (jaxgpt/gpu/cost.py).
    """
    import jax
    import numpy as np

    from jaxgpt.gpu import target as gpu_target
    cfg, fp8_rows, fp8_why = fp8_choice.resolve(cfg, validate(cfg, len(devices)), target)  # model.fp8=auto
    compiled, state, batch, sizes, dtype, kernel, why, compile_seconds, ops = compile_step(cfg, devices, target)
    text = compiled.as_text()
    predicted = None
    if target:  # a step-time model of XLA:GPU's program on that GPU (jaxgpt/gpu/cost.py)
        from jaxgpt.gpu import cost, perf
        from jaxgpt.metrics import flops_per_token
        predicted = cost.estimate(text, perf.perf(target, gpus_per_node), len(devices), cfg.train.batch_size * cfg.model.seq_len,
                                  flops_per_token(cfg.model), mesh=sizes)
    params = per_device_bytes(state.params)
    if device_memory_bytes is None:
        device_memory_bytes = gpu_target.device_memory_bytes(target) if target else device_memory(local_device(devices))
    memory = memory_analysis(compiled)
    return {
        "target": target, "compile_seconds": compile_seconds, "remat": cfg.model.remat, "ops": ops,
        "attention": {"kernel": kernel, "why": why, "fused_calls": hlo.fused_attention_counts(text)},
        "gemm_calls": hlo.gemm_counts(text), "not_fp8": _not_fp8(text, cfg.model.fp8_linears()),
        "fp8": cfg.model.fp8, "fp8_auto": {"why": fp8_why, "layers": [dict(c._asdict(), fp8=c.fp8,
                                                                           gain_seconds=c.gain_seconds) for c in fp8_rows]},
        "mesh": sizes, "devices": len(devices), "platform": devices[0].platform,
        "device_kind": devices[0].device_kind, "compute_dtype": np.dtype(dtype).name,
        "parameters": sum(x.size for x in jax.tree.leaves(state.params)),
        "state_bytes": {"parameters": params, "experts": expert_bytes(state.params),
                        "gradients": params,  # fp32, sharded like the parameters
                        "optimizer_state": per_device_bytes(state.opt_state), "batch": per_device_bytes(batch)},
        "memory": memory,
        "collectives": collective_summary(text, len(devices)),
        "device_memory_bytes": device_memory_bytes,
        "fits": None if device_memory_bytes is None else memory["peak"] <= device_memory_bytes,
        "pipeline": _pipeline(cfg, sizes, dtype),
        "predicted": predicted,
    }


def _pipeline(cfg: Config, sizes: dict[str, int], dtype) -> dict[str, Any] | None:
    import numpy as np

    from jaxgpt.config import pipeline_microbatches, round_rows
    from jaxgpt.parallel import pipeline
    if sizes["pp"] == 1:
        return None
    t, m = cfg.train, cfg.model
    M = pipeline_microbatches(cfg, sizes)
    rows = round_rows(cfg, sizes) // M
    return pipeline.schedule_summary(sizes["pp"], cfg.pipeline.repeats, M, t.grad_accum, m.n_layer, rows,
                                     m.seq_len, m.n_embd, np.dtype(dtype).itemsize)


def _mib(n: float) -> str:
    return f"{n / MIB:>12,.1f}"


def memory_line(need: int, capacity: int) -> str:
    """What the step needs of what a device has, in one line: the capacity alone read as usage."""
    verdict = "fits" if need <= capacity else "this would not fit"
    return f"memory per device: needs {need / MIB:,.1f} of {capacity / MIB:,.1f} MiB: {verdict}"


def format_plan(p: dict[str, Any], name: str, cfg: Config) -> str:
    t, m = cfg.train, cfg.model
    layout = ",".join(f"{a}={s}" for a, s in p["mesh"].items())
    kind = "" if p["device_kind"] == p["platform"] else f" ({p['device_kind']})"
    lines = [f"plan: {name} | mesh {layout} on {p['devices']} {p['platform']} devices{kind} | "
             f"{t.batch_size} x {m.seq_len} tokens/step in {t.grad_accum} micro-batch(es) | "
             f"compute {p['compute_dtype']}"]
    if p.get("target"):
        lines.append(f"note: compiled by XLA:GPU for compile-only {p['device_kind']} devices (--target "
                     f"{p['target']}; no GPU here, so no autotuning: GEMM kernel choices may differ)")
    a, gemm = p["attention"], p["gemm_calls"]
    no_fp8 = ""
    if p["fp8"] and p["platform"] != "cpu" and (not gemm["fp8"] or p["not_fp8"]):
        no_fp8 = f" (model.fp8={str(p['fp8']).lower()}, but XLA formed {'no fp8 GEMM' if not gemm['fp8'] else 'some block GEMMs in bf16'}" \
                 f"{': ' + ', '.join(p['not_fp8']) if p['not_fp8'] else ''})"
    lines.append(f"attention: {a['kernel']} ({a['why']}) | fused attention calls: {a['fused_calls']['forward']} "
                 f"forward, {a['fused_calls']['backward']} backward | GEMM calls: {gemm['fp8']} fp8, "
                 f"{gemm['other']} other{no_fp8}")
    if auto := p.get("fp8_auto", {}).get("why"):
        rows = [fp8_choice.Choice(c["kind"], c["uses"], c["bf16_seconds"], c["fp8_seconds"]) for c in p["fp8_auto"]["layers"]]
        lines += [auto, *fp8_choice.format_choices(rows)]
    lines.append(f"remat: {p['remat']} ({p.get('remat_why') or 'model.remat=' + p['remat']}) | ops {p['ops']} | "
                 f"compile {p['compile_seconds']:.1f} s")
    if p["platform"] == "cpu":
        lines.append("note: compiled by XLA:CPU, so memory and collectives are CPU-compiled estimates; a GPU "
                     "compile fuses, combines and schedules differently (fsdp grads: reduce-scatter, not all-reduce)")
    lines += [f"parameters: {p['parameters']:,} ({p['parameters'] / 1e6:.1f}M)", "",
              f"{'per device':<44}{'MiB':>12}"]
    s, mem = p["state_bytes"], p["memory"]
    rows = [("parameters (fp32)", s["parameters"])]
    if s.get("experts"):  # its AdamW moments are twice this, inside the optimizer state
        rows.append((f"  of which experts ({m.moe_experts // p['mesh']['ep']} of {m.moe_experts})", s["experts"]))
    rows += [("gradients (fp32, as the parameters)", s["gradients"]),
            ("optimizer state (AdamW moments)", s["optimizer_state"]), ("batch", s["batch"]),
            ("compiled step, XLA memory analysis:", None),
            ("  arguments (state + batch)", mem["arguments"]), ("  outputs (new state + metrics)", mem["outputs"]),
            ("  aliased (donated state reused)", -mem["aliased"]),
            ("  temporaries (activations, gradients, work)", mem["temporaries"]),
            ("  generated code", mem["generated_code"]), ("  total", mem["peak"])]
    lines += [f"{label:<44}{'' if v is None else _mib(v)}" for label, v in rows]
    if p["device_memory_bytes"]:
        lines.append(memory_line(mem["peak"], p["device_memory_bytes"]))
    if pp := p.get("pipeline"):
        S, R, M = pp["stages"], pp["repeats"], pp["microbatches"]
        lines += ["", f"pipeline: {pp['schedule']}, {S} stages x {R} chunk(s) of {pp['layers_per_chunk']} layers, "
                  f"{M} micro-batches per round, {pp['iterations']} iterations (R*M + S - 1): bubble "
                  f"{100 * pp['bubble']:.1f}% = ({S}-1)/({R}*{M}+{S}-1)",
                  f"pipeline: each stage sends {_mib(pp['send_bytes_per_step']).strip()} MiB of activations per "
                  f"step ({pp['iterations']} x {_mib(pp['block_bytes']).strip()} MiB forward, as much backward, x "
                  f"{t.grad_accum} round(s)): the collective-permutes below"]
    c = p["collectives"]
    lines += ["", "collectives per step (count: executions; MiB: result size per device; wire MiB: what each "
              "device sends with ring algorithms)",
              f"{'kind':<20}{'count':>8}{'MiB':>12}{'wire MiB':>12}"]
    lines += [f"{k:<20}{c['count'][k]:>8}{_mib(c['bytes'][k])}{_mib(c['wire_bytes'][k])}"
              for k in hlo.COLLECTIVES if c["count"][k]] or ["(none)"]
    if m.moe_experts and p["mesh"]["ep"] > 1:
        lines.append("(MoE: the all-to-alls move tokens to their experts and back, jaxgpt/model/moe.py)")
    if c["unknown_trip_counts"]:
        lines.append(f"warning: loop trip count unreadable ({', '.join(c['unknown_trip_counts'])}): counted "
                     "once, a lower bound")
    lines += ["", "time to send the wire bytes over one link, no overlap with compute:",
              "| link | GB/s | ms per step |", "| --- | --- | --- |"]
    lines += [f"| {link} | {LINKS[link] / 1e9:.0f} | {1e3 * sec:,.2f} |" for link, sec in c["link_seconds"].items()]
    if p.get("predicted"):
        from jaxgpt.gpu.cost import format_estimate
        lines += ["", format_estimate(p["predicted"])]
        if p["attention"]["kernel"] == "mosaic":
            lines.append("(model.attention=mosaic: tokamax's kernels are costed at cuDNN's measured efficiencies per "
                         "FLOP; no GPU has timed them yet, docs/benchmarks.md)")
    return "\n".join(lines)


def format_reference(tuned: dict[str, Any], reference: dict[str, Any]) -> str:
    """One line: the step predicted with model.ops=reference beside the plan's (docs/ops.md)."""
    ms = {k: 1e3 * p["predicted"]["step_seconds"] for k, p in (("tuned", tuned), ("reference", reference))}
    fits = "" if reference["fits"] is not False else ", and it would not fit"
    return (f"model.ops=reference (the plain maths, jaxgpt/model/ops.py): predicted {ms['reference']:,.1f} ms a step "
            f"against {ms['tuned']:,.1f} with ops {tuned['ops']}: the tricks claim "
            f"{100 * (ms['reference'] / ms['tuned'] - 1):.1f}% (docs/ops.md){fits}")


MAX_FAKE_DEVICES = 2048


def _fake_devices(n: int) -> None:
    """N CPU devices: must happen before JAX creates its backends, which read this once."""
    if n < 1:
        raise UserError(f"--fake-devices must be positive, got {n}")
    if n > MAX_FAKE_DEVICES:  # 4,096: XLA:CPU refused to compile ("Multiprocess computations ..."); 8,192 hung
        raise UserError(f"--fake-devices is at most {MAX_FAKE_DEVICES:,} (XLA:CPU compiles for no more in one process), "
                        f"got {n:,}; --target h100 --gpus N compiles for GPUs instead")
    import jax
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise UserError("--fake-devices must be set before JAX starts its devices; run python -m jaxgpt.plan")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def _target_devices(target: str, n: int) -> list:
    """n compile-only GPUs; JAX must start on the CPU platform (jaxgpt.gpu.target)."""
    from jaxgpt.gpu import target as gpu_target
    gpu_target.description(target)  # an unknown name fails before anything heavy
    if reason := gpu_target.plugin_missing_reason():
        raise UserError(reason)
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported, but its backends start on first use: not yet, here
        import jax
        jax.config.update("jax_platforms", "cpu")
    return gpu_target.compile_only_devices(target, n)


def _main(argv: Sequence[str] | None) -> None:
    parser = ArgumentParser(
        prog="python -m jaxgpt.plan", description="Compile the train step for a mesh and report memory and "
        "communication per device, without training.", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=help_text())
    parser.add_argument("--config", help="a YAML file, or the name of one in configs/ (default: shakespeare)")
    parser.add_argument("--mesh", help="device mesh, e.g. dp=8 or dp=2,fsdp=2,tp=2 or ep=4,dp=2 (unnamed axes are 1; "
                        "one may be -1)")
    parser.add_argument("--fake-devices", type=int, help="plan for N CPU devices (layouts bigger than this machine)")
    parser.add_argument("--target", help="compile for GPUs this machine lacks, with XLA:GPU: h100 or h200 "
                        "(needs pip install -e \".[gpu-compile]\")")
    parser.add_argument("--gpus", type=int, help="with --target: how many GPUs (default 1)")
    parser.add_argument("--device-memory-gib", type=float,
                        help="warn when a device needs more than this (default: the device's own, if it says)")
    parser.add_argument("--json", help="also write the plan to this file")
    parser.add_argument("--search", action="store_true", help="with --target and --gpus: rank every mesh x "
                        "model.remat x train.grad_accum by predicted step time (jaxgpt/gpu/search.py)")
    parser.add_argument("--gpus-per-node", type=int, help="with --target: GPUs per node (default 8); collectives "
                        "between nodes go over the network, and --search keeps tp and ep inside a node")
    parser.add_argument("--compile-top", type=int, help="with --search: compile this many of the best "
                        "estimates (default 12)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides, args.mesh)
    check_init_from_hf(cfg)  # refused as train refuses it
    if args.device_memory_gib is not None and args.device_memory_gib not in POSITIVE:
        raise UserError(f"--device-memory-gib must be {POSITIVE}, got {args.device_memory_gib}")
    if args.json:  # checked before compiling, not after
        files.writable_file(args.json, "--json")
    if args.gpus is not None and args.target is None:
        raise UserError("--gpus needs --target h100 or h200")
    if args.target is not None and args.fake_devices is not None:
        raise UserError("--target and --fake-devices are two different machines; give one")
    if args.search:
        search.check_args(args)
    elif args.compile_top is not None:
        raise UserError("--compile-top is an option of --search")
    if args.gpus_per_node is not None and (args.target is None or args.gpus_per_node < 1):
        raise UserError(f"--gpus-per-node needs --target and a positive count, got {args.gpus_per_node}")
    if args.fake_devices is not None:
        _fake_devices(args.fake_devices)
    if args.target is not None:
        devices = _target_devices(args.target, 1 if args.gpus is None else args.gpus)
    else:
        import jax
        devices = jax.devices()
    limit = None if args.device_memory_gib is None else int(args.device_memory_gib * GIB)
    if args.search:
        return search.run(args, len(devices), lambda c: plan(c, devices, limit, args.target, args.gpus_per_node or 8),
                          cfg, limit)
    from jaxgpt.gpu.target import device_memory_bytes
    from jaxgpt.model import remat
    memory = limit or (device_memory_bytes(args.target) if args.target else device_memory(local_device(devices)))
    per_node = args.gpus_per_node or 8
    cfg, remat_why, result = remat.resolve(cfg, memory, lambda c: plan(c, devices, limit, args.target, per_node))
    result = result or plan(cfg, devices, limit, args.target, per_node)
    result["remat_why"] = remat_why
    print(format_plan(result, args.config or "shakespeare", cfg), flush=True)
    if result["predicted"] and result["ops"] == "tuned" and not cfg.model.fp8_head:  # what the tricks claim
        reference = plan(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, ops="reference")), devices,
                         limit, args.target, per_node)
        result["reference_predicted"] = reference["predicted"]
        print(format_reference(result, reference), flush=True)
    if result["fits"] is False:
        print(f"warning: this would not fit: the step needs {result['memory']['peak'] / GIB:.2f} GiB per device, "
              f"which has {result['device_memory_bytes'] / GIB:.2f} GiB", file=sys.stderr, flush=True)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

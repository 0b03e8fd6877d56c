"""How fast does one config train on one mesh, what does it hold and move per device, and does the
input pipeline keep up?

    python scripts/benchmark.py --mesh dp=1                       # the default config, one device
    python scripts/benchmark.py --config gpt2-124m --mesh dp=1 train.batch_size=1 train.grad_accum=1 --steps 3
    python scripts/benchmark.py --config gpt2-124m --mesh fsdp=8 --json bench.json

Same arguments as `python -m jaxgpt.train` (no run dir: nothing is saved), plus --steps, --warmup,
--input-batches and --json. It builds the real train state and the real jitted step (state
donated, as in training) and reports:

    compile s        lowering + compiling the step (state initialisation not included)
    step ms          median, p10 and p90 (and min/max in the JSON) of --steps steps after --warmup,
                     each timed from dispatch to block_until_ready on the new state and metrics
    tokens/s         global batch x seq_len / the median step
    MFU              jaxgpt.metrics.mfu at that rate; null where the peak FLOP/s is unknown (CPU)
    mem/device MiB   XLA's memory analysis of the compiled step: arguments + outputs - aliased
                     (donated) + temporaries + code
    collective MiB   result bytes per device per step, all kinds (jaxgpt.hlo; per kind in the JSON)
    gemm_calls       (JSON) cuBLAS/cuDNN GEMM calls in the compiled step, fp8 vs other: with
                     model.fp8=true on a Hopper GPU 'fp8' must be > 0 (jaxgpt.hlo.gemm_counts)
    attention        (JSON) the attention kernel the model runs (xla or cudnn)
    faults/step      (JSON) median minor page faults per timed step, and the process's peak RSS: the
                     cost of allocating the step's temporaries afresh (jaxgpt/allocator.py)
    cpu ms           (JSON) median process CPU time (user + system, all threads) per timed step: on a
                     machine shared with other work it moves far less than the wall time
    input tokens/s   the Grain pipeline alone (jaxgpt.data.train_iterator on the config's data,
                     batch and seq_len), on this host, over --input-batches batches after the
                     first; and its ratio to what the step consumes per host (>= 10x is healthy)

`--alternate model.loss_chunk=8,16,32` compiles one step per value and runs them in turn, step
by step (A B C A B C ...), so that every value sees the same load on a shared machine; it prints
one row per value (the input pipeline is not measured then).

The batches fed to the step are real data, read and placed on the devices before timing, so the
step time excludes the input pipeline, which is measured on its own. Prints one JSON object and
one markdown row:
| config | mesh | devices | compile s | step ms (p10-p90) | tokens/s | MFU | mem/device MiB | collective MiB/step | faults/step | input tokens/s |
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from jaxgpt import allocator, data, plan, tokenizer
from jaxgpt.cli import ArgumentParser, run_main
from jaxgpt.config import Config, help_text, load_config, validate
from jaxgpt.errors import UserError
from jaxgpt.gpu import fp8_choice
from jaxgpt.hlo import gemm_counts
from jaxgpt.metrics import mfu, peak_flops
from jaxgpt.parallel import distributed
from jaxgpt.parallel.mesh import make_mesh, named
from jaxgpt.step import init_state, make_setup, make_train_step


def input_tokens_per_sec(cfg: Config, tokens: np.ndarray, n_batches: int) -> float:
    """Tokens/s this process's Grain pipeline delivers on its own, after its first batch."""
    batches = data.train_iterator(tokens, seq_len=cfg.model.seq_len, global_batch=cfg.train.batch_size,
                                  seed=cfg.train.seed, process_index=jax.process_index(),
                                  process_count=jax.process_count(), prefetch=cfg.data.prefetch,
                                  num_threads=cfg.data.num_threads)
    rows = next(batches).shape[0]  # starts the reader threads
    t0 = time.perf_counter()
    for _ in range(n_batches):
        next(batches)
    return n_batches * rows * cfg.model.seq_len / (time.perf_counter() - t0)


def benchmark(cfg: Config, steps: int, warmup: int, input_batches: int,
              variants: Sequence[Config] = ()) -> dict | list[dict]:
    """One config's figures (module docstring); with `variants`, a list: each of them timed in
    turn, step by step (--alternate), without the input pipeline."""
    devices = distributed.ordered_devices()
    cfg = plan.resolve_remat(cfg, devices)[0]  # model.remat=auto, as in training
    # data.path or data.mix, prepared with the config's data.tokenizer, checked as a run checks it
    tokens, _, data_vocab, _ = data.open_splits(cfg.data.path, cfg.data.mix, tok=tokenizer.load(cfg.data.tokenizer))
    sizes = validate(cfg, len(devices), data_vocab)
    cfg = fp8_choice.resolve(cfg, sizes, fp8_choice.target_of(devices[0]))[0]  # model.fp8=auto, as in training
    t, m = cfg.train, cfg.model
    mesh = make_mesh(sizes, devices)
    if variants:
        return _alternate(variants, sizes, mesh, devices, tokens, steps, warmup)
    batches = _batches(cfg, mesh, tokens, warmup + steps)
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        state = jax.block_until_ready(init_state(cfg, setup))
        t0 = time.perf_counter()
        compiled = make_train_step(cfg, mesh, setup).lower(state, batches[0]).compile()
        compile_s = time.perf_counter() - t0
        times, faults, cpu, losses = [], [], [], []
        for i, batch in enumerate(batches):
            faults0, cpu0, t0 = _minor_faults(), _cpu_s(), time.perf_counter()
            state, metrics = compiled(state, batch)  # the old state is donated
            jax.block_until_ready((state, metrics))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                faults.append(_minor_faults() - faults0)
                cpu.append(_cpu_s() - cpu0)
            losses.append(float(metrics["loss"]))
    if not all(map(math.isfinite, losses)):
        raise UserError(f"the loss became non-finite during the benchmark: {losses}")

    step_s = float(np.median(times))
    tokens_per_step = t.batch_size * m.seq_len
    rate = tokens_per_step / step_s
    dtype = setup.ops.dtype
    peak = peak_flops(devices[0], "fp8" if m.fp8_linears() else dtype)
    input_rate = input_tokens_per_sec(cfg, tokens, input_batches)
    hlo = compiled.as_text()
    collectives = plan.collective_summary(hlo, len(devices))
    return {
        "mesh": sizes, "devices": len(devices), "processes": jax.process_count(),
        "device_kind": devices[0].device_kind, "compute_dtype": dtype, "fp8": m.fp8, "remat": m.remat,
        "attention": setup.ops.kernel, "ops": setup.ops.form,
        "gemm_calls": gemm_counts(hlo),  # XLA:GPU library GEMMs, fp8 vs other (0 on CPU)
        "parameters": int(sum(
            x.size for x in jax.tree.leaves(state.params))),
        "tokens_per_step": tokens_per_step, "steps": steps, "warmup": warmup, "compile_s": compile_s,
        "step_ms": {"median": 1e3 * step_s, "p10": 1e3 * float(np.percentile(times, 10)),
                    "p90": 1e3 * float(np.percentile(times, 90)), "min": 1e3 * min(times),
                    "max": 1e3 * max(times)},
        "tokens_per_sec": rate, "mfu": mfu(rate, m, len(devices), peak),
        "allocator": allocator.describe().split(";")[0],
        "cpu_ms_per_step": 1e3 * float(np.median(cpu)),  # process CPU time, all threads
        "minor_faults_per_step": float(np.median(faults)),  # pages the step faulted in (allocation churn)
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # whole process, so far
        "memory": plan.memory_analysis(compiled),
        "collective_bytes": collectives["bytes"], "collective_wire_bytes": collectives["wire_bytes"],
        "collective_count": collectives["count"],
        "input_tokens_per_sec": input_rate,
        "input_ratio": input_rate / (rate / jax.process_count()),  # one host's pipeline vs its share
        "loss_first_last": [losses[0], losses[-1]],
    }


def _batches(cfg: Config, mesh, tokens, n: int) -> list:
    """The first n real training batches, placed on the mesh before any timing."""
    t, m = cfg.train, cfg.model
    feed = data.train_iterator(tokens, seq_len=m.seq_len, global_batch=t.batch_size, seed=t.seed,
                               process_index=jax.process_index(), process_count=jax.process_count())
    return [jax.make_array_from_process_local_data(named(mesh, ("batch", None)), next(feed),
                                                   (t.batch_size, m.seq_len + 1)) for _ in range(n)]


def _alternate(variants: Sequence[Config], sizes: dict, mesh, devices, tokens, steps: int, warmup: int) -> list[dict]:
    """Each variant's compiled step with its own state, run in turn on the same batches."""
    t, m = variants[0].train, variants[0].model
    batches = _batches(variants[0], mesh, tokens, warmup + steps)
    with jax.set_mesh(mesh):
        runs = []
        for cfg in variants:
            validate(cfg, len(devices), m.vocab_size)
            setup = make_setup(cfg, mesh)
            state = jax.block_until_ready(init_state(cfg, setup))
            runs.append({"cfg": cfg, "state": state, "times": [], "cpu": [], "losses": [],
                         "step": make_train_step(cfg, mesh, setup).lower(state, batches[0]).compile()})
        for i, batch in enumerate(batches):
            for run in runs:
                cpu0, t0 = _cpu_s(), time.perf_counter()
                run["state"], metrics = run["step"](run["state"], batch)
                jax.block_until_ready((run["state"], metrics))
                if i >= warmup:
                    run["times"].append(time.perf_counter() - t0)
                    run["cpu"].append(_cpu_s() - cpu0)
                run["losses"].append(float(metrics["loss"]))
    tokens_per_step = t.batch_size * m.seq_len
    return [{"model": dataclasses.asdict(run["cfg"].model), "steps": steps, "warmup": warmup,
             "allocator": allocator.describe().split(";")[0],
             "step_ms": {"median": 1e3 * float(np.median(run["times"])), "min": 1e3 * min(run["times"]),
                         "p10": 1e3 * float(np.percentile(run["times"], 10)),
                         "p90": 1e3 * float(np.percentile(run["times"], 90))},
             "cpu_ms_per_step": 1e3 * float(np.median(run["cpu"])),
             "tokens_per_sec": tokens_per_step / float(np.median(run["times"])),
             "loss_first_last": [run["losses"][0], run["losses"][-1]]} for run in runs]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def markdown_row(name: str, r: dict) -> str:
    layout = ",".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1) or "dp=1"
    ms = r["step_ms"]
    mfu_s = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (f"| {name} | {layout} | {r['devices']} | {r['compile_s']:.1f} | {ms['median']:,.1f} "
            f"({ms['p10']:,.1f}-{ms['p90']:,.1f}) | {r['tokens_per_sec']:,.0f} | {mfu_s} | "
            f"{r['memory']['peak'] / 2**20:,.0f} | {sum(r['collective_bytes'].values()) / 2**20:,.1f} | "
            f"{r['minor_faults_per_step']:,.0f} | {r['input_tokens_per_sec']:,.0f} ({r['input_ratio']:,.0f}x) |")


def _main(argv: Sequence[str] | None) -> None:
    parser = ArgumentParser(prog="python scripts/benchmark.py", description=__doc__.splitlines()[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=help_text())
    parser.add_argument("--config", help="a YAML file, or the name of one in configs/ (default: shakespeare)")
    parser.add_argument("--mesh", help="device mesh, e.g. dp=8 or dp=2,fsdp=2,tp=2 (unnamed axes are 1; one may be -1)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling (default 2)")
    parser.add_argument("--input-batches", type=int, default=50, help="batches timed from the input pipeline")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    parser.add_argument("--name", help="first column of the markdown row (default: the config's name)")
    parser.add_argument("--alternate", metavar="section.key=V1,V2,...",
                        help="time one step per value of this key, in turn (e.g. model.loss_chunk=8,16,32)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_intermixed_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.input_batches < 1:
        raise UserError("--steps and --input-batches must be positive and --warmup not negative")
    cfg = load_config(args.config, args.overrides, args.mesh)
    if args.alternate:
        key, _, values = args.alternate.partition("=")
        variants = [load_config(args.config, [*args.overrides, f"{key}={v}"], args.mesh) for v in values.split(",")]
        distributed.initialize()
        results = benchmark(cfg, args.steps, args.warmup, args.input_batches, variants)
        print("| " + key + " | step ms median (min, p10-p90) | cpu ms/step | tokens/s | loss first / last |")
        for value, r in zip(values.split(","), results):
            ms = r["step_ms"]
            print(json.dumps({"alternate": f"{key}={value}", **r}), flush=True)
            print(f"| {value} | {ms['median']:,.1f} ({ms['min']:,.1f}, {ms['p10']:,.1f}-{ms['p90']:,.1f}) | "
                  f"{r['cpu_ms_per_step']:,.0f} | {r['tokens_per_sec']:,.0f} | "
                  f"{r['loss_first_last'][0]:.6f} / {r['loss_first_last'][1]:.6f} |", flush=True)
        return
    distributed.initialize()
    result = {"config": args.config or "shakespeare", "overrides": args.overrides, "commit": _commit(),
              "date": datetime.date.today().isoformat(), **benchmark(cfg, args.steps, args.warmup, args.input_batches)}
    if jax.process_index() == 0:
        print(json.dumps(result), flush=True)
        print(markdown_row(args.name or result["config"], result), flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    allocator.reexec()  # the allocator training uses (jaxgpt/allocator.py); JAXGPT_ALLOCATOR=system: glibc as is
    sys.exit(run_main(_main))

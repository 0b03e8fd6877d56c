"""Where does the train step's time go, measured: a jax.profiler trace of a few steps, read back
here and printed as the step-time model's groups, with no TensorBoard.

    python scripts/profile_step.py --config gpt2-124m --mesh dp=1
    python scripts/profile_step.py --config gpt2-124m --mesh dp=1 model.remat=dots --steps 3 --top 40

Same arguments as `python -m jaxgpt.train` (nothing is saved), plus --steps (traced), --warmup,
--top and --out (where the trace goes; default a temporary directory, kept). It builds the real
state and jitted step (as scripts/benchmark.py does), runs --warmup steps, traces --steps steps,
then sums the device time of every kernel by the HLO instruction that launched it (the trace's
`hlo_op`). Each instruction takes the group jaxgpt/gpu/cost.py gives it in the compiled program,
so the table sets measured against predicted, group by group (the prediction where the device is
an H100 or H200), then the top kernels by measured time. Kernels the trace names without an
instruction that the program holds are grouped by their kernel name (cuBLAS/CUTLASS -> GEMMs,
cuDNN/flash -> attention, NCCL -> collectives) or land in 'other'.

On a GPU the kernels are read from the device's stream lines, with XLA:GPU's command buffers off
(jaxgpt.tracking.kernels_in_traces, as `logging.profile_steps` in training does): XLA runs
runs of kernels as CUDA graphs, and a trace shows one `command_buffer_N` event per graph launch
instead of the kernels inside it, so every group would read 0 and 'other' all of the step. On an
H200 (gpt2-124m, jax 0.11.2) the step took 1,037 ms traced without them against 1,024 ms in
scripts/benchmark.py with them. On a CPU (a smoke run) they are XLA:CPU's thunk events, whose
nesting makes the sums only indicative.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax

from jaxgpt import allocator, data, plan
from jaxgpt.cli import ArgumentParser, run_main
from jaxgpt.config import help_text, load_config, validate
from jaxgpt.errors import UserError
from jaxgpt.gpu import cost, perf
from jaxgpt.metrics import flops_per_token
from jaxgpt.parallel import distributed
from jaxgpt.parallel.mesh import make_mesh, named
from jaxgpt.step import init_state, make_setup, make_train_step
from jaxgpt.tracking import kernels_in_traces

_BY_KERNEL_NAME = [(re.compile(r"gemm|cublas|cutlass|matmul|sm\d+_xmma", re.I), cost.GEMM),
                   (re.compile(r"cudnn|fmha|flash", re.I), cost.ATTENTION),
                   (re.compile(r"nccl", re.I), cost.COLLECTIVE)]


_DERIVED = {"Steps", "XLA Modules", "XLA Ops", "Framework Ops", "Framework Name Scope", "Source code", "XLA TraceMe"}


def kernel_times(xplane: str) -> tuple[dict[str, float], dict[str, int]]:
    """{hlo_op or kernel name: device seconds in the trace}, {same: launches}, from one .xplane.pb."""
    profile = jax.profiler.ProfileData.from_file(xplane)
    planes = [p for p in profile.planes if p.name.startswith("/device:GPU")]
    seconds: dict[str, float] = collections.defaultdict(float)
    launches: dict[str, int] = collections.Counter()
    if planes:  # kernels sit on the stream lines; the rest (XLA Ops, Steps, ...) are derived from them
        lines = [line for p in planes for line in p.lines if line.name.startswith("Stream")] or \
                [line for p in planes for line in p.lines if line.name not in _DERIVED]
    else:  # XLA:CPU: thunk events on the host's threads
        host = profile.find_plane_with_name("/host:CPU")
        lines = list(host.lines) if host else []
    for line in lines:
        for event in line.events:
            stats = dict(event.stats)
            op = stats.get("hlo_op")
            if not op and not planes:
                continue
            key = str(op or event.name)
            seconds[key] += event.duration_ns * 1e-9
            launches[key] += 1
    return dict(seconds), dict(launches)


def _target(device_kind: str) -> str | None:
    return "h200" if "H200" in device_kind else "h100" if "H100" in device_kind else None


def profile(cfg, steps: int, warmup: int, out: Path) -> tuple[dict, str, float]:
    """Traces `steps` steps into `out`; returns (kernel times, compiled HLO, wall seconds per step)."""
    devices = distributed.ordered_devices()
    cfg = plan.resolve_remat(cfg, devices)[0]  # model.remat=auto, as in training
    data_dir = data.resolve_data_dir(cfg.data.path)
    sizes = validate(cfg, len(devices), data.load_meta(data_dir)["vocab_size"])
    t, m = cfg.train, cfg.model
    mesh = make_mesh(sizes, devices)
    feed = data.train_iterator(data.load_split(data_dir, "train"), seq_len=m.seq_len, global_batch=t.batch_size,
                               seed=t.seed, process_index=jax.process_index(), process_count=jax.process_count())
    batches = [jax.make_array_from_process_local_data(named(mesh, ("batch", None)), next(feed),
                                                      (t.batch_size, m.seq_len + 1)) for _ in range(warmup + steps)]
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        state = jax.block_until_ready(init_state(cfg, setup))
        compiled = make_train_step(cfg, mesh, setup).lower(state, batches[0]).compile()
        for batch in batches[:warmup]:
            state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics) if warmup else state)
        jax.profiler.start_trace(str(out))
        t0 = time.perf_counter()
        for i, batch in enumerate(batches[warmup:]):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        wall = (time.perf_counter() - t0) / steps
        jax.profiler.stop_trace()
    paths = sorted(glob.glob(str(out / "**" / "*.xplane.pb"), recursive=True), key=lambda p: Path(p).stat().st_mtime)
    if not paths:
        raise UserError(f"jax.profiler wrote no .xplane.pb under {out}")
    return {"times": kernel_times(paths[-1]), "cfg": cfg, "devices": devices}, compiled.as_text(), wall


def report(result: dict, hlo_text: str, wall: float, steps: int, top: int) -> str:
    seconds, launches = result["times"]
    cfg, devices = result["cfg"], result["devices"]
    target = _target(devices[0].device_kind)
    p = perf.perf(target or "h100")
    kernels, _ = cost.kernels(hlo_text, p, len(devices))
    group_of = {k.name: k.group for k in kernels}
    predicted_of = collections.defaultdict(float)
    for k in kernels:
        predicted_of[k.name] += k.seconds * k.times

    def group(name: str) -> str:
        if name in group_of:
            return group_of[name]
        return next((g for pattern, g in _BY_KERNEL_NAME if pattern.search(name)), cost.OTHER)

    measured = collections.defaultdict(float)
    for name, s in seconds.items():
        measured[group(name)] += s / steps
    device_total = sum(measured.values())
    tokens = cfg.train.batch_size * cfg.model.seq_len
    est = cost.estimate(hlo_text, p, len(devices), tokens, flops_per_token(cfg.model)) if target else None
    lines = [f"profiled {steps} step(s) on {len(devices)} x {devices[0].device_kind}: wall {1e3 * wall:,.1f} ms/step, "
             f"kernels {1e3 * device_total:,.1f} ms/step (summed over streams), {tokens / wall:,.0f} tokens/s"]
    if est:
        lines.append(f"predicted (jaxgpt/gpu/cost.py, {p.name}): {1e3 * est['step_seconds']:,.1f} ms/step, "
                     f"error {100 * (est['step_seconds'] / wall - 1):+.1f}% against the wall time")
    lines += ["", f"{'group':<52}{'measured ms':>12}{'share':>8}{'predicted ms':>14}"]
    for g in cost.GROUPS:
        if measured.get(g) or (est and est["groups"][g]["launches"]):
            pred = f"{1e3 * est['groups'][g]['seconds']:>14,.1f}" if est else f"{'':>14}"
            lines.append(f"{g:<52}{1e3 * measured.get(g, 0.0):>12,.1f}{100 * measured.get(g, 0.0) / device_total:>7.1f}%"
                         f"{pred}")
    lines += ["", f"top {top} kernels by measured time per step:",
              f"{'ms/step':>9}{'predicted':>11}{'launches':>10}  {'group':<20}instruction / kernel"]
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]:
        pred = f"{1e3 * predicted_of[name]:>11,.2f}" if name in predicted_of and target else f"{'':>11}"
        lines.append(f"{1e3 * s / steps:>9,.2f}{pred}{launches[name] // steps:>10,}  {group(name)[:19]:<20}{name[:90]}")
    return "\n".join(lines)


def _main(argv: Sequence[str] | None) -> None:
    parser = ArgumentParser(prog="python scripts/profile_step.py", description=__doc__.splitlines()[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=help_text())
    parser.add_argument("--config", help="a YAML file, or the name of one in configs/ (default: shakespeare)")
    parser.add_argument("--mesh", help="device mesh, e.g. dp=8 (unnamed axes are 1; one may be -1)")
    parser.add_argument("--steps", type=int, default=3, help="traced steps (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untraced steps after compiling (default 2)")
    parser.add_argument("--top", type=int, default=25, help="kernels listed (default 25)")
    parser.add_argument("--out", type=Path, help="trace directory (default: a new temporary directory)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_intermixed_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.top < 1:
        raise UserError("--steps and --top must be positive and --warmup not negative")
    cfg = load_config(args.config, args.overrides, args.mesh)
    kernels_in_traces()  # before distributed.initialize starts a backend
    distributed.initialize()
    out = args.out or Path(tempfile.mkdtemp(prefix="jaxgpt-profile-"))
    result, hlo_text, wall = profile(cfg, args.steps, args.warmup, out)
    if jax.process_index() == 0:
        print(report(result, hlo_text, wall, args.steps, args.top), flush=True)
        print(f"trace: {out} (tensorboard --logdir {out}, or the .trace.json.gz in Perfetto)", flush=True)


if __name__ == "__main__":
    allocator.reexec()
    sys.exit(run_main(_main))

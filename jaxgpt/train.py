"""`python -m jaxgpt.train [--config FILE] [--mesh dp=2,fsdp=2,tp=2] [--run-dir DIR] [section.key=value ...]`

A run's set-up; the step loop itself is jaxgpt/loop.py. Everything that can be wrong with the
input is checked before anything compiles: config keys and values, then the mesh against the
device count (on an elastic restart, after `resilience.elastic` fitted it to the processes left),
then the data and its vocabulary, then (on resume) the checkpoint's shapes.

Re-running the same command with the same run dir resumes from the newest good checkpoint, in
either tier (persistent, or local with checkpoint.local_every: jaxgpt/resilience/local_tier.py):
parameters, optimizer state, step and data position, so the run continues the same trajectory.
From train() being entered to its end, a hang watchdog runs in every process and the session's
time is accounted for goodput (jaxgpt/resilience/).

What a step leaves behind, and why a resumed run's metrics.jsonl equals an uninterrupted run's:
step N's records are its train row (every `logging.every` steps and the last), its eval row (every
`train.eval_every` steps, the last step, and step 0 of a fresh run), its `goodput` row (every
`checkpoint.every` steps and the last) and its checkpoint. The rows are written first and the
checkpoint last (the eval runs before the save starts), so a committed checkpoint at step S, in
either tier, means every row of steps <= S is already in metrics.jsonl. Resuming from S
therefore keeps exactly the rows of steps <= S and drops the rest, which the resumed run writes
again; a run with no checkpoint of its own (a fresh start, also after a kill before the first
save) keeps none, and writes step 0's eval row again. A kill at any moment thus leaves rows that,
after the re-run, are the uninterrupted run's (only timing values, tokens_per_sec and mfu, differ),
including a kill after the last checkpoint, where the re-run has nothing to do. (The goodput
rows are timing values too.)

An eval row holds val_loss, val_bpb (bits per byte: the val nats over text positions / ln 2 / the
UTF-8 bytes those positions' labels decode to; jaxgpt/step.py `val_sums`) and, when `eval.tasks`
are due (every `eval.task_every` steps, the first and the last evaluation), task/NAME/acc and
task/NAME/acc_norm (jaxgpt/evaluate). All are functions of the parameters and of fixed inputs
(the val batches, the task files), so a resumed run writes them again exactly.

Process 0 records the run: metrics.jsonl, TensorBoard, W&B, the console and events.jsonl through
`tracking.Tracker`, and at the end of the run (completed, preempted or diverged) RUN_DIR/report.md
through `jaxgpt.report`.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: the process re-executes itself before importing JAX, not after
    from jaxgpt import allocator as _allocator
    from jaxgpt import cli as _cli

    _allocator.reexec()  # tcmalloc or glibc huge pages (jaxgpt/allocator.py)
    _cli.exit_on_ctrl_c()  # until training's own handlers (jaxgpt/preemption.py)

import argparse  # noqa: E402 (the re-exec above comes first)
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import yaml

from jaxgpt import allocator, data, files, hf, tokenizer
from jaxgpt.checkpoint import Checkpointer, find_checkpoint_dir
from jaxgpt.cli import ArgumentParser, Diverged, Preempted, path_arg, run_main
from jaxgpt.config import Config, help_text, load_config, validate
from jaxgpt.data import integrity
from jaxgpt.errors import UserError
from jaxgpt.evaluate.tasks import load_tasks
from jaxgpt.files import read_jsonl
from jaxgpt.gpu import fp8_choice
from jaxgpt.lock import DirLock
from jaxgpt.loop import Loop, say
from jaxgpt.lowering import compute_dtype
from jaxgpt.lowering.attention import select_kernel
from jaxgpt.metrics import peak_flops
from jaxgpt.model import param_count
from jaxgpt.parallel import distributed
from jaxgpt.parallel.mesh import make_mesh, named
from jaxgpt.plan import abstract_inputs, activation_floor, check_memory, local_device, resolve_remat
from jaxgpt.preemption import StopRequest
from jaxgpt.report import write_report
from jaxgpt.resilience import elastic, goodput, local_tier
from jaxgpt.resilience.clock import PhaseClock
from jaxgpt.resilience.watchdog import Watchdog
from jaxgpt.step import Setup, TrainState, init_state, make_setup, make_train_step
from jaxgpt.tracking import Tracker, check_run_dir, kernels_in_traces, require_wandb, run_info


def parse_args(argv: Sequence[str] | None) -> tuple[Config, Path]:
    parser = ArgumentParser(
        prog="python -m jaxgpt.train", description="Train a GPT on the devices this process sees.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=help_text())
    parser.add_argument("--config", help="a YAML file, or the name of one in configs/ (default: shakespeare)")
    parser.add_argument("--mesh", help="device mesh, e.g. dp=8 or dp=2,fsdp=2,tp=2 or ep=4,dp=2 (unnamed axes are 1; "
                        "one may be -1)")
    parser.add_argument("--run-dir", type=path_arg, help="metrics.jsonl and checkpoints go here; an existing one resumes "
                                                     "(default: runs/CONFIG)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_intermixed_args(argv)  # options may sit between overrides
    cfg = load_config(args.config, args.overrides, args.mesh)
    run_dir = args.run_dir or Path("runs") / Path(args.config or "shakespeare").stem
    return cfg, run_dir


def _initial_state(cfg: Config, setup: Setup, ckpt: Checkpointer, abstract: TrainState,
                   local: local_tier.LocalTier | None) -> tuple[TrainState, dict | None, Path | None]:
    """Resume this run, or start from another run's checkpoint, or initialise; (state, data state,
    the checkpoint this run resumed from or None). abstract: the state's shapes and shardings."""
    # the newest step in either tier; another model: refused; another schedule or data: said
    restored = local_tier.restore_newest(ckpt, local, abstract, cfg)
    if restored is not None:
        tier = " (local tier)" if local is not None and restored.path.is_relative_to(local.directory) else ""
        say(f"resuming from step {restored.step} ({restored.path}){tier}")
        return restored.state, restored.data_state, restored.path
    if cfg.checkpoint.init_from:
        source = Checkpointer(find_checkpoint_dir(cfg.checkpoint.init_from), cfg.checkpoint)
        other = source.restore_latest(abstract, params_only=cfg.checkpoint.init_params_only, config=cfg)
        source.close()
        assert other is not None, "find_checkpoint_dir found checkpoints that restore_latest did not"
        if not cfg.checkpoint.init_params_only:
            say(f"starting from step {other.step} of {other.path}")
            return other.state, other.data_state, None
        say(f"starting from the parameters of {other.path} (fresh optimizer, step 0)")
        fresh = init_state(cfg, setup)
        return TrainState(fresh.step, other.state.params, fresh.opt_state), None, None
    if cfg.checkpoint.init_from_hf:
        params = hf.load_dir(Path(cfg.checkpoint.init_from_hf), cfg.model)
        say(f"starting from the Hugging Face weights in {cfg.checkpoint.init_from_hf}")
        fresh = init_state(cfg, setup)
        return TrainState(fresh.step, jax.device_put(params, setup.shardings.params), fresh.opt_state), None, None
    return init_state(cfg, setup), None, None


@contextlib.contextmanager
def _naming(what: str):
    """A UserError inside (too few tokens for one window) says which data it is about."""
    try:
        yield
    except UserError as e:
        raise UserError(f"{what}: {e}") from None


def _trim_metrics(path: Path, step: int | None) -> None:
    """Keeps the rows of steps <= `step`, the checkpoint resumed from (None: no rows), as the module
    docstring explains: the rest are about to be written again."""
    if jax.process_index() == 0 and path.exists():
        # read_jsonl drops a line a kill cut short and refuses garbage in one line (never lose rows)
        rows = read_jsonl(path, "metrics file", required={"step": int}) if step is not None else []
        # whole or not at all: a kill while rewriting in place would lose the rows not yet written back
        files.write_text_atomically(path, "".join(json.dumps(row) + "\n" for row in rows if row["step"] <= step))


def _fp8_matmuls(m) -> str:
    """The banner's fp8 note: every block linear, some (named), or none."""
    kinds = m.fp8_linears()
    if not kinds:
        return ""
    return " + fp8 matmuls" if m.fp8 is True else f" + fp8 matmuls ({m.fp8.replace(',', ', ')})"


def train(cfg: Config, run_dir: Path, devices: Sequence[jax.Device] | None = None) -> TrainState:
    """Trains `cfg` on `devices` (default: all), logging to run_dir/metrics.jsonl; returns the final state."""
    devices = list(devices or distributed.ordered_devices())
    started = time.time()  # the start event's time: a session's wall time includes start-up
    if distributed.cpu_without_compilation_cache(devices):
        say("note: JAX's persistent compilation cache is off for this run: an XLA:CPU step read back from it "
             "can deadlock its collectives in jax 0.12 (jaxgpt/parallel/distributed.py)")
    cfg, resized = elastic.resize(cfg, len(devices))  # launch_multihost.sh --min-processes: fewer processes
    sizes = validate(cfg, len(devices))
    local_tier.check_dir(cfg)
    hf.check_init_from_hf(cfg)
    check_run_dir(run_dir)
    tokenizer.for_run(cfg, run_dir)  # data.tokenizer: a tokenizer, this run's and its source's
    require_wandb(cfg.logging)
    layout_error = distributed.mesh_layout_error(sizes["tp"], cfg.mesh.allow_tp_across_hosts)
    if layout_error:
        raise UserError(layout_error)
    # One job per run dir (jaxgpt/lock.py): a second one would interleave metrics and checkpoints.
    with DirLock(run_dir, "run dir", "wait for it to finish or stop it (the same command resumes), or "
                 "pass another --run-dir", suffix=f".{jax.process_index()}"):
        phases = PhaseClock(started)
        watchdog = Watchdog(phases, run_dir, cfg.train)  # start-up is bounded too: a peer may never come
        watchdog.start()
        try:
            return _train(cfg, run_dir, devices, sizes, phases, resized)
        finally:
            watchdog.close()


def _train(cfg: Config, run_dir: Path, devices: list[jax.Device], sizes: dict[str, int],
           phases: PhaseClock, resized: str | None) -> TrainState:
    """`train` once the config is valid for the devices and the run dir is this job's."""
    started = phases.started
    dtype = compute_dtype(cfg.model.dtype, devices[0].platform)
    kernel, why = select_kernel(cfg.model.attention, dtype, cfg.model.head_dim, devices[0], cfg.model.document_mask)
    # Every token file is checked against meta.json first; the verdicts (RUN_DIR/data-verified.json,
    # written by process 0, read by all) spare a resumed run from reading unchanged files again.
    verified = run_dir / "data-verified.json"
    run_data = data.open_run_data(cfg, cache=verified)  # prepared dirs, or data.chat's conversations
    train_tokens, val_tokens, data_vocab = run_data.train, run_data.val, run_data.vocab_size
    validate(cfg, len(devices), data_vocab)
    tasks = load_tasks(cfg.eval.tasks, cfg.model.seq_len, cfg.eval.task_limit,  # read and checked before compiling
                       tok=tokenizer.load(cfg.data.tokenizer))
    cfg, remat_why, memory = resolve_remat(cfg, devices)  # model.remat=auto: a GPU's limit, a CPU's share of the host
    # model.fp8=auto: the linears the step-time model predicts faster in fp8 on this GPU (none on a CPU)
    cfg, fp8_rows, fp8_why = fp8_choice.resolve(cfg, sizes, fp8_choice.target_of(devices[0]))
    t, m = cfg.train, cfg.model
    pid = jax.process_index()
    mesh = make_mesh(sizes, devices)
    batch_sharding = named(mesh, ("batch", None))
    global_shape = (t.batch_size, m.seq_len + 1)
    block, blocks = distributed.data_block(batch_sharding, global_shape)  # this process's rows of each batch
    source = cfg.data.mix or cfg.data.path
    with _naming(f"the train split of {source}"):
        batches = data.train_iterator(train_tokens, seq_len=m.seq_len, global_batch=t.batch_size, seed=t.seed,
                                      process_index=block, process_count=blocks,
                                      prefetch=cfg.data.prefetch, num_threads=cfg.data.num_threads)
    with _naming(f"the val split of {source}"):
        val_batches = data.eval_batches(val_tokens, seq_len=m.seq_len, global_batch=t.batch_size,
                                        num_batches=t.eval_batches, process_index=block, process_count=blocks)

    def to_global(local_BT1):  # tokens [B, T+1], or a fine-tuning batch (tokens, weights [B, T])
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
            batch_sharding, x, (t.batch_size, *x.shape[1:])), local_BT1)

    stop = StopRequest()  # from here SIGTERM or Ctrl-C stops the run after its first step, compiling included
    ckpt = None
    try:
        with jax.set_mesh(mesh):
            setup = make_setup(cfg, mesh)
            abstract, abstract_batch = abstract_inputs(cfg, mesh, setup)  # restore targets, ahead-of-time compile
            train_step = make_train_step(cfg, mesh, setup)
            # A checkpoint this run cannot resume (other shapes, another model) is refused before
            # the compile; a run dir without checkpoints gets none made here (a refused run leaves
            # nothing). The local tier's steps are checked as they are restored.
            ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint) if (run_dir / "checkpoints").is_dir() else None
            if ckpt is not None:
                ckpt.check_resumable(abstract, cfg)
            # Before anything is written: a run too big for its devices is one line, not the OOM
            # killer (a CPU host) or XLA's RESOURCE_EXHAUSTED at the first step (a GPU).
            phases.enter("compile")  # where a memory limit is known, the step is compiled here, ahead
            check_memory(train_step, abstract, abstract_batch, mesh, local_device(devices), memory,
                         floor=activation_floor(cfg, sizes))
            phases.enter("startup")
        track = Tracker(cfg, run_dir, enabled=pid == 0, started=started)
        ckpt = ckpt or Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
        local = local_tier.LocalTier(cfg, run_dir, sizes) if cfg.checkpoint.local_every else None
    except BaseException:
        stop.close()
        if ckpt is not None:
            ckpt.close()
        raise
    session = None
    try:
        with jax.set_mesh(mesh):
            state, data_state, resumed_from = _initial_state(cfg, setup, ckpt, abstract, local)
            start = int(state.step)
            session = goodput.Session(run_dir, phases, start, enabled=pid == 0 and start < t.steps)
            if data_state is not None:
                batches.set_state(data_state)
            if pid == 0:
                run_dir.mkdir(parents=True, exist_ok=True)
                for own in ("config.yaml", "metrics.jsonl"):  # this job's (the run dir is locked)
                    files.remove_leftovers(run_dir / own)
                if start < cfg.train.steps:  # a finished run keeps the config that trained it
                    files.write_text_atomically(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
                integrity.remember(verified)  # the shard verdicts, for the next session
                tokenizer.keep(run_dir, tokenizer.load(cfg.data.tokenizer))  # sample and export read it there
                _trim_metrics(track.log.path, start if resumed_from is not None else None)
                layout = ",".join(f"{a}={s}" for a, s in sizes.items())
                active = f" ({param_count(m, active=True) / 1e6:.1f}M active)" if m.moe_experts else ""
                print(f"jaxgpt: {param_count(m) / 1e6:.1f}M parameters{active} | mesh {layout} on {len(devices)} "
                      f"{devices[0].platform} devices | {t.batch_size} x {m.seq_len} tokens/step | "
                      f"{len(train_tokens):,} train tokens | compute {np.dtype(dtype).name}"
                      f"{_fp8_matmuls(m)} | attention {kernel} ({why}) | remat {m.remat} "
                      f"({remat_why}) | ops {setup.ops.described}", flush=True)
                if run_data.note:
                    print(run_data.note, flush=True)
                if fp8_why:
                    print("\n".join([fp8_why, *fp8_choice.format_choices(fp8_rows)]), flush=True)
                if resized:
                    print(resized, flush=True)
                if devices[0].platform == "cpu":
                    print(f"host allocator: {allocator.describe()}", flush=True)
            precision = "fp8" if m.fp8_linears() else np.dtype(dtype).name
            peak = peak_flops(devices[0], precision)
            if pid == 0:
                if restart := distributed.restart_info():  # launch_multihost.sh --max-restarts
                    track.event("restart", step=start, **restart)
                if resized:
                    track.event("elastic", step=start, processes=jax.process_count(),
                                full_processes=elastic.full_processes(), mesh=sizes, grad_accum=t.grad_accum)
                track.begin(start, run_info(cfg, run_dir, sizes, devices, dtype=np.dtype(dtype).name, kernel=kernel,
                                            kernel_reason=why, params=param_count(m), peak=peak), resumed_from)
            loop = Loop(cfg, setup, mesh, train_step, track, len(devices), peak, tasks, phases, session, local)
            state = loop.run(state, start, batches, to_global, val_batches, ckpt, stop)
        phases.enter("checkpoint")
        ckpt.wait()
        if local is not None:
            local.remove()  # the run is complete: its local copies only hold memory now
        if session.enabled:
            session.completed = True
            session.write()
            say(goodput.line(session.summary(run_dir)))
            session.enabled = False  # its end is written
        track.event("end", step=max(start, t.steps))
        _close_and_report(track, completed=True)
    except (Preempted, Diverged):  # the loop wrote the event; the report says where it stopped
        _close_and_report(track)
        raise
    finally:
        if session is not None and session.enabled:
            session.write()  # the session's end, for goodput (a killed one is seen to end at its last record)
        stop.close()
        ckpt.close()
        if local is not None:
            local.close()
        track.close()
    return state


def _close_and_report(track: Tracker, completed: bool = False) -> None:
    """Closes the tracker's sinks, then (process 0) writes RUN_DIR/report.md, warning on failure."""
    track.close(completed)
    if not track.enabled:
        return
    try:
        write_report(track.run_dir)
    except Exception as e:  # noqa: BLE001 - the run itself succeeded; the report is a courtesy
        print(f"warning: could not write the run report: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _main(argv: Sequence[str] | None) -> None:
    cfg, run_dir = parse_args(argv)
    if cfg.logging.profile_range:
        kernels_in_traces()  # before distributed.initialize starts a backend
    distributed.initialize()
    train(cfg, run_dir)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

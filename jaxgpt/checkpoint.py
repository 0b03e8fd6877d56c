"""Orbax checkpoints: what is saved, how resume picks one, and what happens when one is damaged.

Layout (RUN_DIR/checkpoints/STEP/, written by `ocp.CheckpointManager`):

    state/   TrainState (step, params, AdamW state) as sharded arrays (`StandardSave`); restored
             straight into the *current* mesh's shardings, so a checkpoint written under dp=8
             loads under fsdp=4,tp=2 or on one device.
    data/    the Grain iterator state (JSON). Every process's state is the same number, the count
             of global batches consumed (process p reads local batches p, p+P, ...; see data.py),
             so one value restores every process, under any process count.
    config/  the config the run used (JSON), readable without touching the arrays.

Training has no randomness after initialisation (no dropout): the data order, fixed by the seed
and the iterator state, is the only stream that must resume, so resumed runs are bit-identical.
A checkpoint at step S is saved after every metrics.jsonl row of steps <= S was written (train.py
evaluates before it saves), so resuming from S keeps exactly those rows; see train.py's docstring.

Saves are asynchronous: `save` returns once the arrays are copied off the device and the writes
continue in a background thread. Orbax writes into a temporary directory and renames it when
complete (plus `commit_success.txt`), so a checkpoint either exists whole or not at all; jaxgpt
never writes checkpoint files itself. Orbax copies a replicated array off the device a slice per
replica ("replica-parallel"), each slice an eagerly compiled program per array and device: worth
it for big arrays, but for small ones the compiles cost more than the copy (a tiny model's first
save: ~1 s of them on 8 CPU devices). So only arrays whose slices are at least
`REPLICA_PARALLEL_MIN_BYTES` are split; the others are copied whole by their first replica.

Resume takes the newest step that reads back. A step directory without its commit marker, or
whose metadata or array files are garbage, missing or truncated, is skipped with one warning line
naming it and why. If checkpoints exist and none reads back, the run stops with one error line
naming every step and why rather than silently starting over. A checkpoint whose array shapes
differ from the current config is an error that names the config keys that changed
(`model.n_embd 32 -> 64`, `model.moe_experts 8 -> 4`, read from the checkpoint's config item), or
lists the arrays that differ where no key explains them: that is a wrong command, not damage.
So is a model change that keeps the shapes (`model.mlp` gelu -> relu2, `model.logit_softcap`):
refused the same way once the step is read. Other MoE routing (`moe_top_k`,
`moe_capacity_factor`) fits the same arrays and is legitimate, so a resume accepts it with one
warning line naming the change (`check_config_changes`), as it does another learning-rate schedule
(a longer `train.steps`) and other data once the saved run had read some (the saved position then
counts another stream).

Damaged steps are set aside, not left in the way. When a training run resumes from step S and
skipped newer damaged steps, each is moved to `checkpoints/damaged/STEP-<UTC time>` (said in its
warning line); Orbax's manager ignores that directory. Otherwise the run would reach the damaged
step again and Orbax would refuse to save over it (`StepAlreadyExistsError`), on every re-run.
Nothing of a committed step is deleted: the user decides what to do with `damaged/`. Readers of
someone else's run (sample, export, `init_from`) only skip, never move. A half-written save,
`STEP.orbax-checkpoint-tmp...` (the process died before Orbax renamed it), is never a step and
cannot be restored: a resuming run deletes it, with one warning line (Orbax would otherwise delete
it, with an absl warning, only when that step is saved again; kept, every kill during a save would
leave up to a whole train state on disk).

Reading a damaged checkpoint is noisy inside Orbax and TensorStore: Orbax runs each read in an
asyncio loop that it closes when a read fails, and TensorStore's I/O threads then try to deliver
the other reads' results to that closed loop, each raising "Event loop is closed" through
`sys.unraisablehook`, dozens of times, from other threads, up to seconds later; and the reads
still pending then are closed whenever they are garbage-collected, each printing its own
"Exception ignored in: <coroutine object _read_array_index_and_device_put>" traceback with a
~60-line TensorStore spec (`_abandoned_read`). The results are unwanted (the checkpoint is being
skipped), so `_quiet_closed_loops` drops exactly those two errors from that hook, and asyncio's
"Task (or _GatheringFuture) exception was never retrieved" for the failed reads (logged whenever
the task or the gather around them is garbage-collected), for the life of the process; and each
read attempt holds what is written to file descriptor 2 (Python loggers, absl, TensorStore's C++
logging): dropped when the attempt fails (its warning line replaces it), written out unchanged
when it succeeds.

With several processes, every process tries the same step and they agree: a step any process
cannot read is skipped by all (a truncated shard may be visible to one host only), process 0 moves
it, and the others wait for the move before going on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxgpt import files
from jaxgpt.config import CheckpointConfig, Config, ModelConfig, from_dict
from jaxgpt.errors import UserError
from jaxgpt.optim import lr_schedule
from jaxgpt.step import TrainState

COMMIT_MARKER = "commit_success.txt"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's name for a save in progress: STEP.orbax-checkpoint-tmp
DAMAGED_DIR = "damaged"
REPLICA_PARALLEL_MIN_BYTES = 1 << 20
# Set on Orbax's registered jax.Array handler itself (its constructor's option of that name):
# registering a new one would log a warning and drop the metadata store Orbax gives its own.
_arrays = ocp.type_handlers.get_type_handler(jax.Array)
if hasattr(_arrays, "_min_slice_bytes_for_replica_parallel"):
    _arrays._min_slice_bytes_for_replica_parallel = REPLICA_PARALLEL_MIN_BYTES
# The config keys that the train state's shapes depend on (dtype, attention, fp8, remat do not);
# a key this version's config lacks is passed over.
SHAPE_KEYS = ("model.n_layer", "model.n_head", "model.n_kv_head", "model.n_embd", "model.mlp", "model.mlp_hidden",
              "model.seq_len", "model.vocab_size", "model.position", "model.norm", "model.norm_scale", "model.bias",
              "model.qk_norm", "model.tie_embeddings", "model.moe_experts", "model.moe_every",
              "model.moe_mlp_hidden", "model.moe_shared_experts", "model.moe_balance", "optimizer.name")
# MoE keys that change the routing of the same parameters: a resume may change them, and says so.
ROUTING_KEYS = ("model.moe_top_k", "model.moe_capacity_factor", "model.moe_dispatch", "model.moe_bias_rate")
# What the learning rate at a step depends on: a resume may change them (a longer run), and says so.
SCHEDULE_KEYS = ("train.steps", "optimizer.lr", "optimizer.warmup_steps", "optimizer.min_lr_ratio")
DATA_KEYS = ("data.path", "data.mix", "train.batch_size", "model.seq_len", "train.seed")  # what the data position means


class Restored(NamedTuple):
    step: int
    state: TrainState
    data_state: dict[str, Any]
    path: Path


def _warn(message: str) -> None:
    if jax.process_index() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


_ABSENT = object()  # a key one of two configs lacks


def _same_dir(a: str, b: str) -> bool:
    try:
        return bool(a) and bool(b) and os.path.samefile(a, b)
    except OSError:
        return False


def _changed(was: dict, now: dict, keys: tuple[str, ...]) -> list[str]:
    """`SECTION.KEY OLD -> NEW` for each of `keys` whose value differs between two config dicts
    (model.moe_every and the other MoE shape keys only between two MoE models: a dense model has none)."""
    def value(cfg: dict, key: str):
        section, name = key.split(".")
        return cfg.get(section, {}).get(name, _ABSENT)

    moe = bool(value(was, "model.moe_experts")) and bool(value(now, "model.moe_experts"))
    return [f"{k} {value(was, k)} -> {value(now, k)}" for k in keys
            if _ABSENT not in (value(was, k), value(now, k)) and value(was, k) != value(now, k)
            and (k == "model.moe_experts" or not k.startswith("model.moe_") or moe)]


# Keys whose 0 means a default: compared by what they mean (n_kv_head 0 is n_head, mlp_hidden 0 is 4D).
_EFFECTIVE = {"n_kv_head": "kv_heads", "mlp_hidden": "mlp_width", "moe_mlp_hidden": "expert_width"}


def _model_changes(was: ModelConfig, now: ModelConfig) -> list[str]:
    """`model.KEY OLD -> NEW` for what makes the same parameters compute another function: the
    model's SHAPE_KEYS by their effective values (moe_every only between two MoE models), the
    logit soft cap, and rope_theta where both use RoPE. seq_len is not one: with learned positions
    it changes wpe's shape (a shape error), with RoPE it extends the context."""
    def identity(m: ModelConfig) -> dict[str, Any]:
        keys = [k.split(".")[1] for k in SHAPE_KEYS if k.startswith("model.") and k != "model.seq_len"]
        keys += ["logit_softcap"] + (["rope_theta"] if m.position == "rope" else [])
        return {k: getattr(m, _EFFECTIVE.get(k, k)) for k in keys
                if k == "moe_experts" or not k.startswith("moe_") or m.moe_experts}

    a, b = identity(was), identity(now)
    return [f"model.{k} {a[k]} -> {b[k]}" for k in a if k in b and a[k] != b[k]]


def _next_rates(was: Config, now: Config, step: int) -> tuple[float, float] | None:
    """(the learning rate the saved run's schedule gives the step after `step`, this run's), or None
    where they agree."""
    rates = [float(lr_schedule(c.optimizer, c.train.steps)(step)) for c in (was, now)]  # optax counts steps done
    return None if np.isclose(*rates, rtol=1e-6, atol=0) else (rates[0], rates[1])


def _shape_mismatches(abstract: TrainState, stored: Any) -> list[str]:
    def by_name(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(p, simple=True, separator="."): x for p, x in leaves}

    want, have = by_name(abstract), by_name(stored)
    out = []
    for name in sorted(set(want) | set(have), key=lambda n: (not n.startswith("params"), n)):
        w, h = want.get(name), have.get(name)
        if w is None or h is None:
            out.append(f"{name}: {'only in the checkpoint' if w is None else 'missing from the checkpoint'}")
        elif tuple(w.shape) != tuple(h.shape):
            out.append(f"{name}: checkpoint {tuple(h.shape)} vs config {tuple(w.shape)}")
    return out


class Checkpointer:
    """One run's checkpoints: periodic async saves, resume from the newest readable step."""

    def __init__(self, directory: Path, cfg: CheckpointConfig):
        _quiet_closed_loops()  # the manager reads each step's metadata already
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            "state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler()})

    def save(self, step: int, state: TrainState, data_state: dict, cfg: Config) -> None:
        # A directory that became read-only since the run started (a filesystem remounted read-only
        # after an error, a permission change) would otherwise fail inside Orbax's background
        # thread and leave the run waiting minutes on the save before a traceback.
        try:
            files.writable_dir(self.directory, "checkpoint directory")
        except UserError as e:
            raise UserError(f"{e}; step {step} was not saved (then re-run the same command to resume from the "
                            f"newest saved checkpoint)") from None
        self.manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(cfg.to_dict())))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def step_path(self, step: int) -> Path:
        return self.directory / str(step)

    def restore_latest(self, abstract: TrainState, params_only: bool = False, config: Config | None = None,
                       set_aside: bool = False) -> Restored | None:
        """The newest checkpoint that reads back, restored into `abstract`'s shardings. With
        `params_only` the optimizer state is not read at all (it comes back as None, the data
        state as {}): sampling, export and fine-tuning need a third of the memory and
        I/O. Orbax's partial restore reads the same committed files the manager wrote.
        `config` (this run's) lets a shape mismatch name the keys that changed. `set_aside`
        (the run resuming itself) moves the damaged steps newer than the one restored, and
        half-written saves, to damaged/."""
        self.manager.reload()
        steps = sorted(self.manager.all_steps(), reverse=True)
        # A file with a step's name (Orbax lists only directories) is no checkpoint but says one was
        # there: counted as damaged, so a run whose only "checkpoint" it is stops, not starts over.
        strays = [p for p in self.directory.iterdir() if p.name.isdigit() and not p.is_dir()] \
            if self.directory.is_dir() else []
        skipped: list[tuple[Path, str]] = [(p, "a file, not a checkpoint directory") for p in strays]
        for step in steps:
            restored, why = self._try_restore(step, abstract, params_only, config)
            if restored is not None:
                break
            skipped.append((self.step_path(step), why))
        else:
            restored = None
        if restored is None and skipped:  # a run that stops: one line for all of them
            groups: dict[str, list[str]] = {}  # one reason, the steps it holds for
            for path, reason in skipped:
                groups.setdefault(reason, []).append(path.name)
            why = "; ".join(f"step{'s' * (len(names) > 1)} {', '.join(names)}: {reason}"
                            for reason, names in groups.items())
            raise UserError(f"no checkpoint in {self.directory} can be read: {why}; move them away to start over")
        if set_aside:
            self.remove_unfinished()
            self._set_aside(skipped)
        else:
            for path, reason in skipped:
                _warn(f"skipping checkpoint {path}: {reason}")
        return restored

    def check_config_changes(self, step: int, config: Config, data_state: dict, stored: dict | None = None,
                             where: Path | None = None) -> None:
        """Compares this run's config with the one checkpoint `step` was saved with. A change of the
        model (`_model_changes`) is a UserError: the parameters fit, but they were trained as another
        model. Allowed, with one warning line each: other MoE routing; another learning-rate
        schedule (a longer run: its cosine now spans the new train.steps, so the rate moves from the
        next step on); other data (path, mix, batch, context or shuffle seed) once the saved run had
        read any (a data switch mid-run is legitimate, but the saved data position then counts
        records of a different stream). A data.path that names the same directory otherwise
        (relative, absolute) is no change, nor is data.path where both runs read a data.mix (the
        mix replaces it). `stored` and `where`: the config and path of a step read from elsewhere (the
        local tier, jaxgpt/resilience/local_tier.py) instead of this directory's step."""
        stored = self.stored_config(step) if stored is None else stored
        where = self.step_path(step) if where is None else where
        if not stored:
            return
        now = config.to_dict()
        was = self._same_model(stored, config, where)
        changed = _changed(stored, now, ROUTING_KEYS) if config.model.moe_experts else []
        if changed:
            _warn(f"{', '.join(changed)} (checkpoint {where} -> this run): the run continues "
                  f"with other MoE routing")
        if step < config.train.steps and (changed := _changed(stored, now, SCHEDULE_KEYS)):
            rates = _next_rates(was, config, step) if was is not None else None
            _warn(f"{', '.join(changed)} (checkpoint {where} -> this run): the learning-rate "
                  f"schedule is recomputed" + (f"; step {step + 1} trains at {rates[1]:.3g}, not {rates[0]:.3g}"
                                               if rates else ""))
        if not data_state.get("next_index"):  # nothing read yet (a fresh or imported run): no stream to continue
            return
        was_data, now_data = stored.get("data", {}), now["data"]
        same_path = was_data.get("path") == now_data["path"] or (
            isinstance(was_data.get("path"), str) and _same_dir(was_data["path"], now_data["path"]))
        path_moot = same_path or bool(was_data.get("mix") and now_data["mix"])  # a mix replaces data.path
        changed = _changed(stored, now, tuple(k for k in DATA_KEYS if not (k == "data.path" and path_moot)))
        if changed:
            _warn(f"{', '.join(changed)} (checkpoint {where} -> this run): the data iterator "
                  f"resumes at its saved position in the new data, not the same stream")

    def _same_model(self, stored: dict, config: Config, where: Path) -> Config | None:
        """The saved config, typed (None where a hand-edited value does not type); a UserError if
        it is another model than `config`'s."""
        try:  # typed, defaults filled: the model and the schedule compare by what the values mean
            was = from_dict(stored, "the checkpoint's config")
        except UserError:  # a hand-edited value: compared by key only
            return None
        if changed := _model_changes(was.model, config.model):
            raise UserError(f"checkpoint {where} was trained as another model: {', '.join(changed)} "
                            f"(checkpoint -> this run); resume with the checkpoint's values, or start a new run dir "
                            f"from it with checkpoint.init_from={self.directory.parent}")
        return was

    def check_resumable(self, abstract: TrainState, config: Config) -> None:
        """Before the step is compiled: the newest committed step whose metadata reads is refused as
        its restore would refuse it (other shapes: the keys that changed; another model), so a run
        that cannot resume says so in seconds, not after a compile. Damage (no commit marker,
        unreadable metadata or arrays) is left to the restore, which skips it."""
        self.manager.reload()
        for step in sorted(self.manager.all_steps(), reverse=True):
            with held_stderr():  # a damaged step's read noise, as the restore holds it
                stored, _ = self._stored_state(step)
            if stored is None:  # damage: the restore says so
                continue
            if mismatches := _shape_mismatches(abstract, stored):
                raise UserError(self._mismatch_message(step, mismatches, config))
            if saved := self.stored_config(step):
                self._same_model(saved, config, self.step_path(step))
            return

    def remove_unfinished(self) -> None:
        """Deletes this directory's half-written saves (what a resume does; `_remove_unfinished`)."""
        self._remove_unfinished(sorted(self.directory.glob(f"*{TMP_SUFFIX}*")))

    def _remove_unfinished(self, paths: list[Path]) -> None:
        """Deletes half-written saves (Orbax's temporary directories, never a checkpoint), one
        warning line each: kept, each would hold up to a whole train state on disk after every kill
        during a save. Process 0 deletes; the others wait for it."""
        for path in paths:
            if jax.process_index() == 0:
                shutil.rmtree(path, ignore_errors=True)
            _warn(f"removed {path}: a save that never finished (the process stopped while writing it)")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxgpt: unfinished saves removed")

    def _set_aside(self, paths: list[tuple[Path, str]]) -> None:
        """Moves damaged steps and unfinished saves to damaged/NAME-<UTC time>, one warning line
        each (process 0 moves; the others wait for it, whatever their own list holds)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        damaged = self.directory / DAMAGED_DIR
        if paths and damaged.exists() and not damaged.is_dir():  # every process says it, none waits
            raise UserError(f"{damaged} is a file, where damaged checkpoints are moved; move it away")
        for path, reason in paths:
            target = damaged / f"{path.name}-{stamp}"
            if jax.process_index() == 0:
                n = 1
                while target.exists():  # two set-asides of one step within a second
                    target, n = damaged / f"{path.name}-{stamp}-{n}", n + 1
                target.parent.mkdir(exist_ok=True)
                path.rename(target)
            _warn(f"skipping checkpoint {path}: {reason}; moved it to {target}")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxgpt: damaged checkpoints set aside")
        if paths:
            self.manager.reload()

    def _try_restore(self, step: int, abstract: TrainState, params_only: bool,
                     config: Config | None) -> tuple[Restored | None, str]:
        """(the restored step, "") or (None, why it cannot be read), agreed by every process."""
        path = self.step_path(step)
        restored = None
        with held_stderr() as held:
            stored, why = self._stored_state(step)
            if stored is not None:
                if mismatches := _shape_mismatches(abstract, stored):
                    held.release()
                    raise UserError(self._mismatch_message(step, mismatches, config))
                try:
                    restored = self._restore(step, abstract, params_only)
                except Exception as e:  # noqa: BLE001
                    why = f"unreadable ({describe_error(e, path)})"
            if restored is not None:
                held.release()
        if not everyone(restored is not None):
            return None, why or "unreadable on another process"
        return restored, why

    def _stored_state(self, step: int) -> tuple[Any, str]:
        """(the step's state metadata, "") or (None, why it is damage): no commit marker, or its
        metadata unreadable. Read under the caller's held_stderr."""
        path = self.step_path(step)
        if not (path / COMMIT_MARKER).exists():
            return None, "no commit marker (an interrupted save)"
        try:
            stored = self.manager.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 - any failure to read means damage
            return None, f"metadata unreadable ({describe_error(e, path)})"
        if stored is None:  # Orbax's answer when state/_METADATA is gone
            return None, "metadata unreadable (no metadata for its state)"
        return stored, ""

    def _restore(self, step: int, abstract: TrainState, params_only: bool) -> Restored:
        path = self.step_path(step)
        if params_only:
            params = _read_params(path, abstract)
            require_finite(params)
            return Restored(step, TrainState(jnp.asarray(step, jnp.int32), params, None), {}, path)
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        require_finite(out.state.params)
        data_state = out.data
        if not (isinstance(data_state, dict) and type(data_state.get("next_index")) is int
                and data_state["next_index"] >= 0):  # Grain's iterator position, read back by set_state
            raise ValueError(f"its data iterator state is not {{'next_index': N >= 0}}: {str(data_state)[:80]}")
        return Restored(step, out.state, dict(data_state), path)

    def stored_config(self, step: int) -> dict[str, Any] | None:
        """The config a checkpoint was written with (its `config` item), or None if unreadable."""
        try:
            return dict(self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config)
        except Exception:  # noqa: BLE001 - only used to explain another error
            return None

    def _mismatch_message(self, step: int, mismatches: list[str], config: Config | None) -> str:
        """The changed shape keys by name where the checkpoint's config tells them; else the arrays."""
        stored = self.stored_config(step) if config is not None else None
        keys = _changed(stored, config.to_dict(), SHAPE_KEYS) if stored else []
        if keys:
            what = f"{', '.join(keys)} (checkpoint -> this run)"
        else:
            what = "; ".join(mismatches[:8]) + (f"; and {len(mismatches) - 8} more" if len(mismatches) > 8 else "")
        return f"checkpoint {self.step_path(step)} does not fit the current config: {what}"


@jax.jit
def _all_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)
                              if jnp.issubdtype(x.dtype, jnp.inexact)]))


def require_finite(params) -> None:
    """ValueError (so the step counts as damaged) if a restored parameter is NaN or infinite: jaxgpt
    never saves a diverged state, so such a step was damaged on disk (OCDBT stores no checksums)."""
    if not bool(_all_finite(params)):
        raise ValueError("its parameters hold NaN or infinite values")


def describe_error(e: Exception, step_dir: Path) -> str:
    """An exception in a few words, paths relative to the step's directory. TensorStore's messages
    (`CODE: context: context ... file "F": cause [tensorstore_spec=...]`) become `CODE in F: cause`:
    the innermost file and what is wrong with it, the same for two steps damaged alike."""
    text = str(e).splitlines()[0] if str(e) else ""
    text = text.split(" [tensorstore_spec=")[0].split(" See full TensorStore details")[0]
    text = text.replace(f"{step_dir}/", "")
    code, _, rest = text.partition(": ")
    if code.isupper() and code.replace("_", "").isalpha() and 'file "' in rest:  # an absl status code
        file, _, cause = rest.rpartition('file "')[2].partition('"')
        return f"{code} in {file}" + (f": {cause[2:]}" if cause.startswith(": ") else "")
    text = text if len(text) <= 200 else text[:199] + "…"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def everyone(ok: bool) -> bool:
    """Whether `ok` holds on every process (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


class _Held:
    def __init__(self) -> None:
        self.keep = False

    def release(self) -> None:
        """Write what was held to stderr after all (the attempt did not fail as damage)."""
        self.keep = True


@contextlib.contextmanager
def held_stderr():
    """Holds file descriptor 2 in a temporary file for one read attempt; see the module docstring."""
    held = _Held()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield held
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if held.keep:
                tmp.seek(0)
                os.write(2, tmp.read())


class _DroppedReadTasks(logging.Filter):
    """asyncio logs "<Task, Future or _GatheringFuture> exception was never retrieved" when it
    garbage-collects a failed read's task or the gather around the step's reads, at an unpredictable
    later moment (outside the attempt's hold on fd 2), and "Task was destroyed but it is pending!"
    for a read still pending when its loop closed: drop those whose exception is a failed
    checkpoint read (`_failed_read`) and the pending ones of Orbax's read (`ORBAX_READ`), nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        first = message.split("\n", 1)[0]
        if first == "Task was destroyed but it is pending!":
            return f"{ORBAX_READ}()" not in message  # the task's coroutine, in its repr
        if not first.endswith("exception was never retrieved"):
            return True
        return not (record.exc_info and _failed_read(record.exc_info[1]))


class _UnreadableStepMetadata(logging.Filter):
    """Orbax logs an absl ERROR, with the whole file's content, each time it meets a step's
    `_CHECKPOINT_METADATA` that does not parse (three times per resume). That file holds only the
    save's timestamps and Orbax goes on without it, so one warning line per file instead."""

    def __init__(self):
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(("Failed to json parse Metadata file", "Failed to read Metadata file")):
            return True
        path = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "a step's metadata file"
        if path not in self.said:
            self.said.add(path)
            _warn(f"{path} is unreadable; it holds only the save's timestamps, so the step is read without it")
        return False


ORBAX_READ = "_read_array_index_and_device_put"  # Orbax's coroutine that reads one array slice
ORBAX_READ_ERROR = "Encountered error while reading array index"  # what it raises when a read fails


STATUS_CODES = ("CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
                "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")  # absl's


def _failed_read(exc: BaseException | None) -> bool:
    """Whether `exc` is a failed checkpoint read: TensorStore's error (a ValueError led by an absl
    status code, "OUT_OF_RANGE: Error reading ...") or Orbax's `ORBAX_READ_ERROR` around one."""
    if exc is None:
        return False
    message = str(exc)
    return (message.startswith(ORBAX_READ_ERROR) or "tensorstore_spec" in message
            or (isinstance(exc, ValueError) and message.split(":", 1)[0] in STATUS_CODES))


def _abandoned_read(unraisable) -> bool:
    """Whether an unraisable exception is an abandoned Orbax array read being closed: a coroutine
    (`ORBAX_READ`, or one awaiting it) whose read was still pending when another read of the step
    failed, and which is closed when it is garbage-collected, whenever that is. Its `except
    BaseException` turns the close's GeneratorExit into an Exception (with TensorStore's whole spec)
    that nothing can receive, so Python prints it as "Exception ignored in: <coroutine ...>" with a
    traceback."""
    return getattr(unraisable.object, "cr_code", None) is not None and _failed_read(unraisable.exc_value)


def _quiet_closed_loops() -> None:
    """Drops "Event loop is closed" and abandoned reads being closed (`_abandoned_read`) from
    sys.unraisablehook and TensorStore's never-retrieved read tasks from the asyncio logger (see
    the module docstring), and turns Orbax's errors about an unparsable step metadata file into
    one warning line; idempotent."""
    previous = sys.unraisablehook
    if getattr(previous, "jaxgpt_quiet", False):
        return
    logging.getLogger("asyncio").addFilter(_DroppedReadTasks())
    logging.getLogger("absl").addFilter(_UnreadableStepMetadata())

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
            return
        if _abandoned_read(unraisable):
            return
        previous(unraisable)

    hook.jaxgpt_quiet = True
    sys.unraisablehook = hook


def _read_params(step_dir: Path, abstract: TrainState) -> dict:
    """The parameters alone from a checkpoint's `state` item, in `abstract.params`' shardings."""
    item = {"params": abstract.params}
    reader = ocp.PyTreeCheckpointer()
    try:
        return reader.restore(step_dir / "state", args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))["params"]
    finally:
        reader.close()


def find_checkpoint_dir(path: str | Path) -> Path:
    """A run dir or its checkpoints dir -> the checkpoints dir (init_from, export, sample)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        files.require_dir(p, "run dir")  # says it is a file
    for candidate in (p / "checkpoints", p):
        if candidate.is_dir() and any(c.name.isdigit() for c in candidate.iterdir()):
            return candidate
    raise UserError(f"{path}: no checkpoints found there (give a run dir or its checkpoints dir)")

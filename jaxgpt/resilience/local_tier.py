"""checkpoint.local_every: each process's own shards on host-local storage, and which tier a restart takes.

Lost work per failure is the interval between checkpoints. The persistent ones (jaxgpt/checkpoint.py,
`checkpoint.every`) go to the shared filesystem, which is slow and shared by everyone; so, as MaxText's
emergency checkpointing and Megatron's non-persistent local checkpoints do, a second, frequent tier
writes to storage each host has for itself (`checkpoint.local_dir`: /dev/shm, a local SSD):

    LOCAL_DIR/RUN-HASH/process-I-of-N/STEP/{state,data,config}   + layout.json beside the steps

RUN-HASH names the run dir (its name and a hash of its absolute path), so runs never share a tier.
Each process writes only the shards of the train state its own devices hold (every one of them,
replicas included: a host must be able to restore alone), with the data iterator's position and
the config, through Orbax's own machinery configured as Orbax's emergency checkpointing configures
its local tier: a `CheckpointManager` per process with `primary_host=None` (every process is the
primary of its directory) and an `ArrayHandler(primary_host=None, replica_id=None)`, here with
`active_processes={this process}` so that a local save never waits on another process. Saves are
asynchronous like the persistent ones; Orbax keeps the newest LOCAL_KEEP steps. layout.json holds
what the shards depend on (process count and index, the mesh, this process's devices); a directory
of another layout (another process count after an elastic restart, another mesh) is deleted when a
run starts, as are unfinished saves.

Which step a restart resumes from (`restore_newest`): every process lists its committed local steps
and they agree, over one collective, on the newest step that every process holds; it is taken if it
is newer than the newest persistent step, else the persistent tier is (as before, with its own
verification and set-aside). A local step is verified as a persistent one is: committed, readable
on every process, parameters finite, the data position well-formed. A step newest on some processes
but missing on another (a host that lost its local disk, a wiped /dev/shm) is said in one line and
passed over; one that fails to read is deleted with one line (it is a cache: kept, it would hold
memory and block the save of that step later); local steps newer than the one resumed from are
deleted on every process for the same reason. A completed run deletes its tier. Local steps never
leave LOCAL_DIR: nothing that reads a run dir (sample, export, init_from) can mistake one for a
persistent checkpoint.

Why not `orbax.checkpoint.experimental.emergency.CheckpointManager` itself (Orbax 0.12.8). It is
built for TPU multislice: it needs a replica axis of at least 2 in the mesh, each replica a whole
copy of the state on its own processes; replica 0 writes only the persistent tier and the other
replicas only the local one, and a restart restores from one replica's local copy and broadcasts it
to the others. So (1) a run whose processes hold different shards (fsdp or tp across hosts, or a
single process) gets no local tier at all (with one replica it silently drops the local
directory); (2) it owns the persistent tier too, in its own layout (a `state` item only; the data
position in a separate non-replicated directory; no config item), which would replace jaxgpt's
checkpoints, their damage handling and their readers (sample, export, init_from, resharding onto
any mesh); (3) its `delete` and `item_metadata` raise NotImplementedError. Its peer-to-peer variant
(`emergency.p2p`) adds a network service per process, and the replicator variant needs GKE's
replicator. What fits a jaxgpt run is the per-process Orbax configuration above, used here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import type_handlers
from orbax.checkpoint._src.serialization import type_handler_registry

from jaxgpt import files
from jaxgpt.checkpoint import TMP_SUFFIX, Checkpointer, Restored, describe_error, everyone, held_stderr, require_finite
from jaxgpt.config import Config
from jaxgpt.step import TrainState

LOCAL_KEEP = 2
NEWEST_SHARED = 8  # the newest local steps each process offers when the processes agree on one
LAYOUT = "layout.json"


def _say(message: str, warning: bool = False) -> None:
    if jax.process_index() == 0:
        print(f"warning: {message}" if warning else message, file=sys.stderr if warning else sys.stdout, flush=True)


class _PerProcessSaves(logging.Filter):
    """Orbax warns at every save with primary_host=None that it logs no global object size (the
    configuration of the module docstring, chosen on purpose): twice per local save, dropped, as is
    its note, when a local save starts, of the time the loop spent waiting for the previous one
    (the loop does so on purpose: jaxgpt/loop.py). And a
    local save that fails in Orbax's background thread is logged there with its traceback (and
    warnings about the files it misses); `save` says it in one line when it surfaces, so the warning
    and error records naming a local tier's directory go."""

    def __init__(self):
        super().__init__()
        self.roots: set[str] = set()
        self.saving = False  # a local save is being started (on this thread)

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Global object size logging disabled for `primary_host=None`"):
            return False
        if self.saving and str(record.msg).startswith("Waiting for previous save to complete took"):
            return False  # the loop waits for each local save on purpose (jaxgpt/loop.py): goodput counts it
        if record.levelno >= logging.WARNING and self.roots:
            try:
                text = record.getMessage() + (f" {record.exc_info[1]}" if record.exc_info else "")
            except Exception:  # noqa: BLE001 - a record whose arguments do not format: keep it
                return True
            return not any(root in text for root in self.roots)
        return True


_quiet = _PerProcessSaves()


def run_key(run_dir: Path) -> str:
    path = Path(run_dir).absolute()
    return f"{path.name}-{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"


def check_dir(cfg: Config) -> None:
    """Before anything compiles: checkpoint.local_dir must be a directory this process can write."""
    if cfg.checkpoint.local_every:
        files.writable_dir(Path(cfg.checkpoint.local_dir).expanduser(), "checkpoint.local_dir")


class LocalTier:
    """This process's local checkpoints (module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path, sizes: dict[str, int]):
        self.every = cfg.checkpoint.local_every
        self.async_save = cfg.checkpoint.async_save
        pid, count = jax.process_index(), jax.process_count()
        self.root = Path(cfg.checkpoint.local_dir).expanduser().absolute() / run_key(run_dir)
        self.directory = self.root / f"process-{pid}-of-{count}"
        self.layout = {"processes": count, "process": pid, "mesh": sizes,
                       "devices": sorted(d.id for d in jax.local_devices())}
        if _quiet not in logging.getLogger("absl").filters:
            logging.getLogger("absl").addFilter(_quiet)
        _quiet.roots.add(str(self.root))
        self._tidy()
        self.directory.mkdir(parents=True, exist_ok=True)
        files.write_text_atomically(self.directory / LAYOUT, json.dumps(self.layout))
        self.manager = self._manager()

    def _manager(self) -> ocp.CheckpointManager:
        pid = jax.process_index()
        alone = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={pid},
                                                   barrier_sync_key_prefix=f"jaxgpt-local-{pid}")
        registry = type_handler_registry.create_type_handler_registry(
            (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
        state = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, multiprocessing_options=alone,
                                            type_handler_registry=registry)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=LOCAL_KEEP, enable_async_checkpointing=self.async_save, create=False,
            multiprocessing_options=alone, enable_per_process_directory_creation=True, save_root_metadata=False)
        return ocp.CheckpointManager(self.directory, options=options, item_handlers={
            "state": state, "data": ocp.JsonCheckpointHandler(multiprocessing_options=alone),
            "config": ocp.JsonCheckpointHandler(multiprocessing_options=alone)})

    def _tidy(self) -> None:
        """Deletes directories of another layout under this run's root, this directory if its layout
        differs, and unfinished saves in it."""
        count = jax.process_count()
        if self.root.is_dir():
            for other in self.root.glob("process-*-of-*"):
                if not other.name.endswith(f"-of-{count}"):  # another process count: no step of it fits
                    shutil.rmtree(other, ignore_errors=True)
        try:
            stored = json.loads((self.directory / LAYOUT).read_text())
        except (OSError, ValueError):
            stored = None
        if stored is not None and stored != json.loads(json.dumps(self.layout)):
            _say(f"local checkpoint tier {self.directory} was written for another layout "
                 f"({str(stored)[:120]}); deleted it", warning=True)
            shutil.rmtree(self.directory, ignore_errors=True)
        for tmp in self.directory.glob(f"*{TMP_SUFFIX}*") if self.directory.is_dir() else []:
            shutil.rmtree(tmp, ignore_errors=True)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, state: TrainState, data_state: dict, cfg: Config) -> None:
        """Starts saving `step` (asynchronously). A local tier that fails (its directory wiped under
        the run, a full /dev/shm) costs its copies, not the run: one warning line per failure, and
        the persistent tier goes on."""
        try:
            if not (self.directory / LAYOUT).exists():  # wiped while the run went on: start it again
                self.directory.mkdir(parents=True, exist_ok=True)
                files.write_text_atomically(self.directory / LAYOUT, json.dumps(self.layout))
                self.manager.reload()
            _quiet.saving = True
            self.manager.save(step, force=True, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(cfg.to_dict())))
        except Exception as e:  # noqa: BLE001 - this save, or the previous one finishing in the background
            self._failed(step, e)
        finally:
            _quiet.saving = False

    def _failed(self, step: int | None, e: Exception) -> None:
        which = f"a save up to step {step}" if step is not None else "a save"
        print(f"warning: local checkpoint tier of process {jax.process_index()} ({self.directory}): {which} failed "
              f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); the persistent checkpoints "
              f"go on", file=sys.stderr, flush=True)

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - see save
            self._failed(None, e)

    def close(self) -> None:
        try:
            self.manager.close()
        except Exception as e:  # noqa: BLE001 - see save
            self._failed(None, e)

    def step_path(self, step: int) -> Path:
        return self.directory / str(step)

    def steps(self) -> list[int]:
        """This process's committed local steps, newest first."""
        self.manager.reload()
        return sorted((s for s in self.manager.all_steps() if (self.step_path(s) / "commit_success.txt").exists()),
                      reverse=True)

    def common_steps(self, above: int) -> list[int]:
        """The local steps newer than `above` that every process holds, newest first (a collective).
        Process 0 says so in one line when a newer step is missing on some process."""
        mine = np.full(NEWEST_SHARED, -1, np.int64)
        own = self.steps()[:NEWEST_SHARED]
        mine[:len(own)] = own
        every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), NEWEST_SHARED) \
            if jax.process_count() > 1 else mine[None]
        held = [set(int(s) for s in row if s >= 0) for row in every]
        common = set.intersection(*held)
        newest = max(set.union(*held), default=-1)
        best = max(common, default=-1)
        if newest > max(best, above):
            lacking = [p for p, steps in enumerate(held) if newest not in steps]
            fallback = f"step {best} of the local tier" if best > above else "the persistent tier, if any"
            _say(f"local checkpoint tier: step {newest} is not on every process (missing on process"
                 f"{'es' if len(lacking) > 1 else ''} {', '.join(map(str, lacking))}: not saved there before "
                 f"it stopped, or its {self.root}/process-* was lost); resuming from {fallback}", warning=True)
        return sorted((s for s in common if s > above), reverse=True)

    def restore(self, step: int, abstract: TrainState) -> tuple[Restored, dict] | None:
        """(the restored step, its config) if every process reads it back whole; else None, the step
        deleted on every process with one line."""
        path, out, why = self.step_path(step), None, ""
        with held_stderr() as held:
            try:
                restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
                got = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(abstract, restore_args=restore_args),
                    data=ocp.args.JsonRestore(), config=ocp.args.JsonRestore()))
                state = TrainState(*got.state) if not isinstance(got.state, TrainState) else got.state
                require_finite(state.params)
                data_state = dict(got.data)
                if not (type(data_state.get("next_index")) is int and data_state["next_index"] >= 0):
                    raise ValueError(f"its data iterator state is not {{'next_index': N >= 0}}: {str(data_state)[:80]}")
                if int(state.step) != step:
                    raise ValueError(f"it holds step {int(state.step)}")
                out = Restored(step, state, data_state, path), dict(got.config)
                held.release()
            except Exception as e:  # noqa: BLE001 - any failure to read means damage
                why = describe_error(e, path)
        if everyone(out is not None):
            return out
        _say(f"skipping local checkpoint step {step} ({path} on process {jax.process_index()}"
             f"{': ' + why if why else ' or another process: unreadable there'}); deleted it", warning=True)
        self.forget(lambda s: s == step)
        return None

    def forget(self, which) -> None:
        """Deletes this process's local steps for which `which(step)` holds."""
        for step in self.steps():
            if which(step):
                shutil.rmtree(self.step_path(step), ignore_errors=True)
        self.manager.reload()

    def remove(self) -> None:
        """The run completed: its local tier goes (the root too, once no process's directory is left)."""
        self.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
        try:
            self.root.rmdir()
        except OSError:
            pass


def restore_newest(ckpt: Checkpointer, local: LocalTier | None, abstract: TrainState,
                   config: Config) -> Restored | None:
    """The newest step complete on every process in either tier (module docstring), restored into
    `abstract`'s shardings; None for a run with no checkpoint. Local steps newer than the one taken
    are deleted; so are unfinished persistent saves, as a persistent resume does."""
    if local is None:
        restored = ckpt.restore_latest(abstract, config=config, set_aside=True)
        if restored is not None:
            ckpt.check_config_changes(restored.step, config, restored.data_state)
        return restored
    ckpt.manager.reload()
    listed = max(ckpt.manager.all_steps(), default=-1)
    candidates = local.common_steps(above=-1)
    for step in (s for s in candidates if s > listed):
        if (got := local.restore(step, abstract)) is not None:
            restored, stored = got
            ckpt.check_config_changes(step, config, restored.data_state, stored=stored, where=restored.path)
            ckpt.remove_unfinished()
            local.forget(lambda s: s > step)
            return restored
    restored = ckpt.restore_latest(abstract, config=config, set_aside=True)
    if restored is not None:
        ckpt.check_config_changes(restored.step, config, restored.data_state)
    floor = restored.step if restored is not None else 0
    for step in (s for s in candidates if floor < s <= listed):  # the newest persistent steps were damaged
        if (got := local.restore(step, abstract)) is not None:
            restored, stored = got
            ckpt.check_config_changes(step, config, restored.data_state, stored=stored, where=restored.path)
            floor = step
            break
    local.forget(lambda s: s > floor)
    return restored


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

Saves are asynchronous: `save` returns once the arrays are copied off the device and the writes
continue in a background thread. Orbax writes into a temporary directory and renames it when
complete (plus `commit_success.txt`), so a checkpoint either exists whole or not at all; jaxgpt
never writes checkpoint files itself.

Resume takes the newest step that reads back. A step directory without its commit marker, or
whose files are missing or truncated, is skipped with a warning naming it. If checkpoints exist
and none reads back, the run stops with an error rather than silently starting over. A checkpoint
whose array shapes differ from the current config (say `model.n_layer` changed) is an error that
lists the differences: that is a wrong command, not damage.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxgpt import files
from jaxgpt.config import CheckpointConfig, Config
from jaxgpt.errors import UserError
from jaxgpt.step import TrainState

COMMIT_MARKER = "commit_success.txt"


class Restored(NamedTuple):
    step: int
    state: TrainState
    data_state: dict[str, Any]
    path: Path


def _warn(message: str) -> None:
    if jax.process_index() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


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
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            "state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler()})

    def save(self, step: int, state: TrainState, data_state: dict, cfg: Config) -> None:
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

    def restore_latest(self, abstract: TrainState, params_only: bool = False) -> Restored | None:
        """The newest checkpoint that reads back, restored into `abstract`'s shardings. With
        `params_only` the optimizer state is not read at all (it comes back as None, the data
        state as {}): sampling, export and fine-tuning need a third of the memory and
        I/O. Orbax's partial restore reads the same committed files the manager wrote."""
        self.manager.reload()
        steps = sorted(self.manager.all_steps(), reverse=True)
        for step in steps:
            restored = self._try_restore(step, abstract, params_only)
            if restored is not None:
                return restored
        if steps:
            raise UserError(f"checkpoints exist in {self.directory} (steps {', '.join(map(str, steps))}) but none "
                            f"can be read; move them away to start over")
        return None

    def _try_restore(self, step: int, abstract: TrainState, params_only: bool) -> Restored | None:
        path = self.step_path(step)
        if not (path / COMMIT_MARKER).exists():
            _warn(f"skipping checkpoint {path}: it has no commit marker (an interrupted save)")
            return None
        try:
            stored = self.manager.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 - any failure to read means damage
            _warn(f"skipping checkpoint {path}: its metadata cannot be read ({type(e).__name__})")
            return None
        mismatches = _shape_mismatches(abstract, stored)
        if mismatches:
            raise UserError(f"checkpoint {path} does not fit the current config: {'; '.join(mismatches[:8])}"
                            + (f"; and {len(mismatches) - 8} more" if len(mismatches) > 8 else ""))
        try:
            if params_only:
                return Restored(step, TrainState(jnp.asarray(step, jnp.int32), _read_params(path, abstract), None),
                                {}, path)
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            _warn(f"skipping checkpoint {path}: it cannot be read ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''})")
            return None
        return Restored(step, out.state, dict(out.data), path)


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

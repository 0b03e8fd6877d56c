"""Hugging Face directories <-> jaxgpt runs: read and check an HF directory, export, import (for cli.py).

A directory's config.json picks its format (`FORMATS`: the GPT-2, Llama, Mixtral, Qwen3 and
Qwen3-MoE mappings of gpt2.py, llama.py, mixtral.py and qwen3.py) by its model_type, or without one
by its `architectures`.

`export` restores the newest readable checkpoint of a run (the config stored with it decides the
shapes and the class) onto one device and writes `model.safetensors`, a `config.json` that the
class's `from_pretrained` reads, a `generation_config.json` and the run's tokenizer
(hf/tokenizer.py: GPT-2's files, bos = eos = <|endoftext|>; or the tokenizer.json it was trained
with, bos and eos its own, a fine-tuned run's end-of-turn token among the eos ids), so the
directory is usable as it is: `AutoTokenizer` + the model generate what `jaxgpt.sample` generates.
The files are written into a hidden staging directory inside OUT_DIR and then moved into place,
the weights last: a killed export leaves no `model.safetensors` that `hf check` or
`from_pretrained` would take for a complete directory (a re-run removes the staging directory
left behind).

`load_dir` is the way back, for initialising a run (`checkpoint.init_from_hf`). `import` turns an
HF directory into a jaxgpt run dir holding one checkpoint at step 0 (the weights, a fresh optimizer
state, the data iterator at its start, the config implied by config.json plus any overrides),
which `sample`, `export`, `checkpoint.init_from` and a resumed `train` read like any other. A
directory with its own tokenizer.json brings it along: the run keeps a copy (RUN_DIR/tokenizer)
and its config names it as data.tokenizer, with model.document_token its document separator.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from safetensors.numpy import load_file, save_file

from jaxgpt import files
from jaxgpt import tokenizer as tokenizers_
from jaxgpt.checkpoint import Checkpointer, find_checkpoint_dir
from jaxgpt.config import CheckpointConfig, Config, ModelConfig, from_dict, load_config
from jaxgpt.errors import UserError
from jaxgpt.hf import gpt2, llama, mixtral, qwen3, tokenizer
from jaxgpt.hf.classes import architecture
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.step import TrainState, abstract_state, make_setup
from jaxgpt.tokenizer import EOT_ID

WEIGHTS, CONFIG, GENERATION_CONFIG = "model.safetensors", "config.json", "generation_config.json"


class Format(NamedTuple):
    """One transformers class: its name, the tensor mapping both ways and what config.json says."""
    name: str
    architecture: str  # the class's name in config.json's `architectures`
    to_hf: Callable[[dict, ModelConfig], dict[str, np.ndarray]]
    from_hf: Callable[[dict[str, np.ndarray], ModelConfig], dict]
    hf_config: Callable[[ModelConfig], dict[str, Any]]
    model_overrides: Callable[[dict[str, Any]], dict[str, Any]]
    check_config: Callable[[dict[str, Any], ModelConfig, Path], None]
    config_shape: dict[str, Any]


def _format(name: str, module: Any) -> Format:
    """The Format of one mapping module (gpt2.py, llama.py, mixtral.py: the same public names)."""
    return Format(name, module.ARCHITECTURE, module.to_hf, module.from_hf, module.hf_config, module.model_overrides,
                  module.check_config, module.CONFIG_SHAPE)


FORMATS = {"gpt2": _format("GPT-2", gpt2), "llama": _format("Llama", llama), "mixtral": _format("Mixtral", mixtral),
           "qwen3": _format("Qwen3", qwen3), "qwen3_moe": _format("Qwen3-MoE", qwen3.Moe)}


def _format_of(hf_cfg: dict[str, Any], source: Path) -> Format:
    """config.json's model_type (or, without one, its architectures) -> the Format that reads it."""
    files.check_shape(hf_cfg, f"Hugging Face config {source}", optional={"model_type": str, "architectures": list})
    default = next((kind for kind, f in FORMATS.items() if f.architecture in hf_cfg.get("architectures", [])), "gpt2")
    kind = hf_cfg.get("model_type", default)
    if kind not in FORMATS:
        raise UserError(f"{source} describes a {kind!r} model; jaxgpt reads GPT-2, Llama, Mixtral, Qwen3 and Qwen3-MoE "
                        f"(model_type gpt2, llama, mixtral, qwen3 or qwen3_moe)")
    fmt = FORMATS[kind]
    files.check_shape(hf_cfg, f"Hugging Face config {source}", optional=fmt.config_shape)
    for key, value in hf_cfg.items():
        if key in fmt.config_shape and type(value) is int and value < 1:
            raise UserError(f"Hugging Face config {source}: {key} must be positive, got {value}")
    return fmt


def read_dir(hf_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], Format]:
    hf_dir = files.require_dir(hf_dir, "Hugging Face directory")
    if not (hf_dir / CONFIG).is_file():
        raise UserError(f"{hf_dir} holds no {CONFIG}; give a directory written by save_pretrained or jaxgpt.hf export")
    hf_cfg = files.read_json_object(hf_dir / CONFIG, "Hugging Face config")
    fmt = _format_of(hf_cfg, hf_dir / CONFIG)
    index = hf_dir / f"{WEIGHTS}.index.json"  # save_pretrained shards files over 5 GB
    names = [WEIGHTS]
    if index.is_file():
        weight_map = files.read_json_object(index, "weights index", required={"weight_map": dict})["weight_map"]
        if not all(isinstance(v, str) and v and "/" not in v for v in weight_map.values()):
            raise UserError(f"weights index {index}: weight_map must map tensor names to file names in {hf_dir}")
        names = sorted(set(weight_map.values()))
    tensors = {}
    for name in names:
        if not (hf_dir / name).is_file():
            raise UserError(f"{hf_dir} holds no {name} (only safetensors weights are read, not pytorch_model.bin)")
        try:
            tensors |= load_file(hf_dir / name)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise UserError(f"{hf_dir / name} cannot be read as safetensors ({e})") from None
    for key, x in tensors.items():  # a damaged or diverged model: refused here, not as a NaN loss later
        if x.dtype.kind not in "biu" and not np.isfinite(x.astype(np.float32)).all():  # bf16 is kind 'V' here
            raise UserError(f"{hf_dir}: tensor {key} holds NaN or infinite values")
    return hf_cfg, tensors, fmt


def load_dir(hf_dir: Path, model_cfg: ModelConfig) -> dict:
    """config.json + model.safetensors (GPT-2, Llama, Qwen3, Mixtral or Qwen3-MoE, as save_pretrained/export write them) -> our
    params, checked."""
    hf_cfg, tensors, fmt = read_dir(hf_dir)
    _same_class(fmt, model_cfg, hf_dir)
    fmt.check_config(hf_cfg, model_cfg, Path(hf_dir) / CONFIG)
    return fmt.from_hf(tensors, model_cfg)


def check_dir(hf_dir: Path) -> tuple[str, int, dict[str, Any]]:
    """(the class's name, parameter count, the model.* keys it implies) of an HF directory, read in
    full and checked as an import would (`python -m jaxgpt.hf check`)."""
    hf_cfg, tensors, fmt = read_dir(hf_dir)
    overrides = fmt.model_overrides(hf_cfg)
    m = ModelConfig(**{k.removeprefix("model."): v for k, v in overrides.items()})
    fmt.check_config(hf_cfg, m, Path(hf_dir) / CONFIG)
    return fmt.name, sum(x.size for x in fmt.to_hf(fmt.from_hf(tensors, m), m).values()), overrides


def _one_device_mesh():
    return make_mesh({}, jax.devices()[:1])  # every axis 1


def restore_params(run_dir_or_ckpt: Path, check: Callable[[Config], None] | None = None) -> tuple[dict, Config, int]:
    """(params on one device, the run's config, step) of the newest readable checkpoint. `check`
    sees the config before any parameter is read (a sampler validates its prompt length there)."""
    ckpt_dir = find_checkpoint_dir(run_dir_or_ckpt)
    ckpt = Checkpointer(ckpt_dir, CheckpointConfig())
    try:
        cfg, why = None, ""
        for step in sorted(ckpt.manager.all_steps(), reverse=True):  # the config saved with the checkpoint
            try:
                stored = ckpt.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
                cfg = from_dict(dict(stored), f"the config stored in {ckpt_dir / str(step)}")
                break
            except UserError as e:  # a hand-edited value: said if no older step has a good one
                why = f" ({e})"
            except Exception:  # noqa: BLE001 - damaged: restore_latest below warns about it
                continue
        if cfg is None:
            raise UserError(f"no checkpoint in {ckpt_dir} has a readable config{why}")
        if check is not None:
            check(cfg)
        mesh = _one_device_mesh()
        with jax.set_mesh(mesh):
            setup = make_setup(cfg, mesh)
            restored = ckpt.restore_latest(abstract_state(cfg, setup), params_only=True)  # skips damaged steps
    finally:
        ckpt.close()
    return restored.state.params, cfg, restored.step


EXPORT_FILES = (WEIGHTS, CONFIG, GENERATION_CONFIG, *tokenizer.FILES)  # a GPT-2 tokenizer's run
_ALLOWED = (WEIGHTS, CONFIG, GENERATION_CONFIG, *tokenizer.ALL_FILES)  # any run's


def _format_for(cfg: Config) -> Format:
    """The Format that holds this model, or classes.architecture's one-line UserError."""
    return FORMATS[architecture(cfg.model)]


def _same_class(fmt: Format, m: ModelConfig, hf_dir: Path) -> None:
    """UserError (one line) unless some class holds `m` and an MoE `m` meets a Mixtral or Qwen3-MoE
    directory (the formats' check_config name every other mismatch by its model.* keys)."""
    architecture(m)
    if m.moe_experts and fmt not in (FORMATS["mixtral"], FORMATS["qwen3_moe"]):
        raise UserError(f"{hf_dir} holds a {fmt.name} model, which has no experts, but the model config sets "
                        f"model.moe_experts={m.moe_experts}; set model.moe_experts=0")


def generation_config(tok: tokenizers_.Tokenizer | None = None, end_of_turn: str | None = None) -> dict[str, Any]:
    """generation_config.json (and config.json's token ids): GPT-2's starts and stops at <|endoftext|>;
    another tokenizer's starts at its bos token and stops at its eos token or at `end_of_turn`, the
    chat template's end-of-turn marker where that is a special token."""
    if tok is None or tok.name == tokenizers_.TOKENIZER_NAME:
        return {"bos_token_id": EOT_ID, "eos_token_id": EOT_ID}
    eos = [tok.specials[t] for t in dict.fromkeys((tok.eos, end_of_turn)) if t in tok.specials]
    return {"bos_token_id": tok.specials.get(tok.bos), "eos_token_id": eos[0] if len(eos) == 1 else eos or None}


def export(run_dir_or_ckpt: Path, out_dir: Path) -> int:
    """Writes the weights, config.json, generation_config.json and the run's tokenizer (EXPORT_FILES for
    GPT-2's; hf/tokenizer.py) into OUT_DIR from a run's newest checkpoint; returns its step."""
    out_dir = files.writable_dir(out_dir, "export directory", files=_ALLOWED)
    if out_dir.is_dir() and (others := sorted(p.name for p in out_dir.iterdir()
                                              if p.name not in _ALLOWED and not p.name.startswith(_STAGING))):
        raise UserError(f"export directory {out_dir} holds other files ({', '.join(others[:5])}"
                        f"{', ...' if len(others) > 5 else ''}); export into a new or empty directory, or over an "
                        f"earlier export")  # a run dir, or someone's config.json next to their notes
    params, cfg, step = restore_params(run_dir_or_ckpt, check=_format_for)
    fmt = _format_for(cfg)
    tok = tokenizers_.of_run(run_dir_or_ckpt, cfg.data.tokenizer)  # the one the run was trained with
    if cfg.model.vocab_size < tok.n_vocab:  # an imported model with its own vocabulary, imported without it
        print(f"warning: the model's vocabulary is {cfg.model.vocab_size} tokens, smaller than its tokenizer's "
              f"{tok.n_vocab} ({tok.describe()}): the tokenizer files written beside it produce ids it does not have",
              file=sys.stderr, flush=True)
    template = None  # a fine-tuned run's template, where its tokenizer has none of its own (hf/tokenizer.py)
    if cfg.data.chat_template or (cfg.data.chat and not tok.chat_template):
        from jaxgpt.chat.template import ChatTemplate
        template = ChatTemplate(tok, cfg.data.chat_template)
    hf_cfg = fmt.hf_config(cfg.model) | generation_config(tok, template and template.end_of_turn)
    out_dir.mkdir(parents=True, exist_ok=True)
    for left in out_dir.glob(f"{_STAGING}*"):  # a killed export's
        shutil.rmtree(left, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=out_dir))
    try:
        # transformers refuses safetensors files without a "format" entry in their metadata.
        save_file(fmt.to_hf(params, cfg.model), staging / WEIGHTS, metadata={"format": "pt"})
        (staging / CONFIG).write_text(json.dumps(hf_cfg, indent=2) + "\n")
        (staging / GENERATION_CONFIG).write_text(json.dumps(generation_config(tok, template and template.end_of_turn),
                                                            indent=2) + "\n")
        names = [WEIGHTS, CONFIG, GENERATION_CONFIG,
                 *tokenizer.write(staging, cfg.model.seq_len, tok, template and template.text)]
        for stale in set(_ALLOWED) - set(names):  # an earlier export's other tokenizer files
            (out_dir / stale).unlink(missing_ok=True)
        for name in sorted(names, key=lambda name: name == WEIGHTS):  # the weights last
            os.chmod(staging / name, 0o666 & ~files.umask())  # safetensors and mkdtemp's files: 0600
            os.replace(staging / name, out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return step


_STAGING = ".jaxgpt-export-"


def _fresh_data_state() -> dict:
    """The data iterator's state before its first batch (what a step-0 checkpoint holds)."""
    from jaxgpt.data import train_iterator
    return train_iterator(np.zeros(2, "<u2"), seq_len=1, global_batch=1, seed=0, process_index=0,
                          process_count=1).get_state()


def import_dir(hf_dir: Path, run_dir: Path, config: str | None = None,
               overrides: Sequence[str] = ()) -> tuple[Config, list[str]]:
    """Writes RUN_DIR/checkpoints/0 and RUN_DIR/config.yaml from an HF GPT-2, Llama, Qwen3, Mixtral or Qwen3-MoE directory,
    without training: the model.* keys come from its config.json (then `config` and `overrides`),
    the parameters from its weights, the optimizer state is a fresh one. Returns the config and
    the model.* keys config.json implies (what a `train --run-dir` resuming it must keep)."""
    from jaxgpt.tracking import check_run_dir

    run_dir = check_run_dir(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if ckpt_dir.is_dir() and any(c.name.isdigit() for c in ckpt_dir.iterdir()):
        raise UserError(f"run dir {run_dir} already holds checkpoints; import into a new run dir")
    hf_cfg, tensors, fmt = read_dir(hf_dir)
    implied = fmt.model_overrides(hf_cfg)
    tok = tokenizers_.load(str(hf_dir)) if (Path(hf_dir) / tokenizers_.HF_FILE).is_file() else None
    if tok is not None and tok.name != tokenizers_.TOKENIZER_NAME:  # its own: the run keeps a copy (tokenizer.py)
        implied |= {"data.tokenizer": str(run_dir / tokenizers_.RUN_SUBDIR), "model.document_token": tok.separator_id}
    cfg = load_config(config, [*(f"{key}={value}" for key, value in implied.items()), *overrides])
    _same_class(fmt, cfg.model, hf_dir)
    fmt.check_config(hf_cfg, cfg.model, Path(hf_dir) / CONFIG)
    params = fmt.from_hf(tensors, cfg.model)
    if tok is None and cfg.model.vocab_size != tokenizers_.N_VOCAB:
        print(f"warning: {hf_dir} has a vocabulary of {cfg.model.vocab_size} tokens, not GPT-2's "
              f"{tokenizers_.N_VOCAB}, and no {tokenizers_.HF_FILE}: set data.tokenizer to the model's own to "
              f"sample or train it", file=sys.stderr, flush=True)
    if tok is not None and tok.name != tokenizers_.TOKENIZER_NAME:
        run_dir.mkdir(parents=True, exist_ok=True)
        tokenizers_.keep(run_dir, tok)
    mesh = _one_device_mesh()
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        params = jax.device_put(params, setup.shardings.params)
        opt_state = jax.jit(setup.optimizer.init, out_shardings=setup.shardings.opt_state)(params)
        step = jax.device_put(np.zeros((), np.int32), setup.shardings.step)
        ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)
        try:
            ckpt.save(0, TrainState(step, params, opt_state), _fresh_data_state(), cfg)
            ckpt.wait()
        finally:
            ckpt.close()
    files.write_text_atomically(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return cfg, list(implied)


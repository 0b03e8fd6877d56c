"""Hugging Face interop: `python -m jaxgpt.hf export RUN_DIR OUT_DIR`, `import HF_DIR RUN_DIR`, `check HF_DIR`.

Two transformers classes hold jaxgpt models: `GPT2LMHeadModel` a GPT-2-shaped one (every
architecture key at its default), `LlamaForCausalLM` a Llama-shaped one (RMSNorm with a scale,
RoPE, SwiGLU; any grouped-query heads, MLP width, rope_theta, tied or untied head, biases or not).
`hf_llama.architecture` picks the class from the model config on export and refuses in one line
what neither holds; on the way in, config.json's model_type (or its `architectures`) picks it.
The GPT-2 mapping is below; the Llama mapping, with its RoPE layout convention (rotate-half, so q
and k cross unpermuted), is in hf_llama.py's docstring.

GPT-2. Our parameters (jaxgpt/model/gpt.py) are stored so that every HF `GPT2LMHeadModel` tensor is a plain
row-major reshape of one layer's slice; nothing is transposed. HF's `Conv1D` weights are [in, out]:

    ours (blocks stacked on L)                HF (per layer i; "transformer." prefix optional)
    wte                  [Vp, D]              wte.weight            [V, D]  first V rows; lm_head tied
    wpe                  [T, D]               wpe.weight            [T, D]
    blocks.ln_1.scale    [L, D]               h.i.ln_1.weight       [D]     (bias alike; ln_2, ln_f)
    blocks.attn.c_attn_kernel [L, D, 3, H, K] h.i.attn.c_attn.weight [D, 3D] columns q|k|v, heads inside
    blocks.attn.c_attn_bias   [L, 3, H, K]    h.i.attn.c_attn.bias   [3D]
    blocks.attn.c_proj_kernel [L, H, K, D]    h.i.attn.c_proj.weight [D, D]  rows head-major
    blocks.mlp.c_fc_kernel    [L, D, F]       h.i.mlp.c_fc.weight    [D, F]
    blocks.mlp.c_proj_kernel  [L, F, D]       h.i.mlp.c_proj.weight  [F, D]

The functions agree with GPT-2 on everything else: LayerNorm eps 1e-5, GELU with the tanh
approximation (`gelu_new`), attention scaled by 1/sqrt(K), tied input/output embedding. The
vocabulary padding (jaxgpt/model/gpt.py) is dropped on export and zero-filled on import; padded logits are
-inf, so those rows never matter. On import a longer position table than `model.seq_len` is cut
to its first T rows (positions are absolute, so a prefix is the same model on shorter contexts).
HF's causal-mask buffers (`h.i.attn.bias`, `masked_bias`) are ignored.

`export` restores the newest readable checkpoint of a run (the config stored with it decides the
shapes and the class) onto one device and writes `model.safetensors`, a `config.json` that
`GPT2LMHeadModel.from_pretrained` (or `LlamaForCausalLM`'s) reads, a `generation_config.json`
(bos = eos = <|endoftext|>) and GPT-2's tokenizer files (`hf_tokenizer.py`), so the directory is
usable as it is: `AutoTokenizer` + the model generate what `jaxgpt.sample` generates.

`load_dir` is the way back, for initialising a run (`checkpoint.init_from_hf`). `import` turns an
HF directory into a jaxgpt run dir holding one checkpoint at step 0 (the weights, a fresh optimizer
state, the data iterator at its start, the config implied by config.json plus any overrides),
which `sample`, `export`, `checkpoint.init_from` and a resumed `train` read like any other.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from safetensors.numpy import load_file, save_file

from jaxgpt import files, hf_llama, hf_tokenizer
from jaxgpt.checkpoint import Checkpointer, find_checkpoint_dir
from jaxgpt.cli import ArgumentParser, run_main
from jaxgpt.config import CheckpointConfig, Config, ModelConfig, load_config, sections
from jaxgpt.errors import UserError
from jaxgpt.hf_weights import Tensors
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.step import TrainState, abstract_state, make_setup
from jaxgpt.tokenizer import N_VOCAB

WEIGHTS, CONFIG, GENERATION_CONFIG = "model.safetensors", "config.json", "generation_config.json"
EOT = 50256  # <|endoftext|>, GPT-2's bos and eos


def _layer_table(m: ModelConfig) -> dict[str, tuple[tuple[str, str], tuple[int, ...], tuple[int, ...]]]:
    """HF name inside h.{i} -> (our path under blocks, HF shape, our per-layer shape)."""
    D, F, H, K = m.n_embd, 4 * m.n_embd, m.n_head, m.head_dim
    table = {f"{ln}.{hf}": ((ln, ours), (D,), (D,)) for ln in ("ln_1", "ln_2")
             for hf, ours in (("weight", "scale"), ("bias", "bias"))}
    return table | {
        "attn.c_attn.weight": (("attn", "c_attn_kernel"), (D, 3 * D), (D, 3, H, K)),
        "attn.c_attn.bias": (("attn", "c_attn_bias"), (3 * D,), (3, H, K)),
        "attn.c_proj.weight": (("attn", "c_proj_kernel"), (D, D), (H, K, D)),
        "attn.c_proj.bias": (("attn", "c_proj_bias"), (D,), (D,)),
        "mlp.c_fc.weight": (("mlp", "c_fc_kernel"), (D, F), (D, F)),
        "mlp.c_fc.bias": (("mlp", "c_fc_bias"), (F,), (F,)),
        "mlp.c_proj.weight": (("mlp", "c_proj_kernel"), (F, D), (F, D)),
        "mlp.c_proj.bias": (("mlp", "c_proj_bias"), (D,), (D,)),
    }


def to_hf(params: dict, model_cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our nested params -> {HF GPT2LMHeadModel name: fp32 array}, vocabulary padding removed."""
    def f32(x) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x, np.float32))

    out = {"transformer.wte.weight": f32(np.asarray(params["wte"])[: model_cfg.vocab_size]),
           "transformer.wpe.weight": f32(params["wpe"]),
           "transformer.ln_f.weight": f32(params["ln_f"]["scale"]),
           "transformer.ln_f.bias": f32(params["ln_f"]["bias"])}
    for name, ((group, key), hf_shape, _) in _layer_table(model_cfg).items():
        stacked = np.asarray(params["blocks"][group][key], np.float32)
        for i in range(model_cfg.n_layer):
            out[f"transformer.h.{i}.{name}"] = f32(stacked[i].reshape(hf_shape))
    return out


def from_hf(tensors: dict[str, np.ndarray], model_cfg: ModelConfig) -> dict:
    """{HF name: array} (with or without the "transformer." prefix) -> our nested params (fp32 numpy)."""
    m = model_cfg
    w = Tensors({k.removeprefix("transformer."): v for k, v in tensors.items()
                 if not re.fullmatch(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias", k)}, "h", m.n_layer)
    take = w.take
    wte_VD = w.take_embedding("wte.weight", m.vocab_size, m.n_embd)
    wpe = w.get("wpe.weight")
    if wpe is not None and wpe.ndim == 2 and wpe.shape[0] > m.seq_len:
        w.put("wpe.weight", wpe[: m.seq_len])  # a shorter context: keep the first positions
    params: dict[str, Any] = {
        "wte": np.concatenate([wte_VD, np.zeros((m.padded_vocab - m.vocab_size, m.n_embd), np.float32)]),
        "wpe": take("wpe.weight", (m.seq_len, m.n_embd), f" (model.seq_len={m.seq_len} is longer than the table)"),
        "ln_f": {"scale": take("ln_f.weight", (m.n_embd,)), "bias": take("ln_f.bias", (m.n_embd,))},
        "blocks": {"ln_1": {}, "ln_2": {}, "attn": {}, "mlp": {}},
    }
    for name, ((group, key), hf_shape, our_shape) in _layer_table(m).items():
        params["blocks"][group][key] = np.stack(
            [take(f"h.{i}.{name}", hf_shape).reshape(our_shape) for i in range(m.n_layer)])
    head = w.get("lm_head.weight")
    if head is not None:
        if not np.array_equal(np.asarray(head, np.float32), wte_VD):
            raise UserError("lm_head.weight differs from wte.weight: only GPT-2's tied output head is supported")
        take("lm_head.weight", head.shape)
    w.finish()
    return params


def hf_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """A config.json that transformers.GPT2Config reads as this model (no dropout, as we train)."""
    m = model_cfg
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_positions": m.seq_len, "n_embd": m.n_embd, "n_layer": m.n_layer, "n_head": m.n_head,
            "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True,
            "bos_token_id": EOT, "eos_token_id": EOT, "dtype": "float32"}  # "torch_dtype" before transformers 4.56


def generation_config() -> dict[str, Any]:
    """GPT-2's generation_config.json: generation starts and stops at <|endoftext|>."""
    return {"bos_token_id": EOT, "eos_token_id": EOT}


# config.json key -> (our key, GPT2Config's default)
_SIZES = {"n_layer": ("model.n_layer", 12), "n_head": ("model.n_head", 12), "n_embd": ("model.n_embd", 768),
          "n_positions": ("model.seq_len", 1024), "vocab_size": ("model.vocab_size", 50257)}
# GPT2Config options our GPT-2 has one value of: key -> (GPT2Config's default, the values we accept)
_FIXED = {"activation_function": ("gelu_new", ("gelu_new", "gelu_pytorch_tanh")),  # both are tanh GELU
          "layer_norm_epsilon": (1e-5, (1e-5,)), "scale_attn_weights": (True, (True,)),
          "scale_attn_by_inverse_layer_idx": (False, (False,)), "tie_word_embeddings": (True, (True,))}


def model_overrides(hf_cfg: dict[str, Any]) -> dict[str, int]:
    """config.json -> the model.* keys it implies ({'model.n_layer': 12, ...})."""
    return {ours: hf_cfg.get(key, default) for key, (ours, default) in _SIZES.items()}


def _check_config(hf_cfg: dict[str, Any], m: ModelConfig, source: Path) -> None:
    if m.beyond_gpt2():
        raise UserError(f"{source} describes a GPT-2 but the model config sets {', '.join(m.beyond_gpt2())}; "
                        f"drop those keys")
    fixed = _FIXED | {"n_inner": (None, (None, 4 * hf_cfg.get("n_embd", 768)))}
    for key, (default, allowed) in fixed.items():
        if hf_cfg.get(key, default) not in allowed:
            raise UserError(f"{source}: {key}={hf_cfg[key]!r} is not supported (jaxgpt's GPT-2 has {allowed[0]!r})")
    wrong = []
    for key, (ours, default) in _SIZES.items():
        have, want = hf_cfg.get(key, default), getattr(m, ours.removeprefix("model."))
        # a longer position table is fine: from_hf keeps its first seq_len rows
        if have < want if key == "n_positions" else have != want:
            wrong.append((key, have, ours, want))
    if wrong:
        raise UserError(f"{source} does not match the model config ("
                        + ", ".join(f"{key} {have} vs {ours}={want}" for key, have, ours, want in wrong)
                        + "); override with " + " ".join(f"{ours}={have}" for _, have, ours, _ in wrong))


# The config.json keys we read, with their JSON types (GPT2Config's own types).
_CONFIG_SHAPE = {"model_type": str, "activation_function": str, "layer_norm_epsilon": files.NUMBER,
                 "scale_attn_weights": bool, "scale_attn_by_inverse_layer_idx": bool, "tie_word_embeddings": bool,
                 "n_inner": (int, type(None))} | {key: int for key in _SIZES}


class Format(NamedTuple):
    """One transformers class: the tensor mapping both ways and what config.json says."""
    name: str
    to_hf: Callable[[dict, ModelConfig], dict[str, np.ndarray]]
    from_hf: Callable[[dict[str, np.ndarray], ModelConfig], dict]
    hf_config: Callable[[ModelConfig], dict[str, Any]]
    model_overrides: Callable[[dict[str, Any]], dict[str, Any]]
    check_config: Callable[[dict[str, Any], ModelConfig, Path], None]
    config_shape: dict[str, Any]


FORMATS = {"gpt2": Format("GPT-2", to_hf, from_hf, hf_config, model_overrides, _check_config, _CONFIG_SHAPE),
           "llama": Format("Llama", hf_llama.to_hf, hf_llama.from_hf, hf_llama.hf_config, hf_llama.model_overrides,
                           hf_llama.check_config, hf_llama.CONFIG_SHAPE)}


def _format_of(hf_cfg: dict[str, Any], source: Path) -> Format:
    """config.json's model_type (or, without one, its architectures) -> the Format that reads it."""
    files.check_shape(hf_cfg, f"Hugging Face config {source}", optional={"model_type": str, "architectures": list})
    default = "llama" if hf_llama.ARCHITECTURE in hf_cfg.get("architectures", []) else "gpt2"
    kind = hf_cfg.get("model_type", default)
    if kind not in FORMATS:
        raise UserError(f"{source} describes a {kind!r} model; jaxgpt reads GPT-2 and Llama (model_type gpt2 or llama)")
    fmt = FORMATS[kind]
    files.check_shape(hf_cfg, f"Hugging Face config {source}", optional=fmt.config_shape)
    for key, value in hf_cfg.items():
        if key in fmt.config_shape and type(value) is int and value < 1:
            raise UserError(f"Hugging Face config {source}: {key} must be positive, got {value}")
    return fmt


def _read_dir(hf_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], Format]:
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
    return hf_cfg, tensors, fmt


def load_dir(hf_dir: Path, model_cfg: ModelConfig) -> dict:
    """config.json + model.safetensors (GPT-2 or Llama, as from_pretrained/export write them) -> our params, checked."""
    hf_cfg, tensors, fmt = _read_dir(hf_dir)
    hf_llama.architecture(model_cfg)  # no experts, no mix of the two
    fmt.check_config(hf_cfg, model_cfg, Path(hf_dir) / CONFIG)
    return fmt.from_hf(tensors, model_cfg)


def _config_from_dict(d: dict[str, Any]) -> Config:
    return Config(**{s: cls(**{k: v for k, v in d.get(s, {}).items() if k in cls.__dataclass_fields__})
                     for s, cls in sections().items()})


def _one_device_mesh():
    return make_mesh({}, jax.devices()[:1])  # every axis 1


def restore_params(run_dir_or_ckpt: Path, check: Callable[[Config], None] | None = None) -> tuple[dict, Config, int]:
    """(params on one device, the run's config, step) of the newest readable checkpoint. `check`
    sees the config before any parameter is read (a sampler validates its prompt length there)."""
    ckpt_dir = find_checkpoint_dir(run_dir_or_ckpt)
    ckpt = Checkpointer(ckpt_dir, CheckpointConfig())
    try:
        cfg = None
        for step in sorted(ckpt.manager.all_steps(), reverse=True):  # the config saved with the checkpoint
            try:
                cfg = _config_from_dict(ckpt.manager.restore(step, args=ocp.args.Composite(
                    config=ocp.args.JsonRestore())).config)
                break
            except Exception:  # noqa: BLE001 - damaged: restore_latest below warns about it
                continue
        if cfg is None:
            raise UserError(f"no checkpoint in {ckpt_dir} has a readable config")
        if check is not None:
            check(cfg)
        mesh = _one_device_mesh()
        with jax.set_mesh(mesh):
            setup = make_setup(cfg, mesh)
            restored = ckpt.restore_latest(abstract_state(cfg, setup), params_only=True)  # skips damaged steps
    finally:
        ckpt.close()
    return restored.state.params, cfg, restored.step


EXPORT_FILES = (WEIGHTS, CONFIG, GENERATION_CONFIG, *hf_tokenizer.FILES)


def _format_for(cfg: Config) -> Format:
    """The Format that holds this model, or hf_llama.architecture's one-line UserError."""
    return FORMATS[hf_llama.architecture(cfg.model)]


def export(run_dir_or_ckpt: Path, out_dir: Path) -> int:
    """Writes EXPORT_FILES into OUT_DIR from a run's newest checkpoint; returns its step."""
    out_dir = files.writable_dir(out_dir, "export directory", files=EXPORT_FILES)
    params, cfg, step = restore_params(run_dir_or_ckpt, check=_format_for)
    fmt = _format_for(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers refuses safetensors files without a "format" entry in their metadata.
    save_file(fmt.to_hf(params, cfg.model), out_dir / WEIGHTS, metadata={"format": "pt"})
    (out_dir / CONFIG).write_text(json.dumps(fmt.hf_config(cfg.model), indent=2) + "\n")
    (out_dir / GENERATION_CONFIG).write_text(json.dumps(generation_config(), indent=2) + "\n")
    hf_tokenizer.write(out_dir, model_max_length=cfg.model.seq_len)
    return step


def _fresh_data_state() -> dict:
    """The data iterator's state before its first batch (what a step-0 checkpoint holds)."""
    from jaxgpt.data import train_iterator
    return train_iterator(np.zeros(2, "<u2"), seq_len=1, global_batch=1, seed=0, process_index=0,
                          process_count=1).get_state()


def import_dir(hf_dir: Path, run_dir: Path, config: str | None = None,
               overrides: Sequence[str] = ()) -> tuple[Config, list[str]]:
    """Writes RUN_DIR/checkpoints/0 and RUN_DIR/config.yaml from an HF GPT-2 or Llama directory,
    without training: the model.* keys come from its config.json (then `config` and `overrides`),
    the parameters from its weights, the optimizer state is a fresh one. Returns the config and
    the model.* keys config.json implies (what a `train --run-dir` resuming it must keep)."""
    from jaxgpt.tracking import check_run_dir

    run_dir = check_run_dir(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if ckpt_dir.is_dir() and any(c.name.isdigit() for c in ckpt_dir.iterdir()):
        raise UserError(f"run dir {run_dir} already holds checkpoints; import into a new run dir")
    hf_cfg, tensors, fmt = _read_dir(hf_dir)
    implied = fmt.model_overrides(hf_cfg)
    cfg = load_config(config, [*(f"{key}={value}" for key, value in implied.items()), *overrides])
    hf_llama.architecture(cfg.model)
    fmt.check_config(hf_cfg, cfg.model, Path(hf_dir) / CONFIG)
    params = fmt.from_hf(tensors, cfg.model)
    if cfg.model.vocab_size != N_VOCAB:
        print(f"warning: {hf_dir} has a vocabulary of {cfg.model.vocab_size} tokens, not GPT-2's {N_VOCAB}: jaxgpt "
              f"tokenizes with GPT-2's BPE only, so sample and train would feed it GPT-2 token ids",
              file=sys.stderr, flush=True)
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
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return cfg, list(implied)


def _main(argv: Sequence[str] | None) -> None:
    parser = ArgumentParser(prog="python -m jaxgpt.hf", description="Hugging Face GPT-2 and Llama export and import.")
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("export", help="write a run's newest checkpoint as an HF GPT-2 or Llama directory")
    ex.add_argument("run_dir", type=Path, help="a run dir or its checkpoints dir")
    ex.add_argument("out_dir", type=Path, help="gets the weights, config.json, generation_config.json and tokenizer")
    check = commands.add_parser("check", help="load an HF GPT-2 or Llama directory and print its size")
    check.add_argument("hf_dir", type=Path)
    imp = commands.add_parser("import", help="turn an HF GPT-2 or Llama directory into a jaxgpt run dir "
                                             "(a step-0 checkpoint)")
    imp.add_argument("hf_dir", type=Path, help="config.json + model.safetensors (save_pretrained or export)")
    imp.add_argument("run_dir", type=Path, help="a new run dir; gets checkpoints/0 and config.yaml")
    imp.add_argument("--config", help="a YAML file or bundled config for the non-model keys (default: shakespeare)")
    imp.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args, extra = parser.parse_known_args(argv)  # overrides may follow --config (argparse cannot intermix here)
    if extra and (args.command != "import" or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "export":
        step = export(args.run_dir, args.out_dir)
        print(f"wrote {', '.join(EXPORT_FILES)} to {args.out_dir} from step {step}")
        return
    if args.command == "import":
        cfg, implied = import_dir(args.hf_dir, args.run_dir, args.config, [*args.overrides, *extra])
        model_keys = " ".join(f"model.{k}={v}" for k, v in cfg.to_dict()["model"].items() if f"model.{k}" in implied)
        print(f"wrote step 0 of {args.run_dir} from {args.hf_dir}; sample or export it as it is, or train it "
              f"with: python -m jaxgpt.train --run-dir {args.run_dir} {model_keys} ...")
        return
    hf_cfg, tensors, fmt = _read_dir(args.hf_dir)
    overrides = fmt.model_overrides(hf_cfg)
    m = ModelConfig(**{k.removeprefix("model."): v for k, v in overrides.items()})
    fmt.check_config(hf_cfg, m, args.hf_dir / CONFIG)
    n = sum(x.size for x in fmt.to_hf(fmt.from_hf(tensors, m), m).values())
    print(f"{args.hf_dir}: {fmt.name} with {n:,} parameters; it loads as "
          + " ".join(f"{k}={v}" for k, v in overrides.items()))


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

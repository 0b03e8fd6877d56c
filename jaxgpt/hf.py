"""Hugging Face GPT-2 interop: `python -m jaxgpt.hf export RUN_DIR OUT_DIR` and `check HF_DIR`.

Our parameters (model.py) are stored so that every HF `GPT2LMHeadModel` tensor is a plain
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
vocabulary padding (model.py) is dropped on export and zero-filled on import; padded logits are
-inf, so those rows never matter. On import a longer position table than `model.seq_len` is cut
to its first T rows (positions are absolute, so a prefix is the same model on shorter contexts).
HF's causal-mask buffers (`h.i.attn.bias`, `masked_bias`) are ignored.

`export` restores the newest readable checkpoint of a run (the config stored with it decides the
shapes) onto one device and writes `model.safetensors` plus a `config.json` that
`GPT2LMHeadModel.from_pretrained` reads. `load_dir` is the way back, for initialising a run.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import load_file, save_file

from jaxgpt.checkpoint import Checkpointer, find_checkpoint_dir
from jaxgpt.cli import ArgumentParser, run_main
from jaxgpt.config import CheckpointConfig, Config, ModelConfig, sections
from jaxgpt.errors import UserError
from jaxgpt.mesh import make_mesh
from jaxgpt.step import abstract_state, make_setup

WEIGHTS, CONFIG = "model.safetensors", "config.json"
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
    t = {k.removeprefix("transformer."): v for k, v in tensors.items()
         if not re.fullmatch(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias", k)}
    layers = sorted({int(k.split(".")[1]) for k in t if re.match(r"h\.\d+\.", k)})
    if len(layers) != m.n_layer:
        raise UserError(f"the weights hold {len(layers)} layers but model.n_layer={m.n_layer}; "
                        f"set model.n_layer={len(layers)}")

    def take(name: str, shape: tuple[int, ...], hint: str = "") -> np.ndarray:
        if name not in t:
            raise UserError(f"tensor {name} is missing from the weights")
        x = t.pop(name)
        if tuple(x.shape) != shape:
            raise UserError(f"tensor {name} has shape {tuple(x.shape)} but the model config needs {shape}{hint}")
        return np.asarray(x, np.float32)

    wte = t.get("wte.weight")
    hint = "" if wte is None or wte.ndim != 2 else f" (set model.vocab_size={wte.shape[0]} model.n_embd={wte.shape[1]})"
    wte_VD = take("wte.weight", (m.vocab_size, m.n_embd), hint)
    wpe = t.get("wpe.weight")
    if wpe is not None and wpe.ndim == 2 and wpe.shape[0] > m.seq_len:
        t["wpe.weight"] = wpe[: m.seq_len]  # a shorter context: keep the first positions
    params: dict[str, Any] = {
        "wte": np.concatenate([wte_VD, np.zeros((m.padded_vocab - m.vocab_size, m.n_embd), np.float32)]),
        "wpe": take("wpe.weight", (m.seq_len, m.n_embd), f" (model.seq_len={m.seq_len} is longer than the table)"),
        "ln_f": {"scale": take("ln_f.weight", (m.n_embd,)), "bias": take("ln_f.bias", (m.n_embd,))},
        "blocks": {"ln_1": {}, "ln_2": {}, "attn": {}, "mlp": {}},
    }
    for name, ((group, key), hf_shape, our_shape) in _layer_table(m).items():
        params["blocks"][group][key] = np.stack(
            [take(f"h.{i}.{name}", hf_shape).reshape(our_shape) for i in range(m.n_layer)])
    head = t.pop("lm_head.weight", None)
    if head is not None and not np.array_equal(np.asarray(head, np.float32), wte_VD):
        raise UserError("lm_head.weight differs from wte.weight: only GPT-2's tied output head is supported")
    if t:
        raise UserError(f"unexpected tensors in the weights: {', '.join(sorted(t)[:5])}"
                        + (f" and {len(t) - 5} more" if len(t) > 5 else ""))
    return params


def hf_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """A config.json that transformers.GPT2Config reads as this model (no dropout, as we train)."""
    m = model_cfg
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_positions": m.seq_len, "n_embd": m.n_embd, "n_layer": m.n_layer, "n_head": m.n_head,
            "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True,
            "bos_token_id": EOT, "eos_token_id": EOT, "torch_dtype": "float32"}


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
    if hf_cfg.get("model_type", "gpt2") != "gpt2":
        raise UserError(f"{source} describes a {hf_cfg['model_type']!r} model, not GPT-2")
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


def _read_dir(hf_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    hf_dir = Path(hf_dir)
    if not (hf_dir / CONFIG).is_file():
        raise UserError(f"{hf_dir} holds no {CONFIG}; give a directory written by save_pretrained or jaxgpt.hf export")
    try:
        hf_cfg = json.loads((hf_dir / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{hf_dir / CONFIG} is not valid JSON: {e}") from None
    index = hf_dir / f"{WEIGHTS}.index.json"  # save_pretrained shards files over 5 GB
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [WEIGHTS]
    tensors = {}
    for name in files:
        if not (hf_dir / name).is_file():
            raise UserError(f"{hf_dir} holds no {name} (only safetensors weights are read, not pytorch_model.bin)")
        try:
            tensors |= load_file(hf_dir / name)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise UserError(f"{hf_dir / name} cannot be read as safetensors ({e})") from None
    return hf_cfg, tensors


def load_dir(hf_dir: Path, model_cfg: ModelConfig) -> dict:
    """config.json + model.safetensors (as from_pretrained/export write them) -> our params, checked."""
    hf_cfg, tensors = _read_dir(hf_dir)
    _check_config(hf_cfg, model_cfg, Path(hf_dir) / CONFIG)
    return from_hf(tensors, model_cfg)


def _config_from_dict(d: dict[str, Any]) -> Config:
    return Config(**{s: cls(**{k: v for k, v in d.get(s, {}).items() if k in cls.__dataclass_fields__})
                     for s, cls in sections().items()})


def restore_params(run_dir_or_ckpt: Path) -> tuple[dict, Config, int]:
    """(params on one device, the run's config, step) of the newest readable checkpoint."""
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
        mesh = make_mesh({"dp": 1, "fsdp": 1, "tp": 1}, jax.devices()[:1])
        with jax.set_mesh(mesh):
            setup = make_setup(cfg, mesh)
            restored = ckpt.restore_latest(abstract_state(cfg, setup), params_only=True)  # skips damaged steps
    finally:
        ckpt.close()
    return restored.state.params, cfg, restored.step


def export(run_dir_or_ckpt: Path, out_dir: Path) -> int:
    """Writes OUT_DIR/model.safetensors and config.json from a run's newest checkpoint; returns its step."""
    params, cfg, step = restore_params(run_dir_or_ckpt)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers refuses safetensors files without a "format" entry in their metadata.
    save_file(to_hf(params, cfg.model), out_dir / WEIGHTS, metadata={"format": "pt"})
    (out_dir / CONFIG).write_text(json.dumps(hf_config(cfg.model), indent=2) + "\n")
    return step


def _main(argv: Sequence[str] | None) -> None:
    parser = ArgumentParser(prog="python -m jaxgpt.hf", description="Hugging Face GPT-2 export and import.")
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("export", help="write a run's newest checkpoint as an HF GPT-2 directory")
    ex.add_argument("run_dir", type=Path, help="a run dir or its checkpoints dir")
    ex.add_argument("out_dir", type=Path, help="gets model.safetensors and config.json")
    check = commands.add_parser("check", help="load an HF GPT-2 directory and print its size")
    check.add_argument("hf_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "export":
        step = export(args.run_dir, args.out_dir)
        print(f"wrote {args.out_dir / WEIGHTS} and {args.out_dir / CONFIG} from step {step}")
        return
    hf_cfg, tensors = _read_dir(args.hf_dir)
    overrides = model_overrides(hf_cfg)
    m = ModelConfig(**{k.removeprefix("model."): v for k, v in overrides.items()})
    _check_config(hf_cfg, m, args.hf_dir / CONFIG)
    n = sum(x.size for x in to_hf(from_hf(tensors, m), m).values())
    print(f"{args.hf_dir}: GPT-2 with {n:,} parameters; it loads as "
          + " ".join(f"{k}={v}" for k, v in overrides.items()))


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

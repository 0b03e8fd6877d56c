"""python -m jaxgpt.hf: `export RUN_DIR OUT_DIR`, `import HF_DIR RUN_DIR`, `check HF_DIR` (convert.py does the work)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from jaxgpt.cli import ArgumentParser, path_arg, run_main
from jaxgpt.hf.convert import EXPORT_FILES, check_dir, export, import_dir


def _main(argv: Sequence[str] | None) -> None:
    parser = ArgumentParser(prog="python -m jaxgpt.hf", description="Hugging Face GPT-2, Llama, Qwen3, Mixtral and Qwen3-MoE export and import.")
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("export", help="write a run's newest checkpoint as an HF GPT-2, Llama, Qwen3, Mixtral or Qwen3-MoE directory")
    ex.add_argument("run_dir", type=path_arg, help="a run dir or its checkpoints dir")
    ex.add_argument("out_dir", type=path_arg, help="gets the weights, config.json, generation_config.json and tokenizer")
    check = commands.add_parser("check", help="load an HF GPT-2, Llama, Qwen3, Mixtral or Qwen3-MoE directory and print its size")
    check.add_argument("hf_dir", type=path_arg)
    imp = commands.add_parser("import", help="turn an HF GPT-2, Llama, Qwen3, Mixtral or Qwen3-MoE directory into a jaxgpt run dir "
                                             "(a step-0 checkpoint)")
    imp.add_argument("hf_dir", type=path_arg, help="config.json + model.safetensors (save_pretrained or export)")
    imp.add_argument("run_dir", type=path_arg, help="a new run dir; gets checkpoints/0 and config.yaml")
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
        values = cfg.to_dict()
        model_keys = " ".join(f"{key}={shlex.quote(str(values[key.split('.')[0]][key.split('.')[1]]))}"
                              for key in implied)
        print(f"wrote step 0 of {args.run_dir} from {args.hf_dir}; sample or export it as it is, or train it "
              f"(adding your data.* and train.* settings) with:\n"
              f"  python -m jaxgpt.train --run-dir {shlex.quote(str(args.run_dir))} {model_keys}")
        return
    name, n, overrides = check_dir(args.hf_dir)
    print(f"{args.hf_dir}: {name} with {n:,} parameters; it loads as " + " ".join(f"{k}={v}" for k, v in overrides.items()))


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)

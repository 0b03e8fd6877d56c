"""`python -m jaxgpt.evaluate RUN_DIR --task [NAME=]PATH [--task [NAME=]PATH ...] [options]`: task accuracy of a checkpoint.

Restores the newest readable checkpoint of a run (or a checkpoints dir), places its parameters on
a mesh of all devices (`--mesh`, default every device on dp, sharded as in training by
`sample.shard_params`) and scores each task file (tasks.py: formats; score.py: protocol, batching).
The task files are read and checked before any parameter is read. Prints one line per task, or
with `--json` one JSON object with the metrics.jsonl field names (`task/NAME/acc`,
`task/NAME/acc_norm`) plus `step` and, per task, `task/NAME/examples`. The same scores appear in
a training run's eval rows when the run sets `eval.tasks`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from jaxgpt.cli import ArgumentParser, path_arg, run_main
from jaxgpt.config import Config
from jaxgpt.errors import UserError
from jaxgpt import tokenizer


def _main(argv: Sequence[str] | None) -> None:
    from jaxgpt.evaluate.score import Scorer
    from jaxgpt.evaluate.tasks import load_task, parse_spec
    from jaxgpt.hf import restore_params  # the newest readable checkpoint on one device
    from jaxgpt.sample import shard_params
    from jaxgpt.lowering import choose
    from jaxgpt.step import abstract_model

    parser = ArgumentParser(prog="python -m jaxgpt.evaluate", description="Score multiple-choice tasks with a checkpoint.")
    parser.add_argument("run", type=path_arg, help="a run dir or its checkpoints dir (the newest checkpoint is used)")
    parser.add_argument("--task", action="append", required=True, metavar="[NAME=]PATH",
                        help="a HellaSwag JSONL file or a {context, choices, label} JSONL file, named NAME in "
                             "the output (default: the file name without its extension); repeatable")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N examples of each task (0 = all)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per batch, rounded up to a multiple "
                                                                    "of the mesh's batch devices (default 32)")
    parser.add_argument("--mesh", default="dp=-1", help="shard over this mesh, e.g. dp=8 or tp=2 (default: every "
                                                        "device on dp)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line per task")
    args = parser.parse_args(argv)
    if args.limit < 0:
        raise UserError(f"--limit must be >= 0, got {args.limit}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be > 0, got {args.batch_size}")
    specs = parse_spec(",".join(args.task), "--task")  # every --task at once: a name given twice is one error
    tasks = []

    def read_tasks(cfg: Config) -> None:  # before any parameter is read
        tok = tokenizer.of_run(args.run, cfg.data.tokenizer)  # what the run was trained with
        tokenizer.check_fits_model(tok, cfg.model.vocab_size)
        tasks.extend(load_task(name, path, cfg.model.seq_len, args.limit, tok) for name, path in specs)

    params, cfg, step = restore_params(args.run, check=read_tasks)
    params, mesh = shard_params(params, cfg, args.mesh, command="evaluation")
    scorer = Scorer(abstract_model(cfg, choose(cfg.model, mesh))[0], cfg.model, mesh, args.batch_size)
    record: dict = {"step": step}
    for task in tasks:
        scores = scorer.score(params, task, progress=True)
        record.update(scores.fields())
        record[f"task/{task.name}/examples"] = scores.examples
        if not args.json:
            print(f"{task.name}: acc {scores.acc:.4f} | acc_norm {scores.acc_norm:.4f} | {scores.examples} examples "
                  f"| {scores.seconds:.1f} s, compiling included (step {step}, {task.path})", flush=True)
    if args.json:
        print(json.dumps(record))


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)

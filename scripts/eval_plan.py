"""The task scorer's program compiled for a GPU this machine lacks: memory and predicted examples/s.

    python scripts/eval_plan.py --target h100 --config gpt2-124m [--rows 64] [--length 128] [key=value ...]

Compiles `jaxgpt.evaluate.score.Scorer`'s batch program (rows x length, one length bucket) with
XLA:GPU for one compile-only GPU, as `python -m jaxgpt.plan --target` does for the train step
(needs `pip install -e ".[gpu-compile]"`), and prints XLA's memory analysis and the step-time
model's prediction (jaxgpt/gpu/cost.py). HellaSwag after lm-eval-harness's preprocessing is ~60
tokens per (context, ending), so its rows fall in the 64 bucket; examples/s assumes 4 choices each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--config", default="gpt2-124m")
    parser.add_argument("--rows", type=int, default=64, help="sequences per batch")
    parser.add_argument("--length", type=int, default=64, help="the length bucket (padded positions)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from jaxgpt.plan import _target_devices, memory_analysis
    devices = _target_devices(args.target, 1)

    import jax
    import numpy as np

    from jaxgpt.config import load_config, validate
    from jaxgpt.evaluate.score import Scorer
    from jaxgpt.gpu import cost, perf
    from jaxgpt.gpu import target as gpu_target
    from jaxgpt.metrics import flops_per_token
    from jaxgpt.parallel.mesh import make_mesh
    from jaxgpt.step import abstract_state, make_setup

    cfg = load_config(args.config, args.overrides)
    mesh = make_mesh(validate(cfg, 1), devices)
    with gpu_target.compiling_for(devices, args.target):
        setup = make_setup(cfg, mesh)
        params = abstract_state(cfg, setup).params
        scorer = Scorer(setup.graphdef, cfg.model, mesh, args.rows)
        tokens = jax.ShapeDtypeStruct((scorer.rows, args.length), np.int32, sharding=scorer.batch_sharding)
        mask = jax.ShapeDtypeStruct((scorer.rows, args.length), np.bool_, sharding=scorer.batch_sharding)
        with jax.set_mesh(mesh):
            compiled = scorer.step.lower(params, tokens, tokens, mask).compile(gpu_target.DEVICELESS_OPTIONS)
        dtype = setup.ops.dtype
    text = compiled.as_text()
    # forward only: a third of the train step's 6N + attention FLOPs per token
    est = cost.estimate(text, perf.perf(args.target), 1, scorer.rows * args.length, flops_per_token(cfg.model) / 3)
    seconds = est["step_seconds"]
    print(cost.format_estimate(est))
    print(json.dumps({"config": args.config, "target": args.target, "compute_dtype": dtype, "rows": scorer.rows,
                      "length": args.length, "memory_mib": {k: round(v / 2**20, 1) for k, v in
                                                            memory_analysis(compiled).items()},
                      "predicted_ms_per_batch": round(1e3 * seconds, 3),
                      "predicted_sequences_per_sec": round(scorer.rows / seconds),
                      "predicted_examples_per_sec_4_choices": round(scorer.rows / 4 / seconds),
                      "predicted_mfu": est["mfu"]}))


if __name__ == "__main__":
    main()

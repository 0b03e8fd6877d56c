"""Task scoring throughput: examples/s of jaxgpt.evaluate on HellaSwag-shaped examples.

    python scripts/eval_bench.py [--config NAME] [--examples 200] [--batch-size 16] [--mesh dp=1] [key=value ...]

No HellaSwag file is needed (nothing is downloaded): each example is a context of --context-tokens
and 4 endings of --ending-tokens taken from the bundled shakespeare text, the shape of HellaSwag's
validation set (about 40 context and 20 ending tokens after lm-eval-harness's preprocessing).
The model is the config's, randomly initialised (speed does not depend on the weights). The first
pass compiles the bucket programs and is reported apart; the timed passes reuse them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--context-tokens", type=int, default=40)
    parser.add_argument("--ending-tokens", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--mesh", default="dp=1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import jax
    from flax import nnx

    from jaxgpt import data
    from jaxgpt.config import load_config
    from jaxgpt.evaluate.score import Scorer
    from jaxgpt.evaluate.tasks import Task
    from jaxgpt.model import GPT
    from jaxgpt.sample import shard_params
    from jaxgpt.step import abstract_model

    cfg = load_config(args.config, args.overrides)
    tokens = np.asarray(data.load_split(data.resolve_data_dir("shakespeare"), "val"))
    rng = np.random.default_rng(0)
    C, E = args.context_tokens, args.ending_tokens
    starts = rng.integers(0, len(tokens) - C - E, size=(args.examples, 4))
    seqs = [[tokens[s: s + C + E].astype(np.int32)[-(cfg.model.seq_len + 1):] for s in row] for row in starts]
    task = Task("bench", Path("synthetic"), seqs, [[E] * 4] * args.examples, [[4 * E] * 4] * args.examples,
                np.zeros(args.examples, np.int64))
    params = nnx.to_pure_dict(nnx.split(GPT(cfg.model, nnx.Rngs(0)), nnx.Param)[1])
    params, mesh = shard_params(params, cfg, args.mesh, command="the benchmark")
    scorer = Scorer(abstract_model(cfg)[0], cfg.model, mesh, args.batch_size)
    first = scorer.score(params, task).seconds
    times = [scorer.score(params, task).seconds for _ in range(args.repeats)]
    median = statistics.median(times)
    print(json.dumps({"config": args.config or "shakespeare", "devices": mesh.devices.size, "mesh": args.mesh,
                      "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
                      "examples": args.examples, "choices": 4, "context_tokens": C, "ending_tokens": E,
                      "batch_rows": scorer.rows, "first_pass_s": round(first, 2), "median_s": round(median, 3),
                      "examples_per_sec": round(args.examples / median, 1),
                      "sequences_per_sec": round(4 * args.examples / median, 1)}))


if __name__ == "__main__":
    main()

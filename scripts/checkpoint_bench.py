"""How long does one checkpoint save block the training loop, async versus sync?

    python scripts/checkpoint_bench.py --config shakespeare --repeats 3
    python scripts/checkpoint_bench.py --config gpt2-124m --repeats 3

For the config's full train state (parameters + AdamW moments + step) on this host's devices, it
times `Checkpointer.save` returning (what the loop waits for) with async saves on and off, and the
time until an async save is committed. Prints one JSON object and a markdown table row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

from jaxgpt.checkpoint import Checkpointer
from jaxgpt.config import CheckpointConfig, load_config, validate
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.step import init_state, make_setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="shakespeare")
    parser.add_argument("--mesh", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(args.config, [], args.mesh)
    mesh = make_mesh(validate(cfg, jax.device_count()))
    with jax.set_mesh(mesh):
        state = init_state(cfg, make_setup(cfg, mesh))
    jax.block_until_ready(state)
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    result = {"config": args.config, "state_bytes": n_bytes, "devices": jax.device_count(),
              "device_kind": jax.devices()[0].device_kind}
    for mode in ("async", "sync"):
        blocked, committed = [], []
        with tempfile.TemporaryDirectory() as d:
            ckpt = Checkpointer(Path(d), CheckpointConfig(async_save=mode == "async", keep=2))
            for i in range(args.repeats + 1):  # the first save also sets up Orbax: not counted
                t0 = time.perf_counter()
                ckpt.save(i, state, {"next_index": i}, cfg)
                t1 = time.perf_counter()
                ckpt.wait()
                t2 = time.perf_counter()
                if i:
                    blocked.append(t1 - t0)
                    committed.append(t2 - t0)
            ckpt.close()
        result[f"{mode}_blocking_s"] = statistics.median(blocked)
        result[f"{mode}_committed_s"] = statistics.median(committed)
    print(json.dumps(result))
    print(f"| {args.config} | {n_bytes / 2**20:,.0f} MiB | {result['async_blocking_s']:.3f} s | "
          f"{result['async_committed_s']:.3f} s | {result['sync_blocking_s']:.3f} s |")


if __name__ == "__main__":
    main()

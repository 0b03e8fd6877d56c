"""Collective bandwidth over the mesh, reported like nccl-tests: is this interconnect fast enough?

    python scripts/comm_bench.py                         # every device on one axis, 1 KiB .. 1 GiB
    python scripts/comm_bench.py --max-bytes 64M --iters 5
    ./launch_multihost.sh --local 2 -- ...               # (train args only; run this script per host
                                                         #  with the same env vars for multi-host)

For all-reduce, all-gather, reduce-scatter and all-to-all over all devices it times the collective
on buffers from --min-bytes to --max-bytes (doubling x4) and prints, per size, the time, the
algorithm bandwidth (bytes / time) and the bus bandwidth, which nccl-tests defines so that it is
comparable with the hardware link speed whatever the device count n:

    all-reduce        busbw = algbw * 2(n-1)/n
    all-gather        busbw = algbw * (n-1)/n      (bytes = the gathered output)
    reduce-scatter    busbw = algbw * (n-1)/n      (bytes = the input)
    all-to-all        busbw = algbw * (n-1)/n

Compare busbw with the links: ~25 GB/s PCIe 4 x16, ~50 GB/s PCIe 5 x16, ~450 GB/s per direction
NVLink 4 (H100/H200 SXM), ~50 GB/s 400 Gb/s InfiniBand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgpt.parallel import distributed

KINDS = {
    # name: (collective inside shard_map, bus-bandwidth factor as a function of n)
    "all-reduce": (lambda x: jax.lax.psum(x, "x"), lambda n: 2 * (n - 1) / n),
    "all-gather": (lambda x: jax.lax.all_gather(x, "x", tiled=True), lambda n: (n - 1) / n),
    "reduce-scatter": (lambda x: jax.lax.psum_scatter(x, "x", tiled=True), lambda n: (n - 1) / n),
    "all-to-all": (lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True), lambda n: (n - 1) / n),
}


def _parse_size(s: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


def bench(kind: str, nbytes: int, mesh, iters: int) -> dict:
    n = mesh.size
    fn, factor = KINDS[kind]
    # per-device input size: all-gather's nbytes is the gathered output, the others' the input
    per_device = nbytes // n if kind == "all-gather" else nbytes
    elems = max(per_device // 4 // n * n, n)  # divisible by n for scatter / all-to-all
    sharding = NamedSharding(mesh, P("x"))
    x = jax.device_put(jnp.ones((n * elems,), jnp.float32), sharding)
    step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    jax.block_until_ready(step(x))  # compile + warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(x))
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    size = elems * 4 * (n if kind == "all-gather" else 1)
    algbw = size / t / 1e9
    return {"kind": kind, "bytes": size, "time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor(n)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", default="1K")
    parser.add_argument("--max-bytes", default="1G")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    distributed.initialize()
    devices = distributed.ordered_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    main_process = jax.process_index() == 0
    if main_process:
        print(f"# {len(devices)} x {devices[0].device_kind} over {jax.process_count()} process(es)")
        print(f"# {'collective':>15} {'bytes':>12} {'time (us)':>12} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    results = []
    for kind in args.kinds.split(","):
        nbytes = _parse_size(args.min_bytes)
        while nbytes <= _parse_size(args.max_bytes):
            r = bench(kind, nbytes, mesh, args.iters)
            results.append(r)
            if main_process:
                print(f"  {kind:>15} {r['bytes']:>12,} {r['time_us']:>12.1f} {r['algbw_GBps']:>11.2f} "
                      f"{r['busbw_GBps']:>11.2f}", flush=True)
            nbytes *= 4
    if args.json and main_process:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

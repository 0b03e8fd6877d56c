"""The step-time model's collectives against published nccl-tests figures for H100 nodes (issue 42).

    python scripts/collective_check.py                 # --target h100 (h200: the same link constants)
    python scripts/collective_check.py --json

For each published figure (PUBLISHED: op, GPUs, nodes, message size, bus bandwidth, its source in
SOURCES) this writes the one collective as HLO, with the replica group laid out over nodes of 8 GPUs
as a deviceless compile numbers them, and costs it with jaxgpt.gpu.cost.estimate: the code the
model runs on a compiled step (wire bytes, NVLink or network by where the group lives, latency per
ring step, launch), not a re-implementation. Time and bus bandwidth convert with nccl-tests' own
definitions (its doc/PERFORMANCE.md), where size is the buffer nccl-tests prints (all-gather: the
gathered output; reduce-scatter: the input):

    algbw = size / time
    all-reduce                               busbw = algbw * 2(n-1)/n
    all-gather, reduce-scatter, all-to-all   busbw = algbw * (n-1)/n

The error is the model's time over the published time, minus one: negative where the model is
optimistic (predicts the collective faster than published), positive where it is pessimistic.

The published figures are large-message plateaus that NVIDIA's NCCL maintainers state in NCCL's
and nccl-tests' issue threads (no H100 or H200 nccl-tests table with per-size rows from NVIDIA
itself, nor a small-message figure, was found: see docs/benchmarks.md, "Collectives: the step-time
model against published nccl-tests figures (issue 42)"), and one user-reported multi-node figure.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from jaxgpt.gpu import cost, perf

GPUS_PER_NODE = 8

SOURCES = {
    "nccl-tests#212": ("H100 all reduce performance is poor (NVIDIA/nccl-tests issue 212, sjeaugey, NVIDIA, "
                       "2024-05-06)", "https://github.com/NVIDIA/nccl-tests/issues/212"),
    "nccl-tests#290": ("Single-node and multi-node performance of H100 nodes (NVIDIA/nccl-tests issue 290, "
                       "AddyLaddy, NVIDIA, 2025-03-03)", "https://github.com/NVIDIA/nccl-tests/issues/290"),
    "nccl-tests#267": ("how overall throughout calculate about all2all (NVIDIA/nccl-tests issue 267, sjeaugey "
                       "and AddyLaddy, NVIDIA, 2024-11-19 / 2025-01-23)", "https://github.com/NVIDIA/nccl-tests/issues/267"),
    "nccl#1218": ("Why all_gather_perf only achieves 200GBps bandwidth for 2G message size for 32 (256 GPUS) H100 "
                  "nodes (NVIDIA/nccl issue 1218, a user's report, 2024-03-12)", "https://github.com/NVIDIA/nccl/issues/1218"),
}

GiB = 1 << 30
# op, GPUs, nodes, nccl-tests size (bytes), published busbw (GB/s): (low, high), source, what it is
PUBLISHED = [
    ("all-reduce", 8, 1, 4 * GiB, (480, 480), "nccl-tests#212",
     "8 GPUs, NCCL's default (NVLink SHARP): 'a peak busBw of ~480GB/s (algbw ~275GB/s)' at large sizes"),
    ("all-reduce", 8, 1, 4 * GiB, (476, 476), "nccl-tests#290",
     "8 GPUs, default algorithm, 128 MiB-4 GiB sweep: 476 GB/s, 'in the expected range for H100'"),
    ("all-reduce", 8, 1, 4 * GiB, (370, 370), "nccl-tests#212",
     "8 GPUs, NCCL_ALGO=RING: 'an effective NVLink bandwidth of 370GB/s' (450 GB/s line rate, ~20% protocol)"),
    ("all-gather", 8, 1, 4 * GiB, (370, 370), "nccl-tests#212",
     "8 GPUs: the same 370 GB/s busbw 'when running non-allreduce operations'"),
    ("reduce-scatter", 8, 1, 4 * GiB, (370, 370), "nccl-tests#212",
     "8 GPUs: the same 370 GB/s busbw 'when running non-allreduce operations'"),
    ("all-reduce", 2, 2, 4 * GiB, (46, 48), "nccl-tests#290",
     "one GPU in each of 2 nodes, ring over one NDR 400 Gb/s NIC: '46-48GB/s per NIC'"),
    ("all-to-all", 16, 2, 4 * GiB, (48, 49), "nccl-tests#267",
     "2+ nodes of 8: 'Alltoall cannot aggregate the bandwidth of multiple NICs': one CX-7 NDR NIC, "
     "'up to 48-49GB/s'"),
    ("all-gather", 256, 32, 2 * GiB, (200, 200), "nccl#1218",
     "32 nodes of 8 H100, 8 x 400 Gb/s each: 200 GB/s busbw at 2 GB, a user's measurement they call low"),
]


def _factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw."""
    return 2 * (n - 1) / n if op == "all-reduce" else (n - 1) / n


def collective_hlo(op: str, nbytes: int, gpus: int, nodes: int) -> tuple[str, int]:
    """One f32 collective over `gpus` GPUs spread evenly over `nodes` nodes of GPUS_PER_NODE (the
    first GPUs of each), as HLO text, and the device count of those nodes."""
    per_node = gpus // nodes
    group = [node * GPUS_PER_NODE + i for node in range(nodes) for i in range(per_node)]
    groups = "replica_groups={{" + ",".join(map(str, group)) + "}}"
    full, shard = nbytes // 4, nbytes // 4 // gpus
    operand, result, attrs = {
        "all-reduce": (full, full, "to_apply=%sum"),
        "all-gather": (shard, full, "dimensions={0}"),
        "reduce-scatter": (full, shard, "dimensions={0}, to_apply=%sum"),
        "all-to-all": (full, full, "dimensions={0}"),
    }[op]
    text = (f"ENTRY %main (x: f32[{operand}]) -> f32[{result}] {{\n"
            f"  %x = f32[{operand}]{{0}} parameter(0)\n"
            f"  ROOT %c = f32[{result}]{{0}} {op}(%x), {groups}, {attrs}\n}}\n")
    return text, nodes * GPUS_PER_NODE


def predicted_seconds(op: str, nbytes: int, gpus: int, nodes: int, target: str = "h100") -> float:
    """The step-time model's time for this one collective (jaxgpt/gpu/cost.py, launch included)."""
    text, n_devices = collective_hlo(op, nbytes, gpus, nodes)
    return cost.estimate(text, perf.perf(target, GPUS_PER_NODE), n_devices)["step_seconds"]


def table(target: str = "h100") -> list[dict[str, Any]]:
    """One row per published figure: published and predicted busbw and time, and the time error
    (predicted / published - 1) at the published range's ends."""
    rows = []
    for op, gpus, nodes, nbytes, (low, high), source, what in PUBLISHED:
        seconds = predicted_seconds(op, nbytes, gpus, nodes, target)
        bus = nbytes * _factor(op, gpus)  # bytes x factor: busbw = bus / time
        rows.append({"op": op, "gpus": gpus, "nodes": nodes, "bytes": nbytes, "source": source, "what": what,
                     "published_busbw": (low, high), "predicted_busbw": bus / seconds / 1e9,
                     "published_ms": (1e3 * bus / (high * 1e9), 1e3 * bus / (low * 1e9)),
                     "predicted_ms": 1e3 * seconds,
                     "error": (seconds * low * 1e9 / bus - 1, seconds * high * 1e9 / bus - 1)})
    return rows


def _span(pair: tuple[float, float], fmt: str) -> str:
    return format(pair[0], fmt) if pair[0] == pair[1] else f"{pair[0]:{fmt}}-{pair[1]:{fmt}}"


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'op':<15}{'GPUs':>5}{'nodes':>6}{'size':>8}{'published busbw':>17}{'predicted':>11}"
             f"{'published ms':>14}{'predicted':>11}{'time error':>13}  source"]
    for r in rows:
        error = "/".join(f"{100 * e:+.0f}%" for e in sorted(set(r["error"])))
        lines.append(f"{r['op']:<15}{r['gpus']:>5}{r['nodes']:>6}{r['bytes'] / GiB:>6.0f}Gi"
                     f"{_span(r['published_busbw'], '.0f'):>14} GB/s{r['predicted_busbw']:>6.0f} GB/s"
                     f"{_span(r['published_ms'], '.1f'):>14}{r['predicted_ms']:>11.1f}{error:>13}  {r['source']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", choices=sorted(perf.gpu_target.TARGETS), default="h100")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = table(args.target)
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    if not args.json:
        print("\nsources:")
        for key, (title, url) in SOURCES.items():
            print(f"  {key}: {title}, {url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What an H100 or H200 does per second, for the step-time model (jaxgpt/gpu/cost.py).

The memory bandwidth and the SM count come from the target descriptions beside this file (the
`*.txtpb` XLA compiles against), so a device is described in one place. The rest is here: dense
peaks from NVIDIA's data sheets, and the fractions of them that kernels of each kind reach in
practice. These fractions are properties of the device and its libraries (cuBLAS, cuDNN, XLA's
emitters), the same for every model and config, so they are not fitted per config. They were
first set against four step times measured on one H100 (2026-11-23), then refit per kernel group
against profiles of gpt2-124m and gpt2-1.3b on an H100 and an H200 (2026-11-26;
docs/benchmarks.md, "Step-time model").

cuDNN flash attention's efficiency depends on the head dimension: each K/V tile loaded feeds
2 x D FLOPs per score, so at D=64 the kernels spend more of their time on softmax and loads than
at D=128. The two points per direction are kernel times read from profiles on an H100 and an H200
(2026-11-26, cuDNN 9.19: gpt2-124m D=64 at T=1024, gpt2-1.3b D=128 at T=2048; the sequence
length differs too, so the line between them also carries that); between them the efficiency is
interpolated linearly, outside them it is the nearer point's.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from jaxgpt.gpu import target as gpu_target


class Perf(NamedTuple):
    name: str
    peak_flops: float        # dense bf16 tensor-core FLOP/s (fp8: twice this)
    hbm_bytes_per_s: float   # from the target description
    sms: int                 # from the target description
    gemm_efficiency: float   # of peak_flops, for a large bf16 GEMM (cuBLAS / autotuned Triton)
    gemm_tile: tuple[int, int, int]  # M x N output tile and K step of one stream-K work unit (waves)
    attention_forward_efficiency: tuple[tuple[int, float], ...]   # (head dim, of peak_flops), cuDNN forward
    attention_backward_efficiency: tuple[tuple[int, float], ...]  # the same backward (2.5x the forward FLOPs)
    hbm_efficiency: float    # of hbm_bytes_per_s, what a streaming kernel (fusion, copy) reaches
    launch_seconds: float    # per kernel: launch, ramp-up and tail of a small grid
    link_bytes_per_s: float  # one direction, per device, for collectives (NVLink 4)
    # Between nodes (collectives whose replica groups span nodes; jaxgpt/gpu/cost.py). The defaults
    # describe a DGX/HGX H100 or H200 node: 8 GPUs, one 400 Gb/s InfiniBand NDR or RoCE NIC per GPU
    # (50 GB/s one direction), and per ring step the latency of one hop: ~1 us over NVSwitch, ~5 us
    # through a NIC and a switch. From the data sheets; against the large-message busbw NCCL's
    # maintainers publish for H100 nodes (scripts/collective_check.py, docs/benchmarks.md
    # "Collectives: ...") the time is within -18%..+7% inside a node and -8%..-2% over one NIC per
    # GPU; a ring over k GPUs of each node drives k NICs (cost.ring_nics), 38% optimistic against a
    # user's 256-GPU all-gather its author calls low. The latencies are unchecked.
    gpus_per_node: int = 8
    network_bytes_per_s: float = 50e9
    link_latency_seconds: float = 0.0
    network_latency_seconds: float = 0.0


_COMMON = dict(peak_flops=989e12, gemm_efficiency=0.75, gemm_tile=(128, 256, 64),
               attention_forward_efficiency=((64, 0.35), (128, 0.45)),
               attention_backward_efficiency=((64, 0.19), (128, 0.31)),
               launch_seconds=4e-6, link_bytes_per_s=450e9, link_latency_seconds=1e-6, network_latency_seconds=5e-6)

# What the fusions, copies and the loss's reductions reach of the data-sheet bandwidth, read from
# the profiles of 2026-11-26 (their measured group times against the bytes costed here). The
# H200's extra bandwidth mostly does not show: its memory-bound kernels ran only ~10% faster
# than the H100's, not the 43% of 4.8 against 3.35 TB/s.
_HBM_EFFICIENCY = {"h100": 0.78, "h200": 0.62}


def perf(target: str, gpus_per_node: int = 8) -> Perf:
    """The constants for --target NAME ('h100' or 'h200'), in nodes of gpus_per_node GPUs."""
    text = gpu_target.description(target)
    bandwidth = int(re.search(r"memory_bandwidth:\s*(\d+)", text).group(1))
    sms = int(re.search(r"core_count:\s*(\d+)", text).group(1))
    return Perf(name=gpu_target.TARGETS[target][1], hbm_bytes_per_s=bandwidth, sms=sms,
                hbm_efficiency=_HBM_EFFICIENCY[target], gpus_per_node=gpus_per_node, **_COMMON)


def attention_efficiency(points: tuple[tuple[int, float], ...], head_dim: int) -> float:
    """The efficiency at head_dim: linear between the (head dim, efficiency) points, which are in
    ascending order, and the nearer end's outside them."""
    (d0, e0), *rest = points
    if head_dim <= d0:
        return e0
    for d1, e1 in rest:
        if head_dim <= d1:
            return e0 + (e1 - e0) * (head_dim - d0) / (d1 - d0)
        d0, e0 = d1, e1
    return e0

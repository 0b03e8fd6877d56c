"""What an H100 or H200 does per second, for the step-time model (jaxgpt/gpu/cost.py).

The memory bandwidth and the SM count come from the target descriptions beside this file (the
`*.txtpb` XLA compiles against), so a device is described in one place. The rest is here: dense
peaks from NVIDIA's data sheets, and the fractions of them that kernels of each kind reach in
practice. These fractions are properties of the device and its libraries (cuBLAS, cuDNN, XLA's
emitters), the same for every model and config, so they are not fitted per config; they were set
once against the four step times measured on one H100 (docs/benchmarks.md, "Step-time model").
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
    attention_forward_efficiency: float   # of peak_flops, cuDNN flash attention forward
    attention_backward_efficiency: float  # cuDNN flash attention backward (2.5x the forward FLOPs)
    hbm_efficiency: float    # of hbm_bytes_per_s, what a streaming kernel (fusion, copy) reaches
    launch_seconds: float    # per kernel: launch, ramp-up and tail of a small grid
    link_bytes_per_s: float  # one direction, per device, for collectives (NVLink 4)


_COMMON = dict(peak_flops=989e12, gemm_efficiency=0.75, gemm_tile=(128, 256, 64),
               attention_forward_efficiency=0.50, attention_backward_efficiency=0.40,
               hbm_efficiency=0.85, launch_seconds=4e-6, link_bytes_per_s=450e9)


def perf(target: str) -> Perf:
    """The constants for --target NAME ('h100' or 'h200')."""
    text = gpu_target.description(target)
    bandwidth = int(re.search(r"memory_bandwidth:\s*(\d+)", text).group(1))
    sms = int(re.search(r"core_count:\s*(\d+)", text).group(1))
    return Perf(name=gpu_target.TARGETS[target][1], hbm_bytes_per_s=bandwidth, sms=sms, **_COMMON)

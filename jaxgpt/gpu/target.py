"""Compile-only NVIDIA GPUs: the H100 and H200 as XLA:GPU sees them, with no GPU in the machine.

With the CUDA plugin installed (`pip install -e ".[gpu-compile]"`: jax-cuda12-plugin and
jax-cuda12-pjrt, no driver, no GPU, no CUDA wheels) JAX can describe a GPU topology from a
target description (`*.txtpb` beside this file: XLA's `GpuTargetConfigProto`, the device's SMs,
compute capability, bandwidth, memory and cuDNN version):

    devices = compile_only_devices("h100", 8)     # 8 "NVIDIA H100 80GB HBM3" that exist on paper
    with compiling_for(devices):                   # kernel and dtype choices follow the target
        jax.jit(f, in_shardings=...).lower(*shape_dtype_structs).compile()

The compiled executable cannot run, but its HLO, `memory_analysis()` and `cost_analysis()` are
XLA:GPU's own: cuDNN fused attention, fp8 GEMM rewrites, the collectives XLA:GPU picks. Traps:

- JAX must be on the CPU platform (`JAX_PLATFORMS=cpu`): the plugin would otherwise look for a
  driver. Nothing may run eagerly on these devices; everything is built from shapes.
- Choices that read "the device" (`model.dtype=auto`, `model.attention=auto`) would read the CPU.
  `compiling_for` makes `target_device()` return the compile-only GPU while it is active.
- cuDNN attention asks the installed cuDNN library for its version at trace time and refuses to
  trace without one. cuDNN is a 600+ MiB wheel that cannot run here anyway, so while compiling
  for a target `compiling_for` answers that question with the target's own cuDNN version (its
  `dnn_version_info`), which is what a real H100 with that cuDNN would answer. If nvidia-cudnn-cu12
  is installed the real library answers instead. Likewise its packed layout (document masking)
  asks the running backend whether the GPU is a Hopper; the CPU backend would say no, so
  `compiling_for` answers with the target's compute capability.
- With no device there is no autotuning: GEMM kernel choices may differ from a real GPU's. Compile
  with DEVICELESS_OPTIONS (below; jaxgpt.plan does): the autotuner at its default level spends
  most of a small step's compile choosing tiles it cannot time. A step with fp8 GEMMs is compiled
  with FP8_OPTIONS, the cuBLASLt route a real GPU takes for them.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator, Sequence
from importlib import resources
from typing import Any

from jaxgpt.errors import UserError

# --target name -> (description file, what it is)
TARGETS = {
    "h100": ("h100_sxm.txtpb", "NVIDIA H100 SXM 80 GB"),
    "h200": ("h200.txtpb", "NVIDIA H200 141 GB"),
}
INSTALL = 'pip install -e ".[gpu-compile]"'

_TARGET: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxgpt_target_device", default=None)


def target_device():
    """The device programs are built for: a compile-only GPU inside `compiling_for`, else JAX's first."""
    import jax
    return _TARGET.get() or jax.devices()[0]


def description(target: str) -> str:
    """The target description text (GpuTargetConfigProto) for --target NAME."""
    if target not in TARGETS:
        raise UserError(f"unknown --target {target!r}; choose one of {', '.join(TARGETS)}")
    return resources.files("jaxgpt.gpu").joinpath(TARGETS[target][0]).read_text()


def device_memory_bytes(target: str) -> int:
    """The device memory the target description states (what XLA:GPU plans against)."""
    return int(re.search(r"device_memory_size:\s*(\d+)", description(target)).group(1))


def cudnn_version(target: str) -> int:
    """The target's cuDNN version as cuDNN writes it (9.10.0 -> 91000)."""
    info = re.search(r"dnn_version_info\s*\{([^}]*)\}", description(target)).group(1)
    part = {k: int(v) for k, v in re.findall(r"(major|minor|patch):\s*(\d+)", info)}
    return part.get("major", 0) * 10000 + part.get("minor", 0) * 100 + part.get("patch", 0)


def plugin_missing_reason() -> str | None:
    """None if compile-only GPUs can be made here, else one line saying what to install."""
    import jax  # noqa: F401 - first, so the plugin loads through jaxgpt/_quiet.py where that applies
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return f"compiling for a GPU without one needs the CUDA plugin: {INSTALL}"
    return None


# Compile-only GPUs cannot time kernels, so XLA:GPU's autotuner measures nothing; at its default
# level it still spends most of a small step's compile choosing Triton GEMM tiles (7.4 of 11 s for the
# tests' tiny dp=8 fp8 step). At level 0 XLA takes its default tiles: the same HLO but for the tiles in
# the GEMM fusions' backend configs, the same memory analysis and predicted step time (gpt2-124m on one
# H100: 956 ms, 43.1 GB temp, either way), sooner: the tiny step 11.6 -> 5.7 s, gpt2-124m 24 -> 21 s.
DEVICELESS_OPTIONS = {"xla_gpu_autotune_level": 0}
# A step with fp8 GEMMs is compiled with Triton GEMMs off: on a real H100 and H200 the autotuner chose
# cuBLASLt for every fp8 GEMM (144 `__cublas$lt$matmul$f8` calls in gpt2-124m's step, 2026-11-26),
# and cuBLASLt's fp8 kernels take only operands whose contracting dimension is the minor one, so
# XLA writes a transposed copy of every other operand (the dw GEMMs' activations and gradients)
# in separate kernels. A deviceless compile left to itself keeps Triton GEMM fusions, which read
# any layout: no such kernel, and a step-time prediction 16-20% short (jaxgpt/gpu/cost.py).
FP8_OPTIONS = {**DEVICELESS_OPTIONS, "xla_gpu_enable_triton_gemm": False}


def compile_only_devices(target: str, n: int) -> list:
    """n compile-only devices of --target NAME on one host (UserError if the plugin is missing)."""
    text = description(target)
    if n < 1:
        raise UserError(f"--gpus must be positive, got {n}")
    if reason := plugin_missing_reason():
        raise UserError(reason)
    import jax
    from jax.experimental import topologies
    if jax.default_backend() != "cpu":
        raise UserError("compile-only GPUs need JAX on the CPU platform: set JAX_PLATFORMS=cpu")
    topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}", target_config=text)
    return list(topology.devices)


@contextlib.contextmanager
def compiling_for(devices: Sequence, target: str) -> Iterator[None]:
    """Within: `target_device()` is devices[0] and cuDNN attention traces against the target's cuDNN."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    token = _TARGET.set(devices[0])
    real_check, real_capability = fa.check_cudnn_version, fa.check_compute_capability
    try:
        real_check()
    except RuntimeError:  # no cuDNN library here: answer with the target's version (module docstring)
        version = cudnn_version(target)
        fa.check_cudnn_version = lambda: version
    own = tuple(int(x) for x in str(devices[0].compute_capability).split("."))
    fa.check_compute_capability = lambda capability: own >= tuple(int(x) for x in capability.split("."))
    try:
        yield
    finally:
        fa.check_cudnn_version, fa.check_compute_capability = real_check, real_capability
        _TARGET.reset(token)

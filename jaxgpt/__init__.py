"""jaxgpt: GPT pretraining in JAX/Flax over data, FSDP, tensor, pipeline and expert-parallel meshes."""

import importlib.util as _util
import os as _os

__version__ = "0.1.0"

# The `gpu-compile` extra installs JAX's CUDA plugin on machines without a GPU (to compile for
# H100/H200 on paper). Left alone, JAX would then try to start CUDA and print a long "Unable to
# load CUDA" traceback before falling back to the CPU. Without an NVIDIA driver there is no GPU
# to find, so ask for the CPU directly; a real GPU host (driver present) is not affected, nor is
# an explicit JAX_PLATFORMS.
if ("JAX_PLATFORMS" not in _os.environ and not _os.path.exists("/proc/driver/nvidia/version")
        and _util.find_spec("jax_plugins.xla_cuda12") is not None):
    _os.environ["JAX_PLATFORMS"] = "cpu"

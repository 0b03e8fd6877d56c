"""jaxgpt: GPT pretraining in JAX/Flax over data, FSDP and tensor-parallel meshes."""

import importlib.util as _util
import os as _os
import sys as _sys

__version__ = "0.1.0"

# `python -m jaxgpt.COMMAND` (argv[0] is "-m" while the package is imported to find the module): a
# Ctrl-C that lands while the command is still importing (JAX takes a second or two), before any
# handler of its own, is one line and exit 130 as later on (jaxgpt/cli.py), not a traceback
# through the import machinery. Programs that import jaxgpt keep their own hook.
if _sys.argv[:1] == ["-m"]:
    def _interrupted(kind, value, tb, _default=_sys.excepthook):
        if not issubclass(kind, KeyboardInterrupt):
            return _default(kind, value, tb)
        from jaxgpt.cli import exit_interrupted

        exit_interrupted()

    _sys.excepthook = _interrupted

from jaxgpt import _quiet  # noqa: E402

# A JAX plugin that cannot start (a GPU host without cuDNN) says so in one line, not two tracebacks.
_quiet.condense_plugin_errors()

# The `gpu-compile` extra installs JAX's CUDA plugin on machines without a GPU (to compile for
# H100/H200 on paper). Left alone, JAX would then try to start CUDA and print a long "Unable to
# load CUDA" traceback before falling back to the CPU, and loading the plugin prints absl lines
# from C++ ("Could not find cuda drivers on your machine") four times per process, which would
# bury the one `error:` line a bad input gets. Without an NVIDIA driver there is no GPU to find,
# so ask for the CPU directly (unless JAX_PLATFORMS says otherwise), and have the process's first
# `import jax` run with exactly those lines filtered out of file descriptor 2, where the C++ side
# writes (jaxgpt/_quiet.py). A real GPU host (driver present) is not affected.
if (not _os.path.exists("/proc/driver/nvidia/version")
        and _util.find_spec("jax_plugins") is not None and _util.find_spec("jax_plugins.xla_cuda12") is not None):
    _os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _quiet.install()

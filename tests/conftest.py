"""Test setup: 8 fake CPU devices, created before anything imports JAX.

Every parallel layout (dp=8, fsdp=8, dp=2,fsdp=2,tp=2, ...) is tested on these devices; if
JAX were imported first the flag would be ignored and those tests would run on one device,
so the count is asserted rather than assumed.
"""

import os
import signal
import sys
import tempfile
from pathlib import Path

# --xla_backend_optimization_level=0: LLVM compiles the kernels without its optimisation passes.
# The suite is compile-bound (tiny models) and the HLO every test reads is the same; only the
# machine code is slower (test_parallel's layout parity: 54 s -> 43 s on 2 cores). Subprocesses
# inherit it (tests/helpers.py's xla_flags keeps it for those that set their own device count).
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"])
# JAXGPT_TEST_GPU=1 (scripts/gpu_checks.sh) also makes a CUDA GPU visible, as the second platform,
# so CPU stays the default backend and every other test still runs on the 8 CPU devices; the
# cuDNN attention parity test then runs on the GPU instead of being skipped.
if os.environ.get("JAXGPT_TEST_GPU") == "1":
    os.environ["JAX_PLATFORMS"] = "cpu,cuda"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # subprocesses share the GPU
else:
    os.environ["JAX_PLATFORMS"] = "cpu"
# The bundled corpus is prepared once per test session into a private cache (subprocesses inherit it).
os.environ.setdefault("JAXGPT_CACHE", tempfile.mkdtemp(prefix="jaxgpt-test-cache-"))
# No persistent compilation cache (it once sped up the kill/resume tests): in jax 0.12 an XLA:CPU
# step read back from it can deadlock its collectives (jaxgpt/parallel/distributed.py), which
# aborted whole test workers.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
# A suite started in the background of a non-interactive shell (`nohup ... &`, some CI runners)
# inherits SIGINT ignored, and so would every process it starts: the Ctrl-C tests would then test
# nothing (a child Python keeps an inherited SIG_IGN). Python's own handler here is reset to the
# default action in every child at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import jax  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests need 8 fake CPU devices; was JAX imported before conftest?"

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


@pytest.fixture(scope="session")
def shakespeare_dir() -> Path:
    from jaxgpt import data
    return data.resolve_data_dir("shakespeare")

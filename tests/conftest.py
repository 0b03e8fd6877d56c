"""Test setup: 8 fake CPU devices, created before anything imports JAX.

Every parallel layout (dp=8, fsdp=8, dp=2,fsdp=2,tp=2, ...) is tested on these devices; if
JAX were imported first the flag would be ignored and those tests would run on one device,
so the count is asserted rather than assumed.
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"])
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
# One XLA compilation cache per test session, also for the `python -m jaxgpt.*` subprocesses: the
# kill/resume tests compile the same tiny step in process after process, and compiling dominates
# them (tests/test_checkpoint.py: 263 s without, 117 s with, on 2 cores). Fresh per session, so
# nothing compiled by other code is ever reused.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxgpt-test-xla-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests need 8 fake CPU devices; was JAX imported before conftest?"

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


@pytest.fixture(scope="session")
def shakespeare_dir() -> Path:
    from jaxgpt import data
    return data.resolve_data_dir("shakespeare")

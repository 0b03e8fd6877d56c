"""Importing JAX with its CUDA plugin installed but no GPU, without the plugin's C++ start-up lines
(see jaxgpt/__init__.py for when and why)."""

import os
import sys
import tempfile

NOISE = ("All log messages before absl::InitializeLog() is called are written to STDERR",
         "cudart_stub.cc", "Could not find cuda drivers on your machine")


def load_jax_without_plugin_noise() -> None:
    """Imports jax and registers its PJRT plugins (what JAX does before creating its first backend;
    backends are not created, so `jax.distributed.initialize` may still follow), with file
    descriptor 2 captured meanwhile and written back less the lines in NOISE."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import jax  # noqa: F401
            from jax._src import xla_bridge
            getattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            sys.stderr.write("".join(line for line in text.splitlines(keepends=True)
                                     if not any(noise in line for noise in NOISE)))
            sys.stderr.flush()

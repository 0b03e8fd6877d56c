"""Importing JAX with its CUDA plugin installed but no GPU, without the plugin's C++ start-up lines
(see jaxgpt/__init__.py for when and why).

`install()` puts a finder at the front of `sys.meta_path` that acts once, on the first `import jax`
of the process (whoever asks for it): it hands the import to the normal path finder and wraps the
loader so that executing the `jax` package, and then registering JAX's PJRT plugins (what JAX does
before creating its first backend; no backend is created, so `jax.distributed.initialize` may still
follow), run with file descriptor 2 captured; the captured text is written back less the lines in
NOISE. A jaxgpt command that never imports JAX (`prepare` and its worker processes) pays nothing.

`condense_plugin_errors()` (on every machine) turns JAX's "Jax plugin configuration error" log
records, which carry the plugin's whole traceback (a GPU host missing cuDNN prints two chained
tracebacks), into one line ending with the exception's own message.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import tempfile
from contextlib import contextmanager

NOISE = ("All log messages before absl::InitializeLog() is called are written to STDERR",
         "cudart_stub.cc", "Could not find cuda drivers on your machine")


_saved: int | None = None  # the real stderr while fd 2 is captured


def stderr_fd() -> int:
    """The process's real stderr: fd 2, or its saved copy while JAX's import has fd 2 captured (a
    line written from a signal handler that then exits must not land in the capture)."""
    return 2 if _saved is None else _saved


@contextmanager
def _without_noise_on_fd2():
    sys.stderr.flush()
    global _saved
    saved = _saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            _saved = None
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            sys.stderr.write("".join(line for line in text.splitlines(keepends=True)
                                     if not any(noise in line for noise in NOISE)))
            sys.stderr.flush()


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        with _without_noise_on_fd2():
            self.inner.exec_module(module)
            if any(name.startswith("jax_plugins.") for name in sys.modules):
                return  # a plugin module is being imported and asked for jax: it is not ready to register
            from jax._src import xla_bridge
            getattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)()

    def __getattr__(self, name: str):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self.inner, name)


class _QuietJaxFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec


def install() -> None:
    if "jax" not in sys.modules and not any(isinstance(f, _QuietJaxFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietJaxFinder())


class _OneLinePluginError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and str(record.msg).startswith("Jax plugin"):
            e = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()}: {type(e).__name__}: {e}", ()
            record.exc_info = record.exc_text = None
        return True


def condense_plugin_errors() -> None:
    logger = logging.getLogger("jax._src.xla_bridge")
    if not any(isinstance(f, _OneLinePluginError) for f in logger.filters):
        logger.addFilter(_OneLinePluginError())

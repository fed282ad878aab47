"""Building and loading the C++ thread-local-state extension (csrc/tls_swap.cpp).

Built on first use against the installed torch with its own ``cpp_extension`` tooling (g++ and
ninja), into a cache folder keyed by the torch version, the Python version and the source's hash,
so later runs (and other processes) load it without rebuilding. ``python -m asyncpp.tls`` builds
it ahead of time.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from ..kernel.errors import AsyncppError

SOURCE = Path(__file__).resolve().parent.parent.parent / "csrc" / "tls_swap.cpp"
ENV_SWITCH = "ASYNCPP_TLS_SWAP"

_lock = threading.Lock()
_module: ModuleType | None = None
_error: BaseException | None = None


class TLSBuildError(AsyncppError, RuntimeError):
    """The thread-local-state extension could not be built or loaded."""


def build_dir() -> Path:
    import torch

    root = os.environ.get("ASYNCPP_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "asyncpp"
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
    return base / "ext" / tag.replace("+", "_")


def load() -> ModuleType:
    """The compiled extension, built on first use (raises :class:`TLSBuildError` if it cannot be)."""
    global _module, _error
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise _error
        try:
            _module = _build()
        except Exception as err:
            _error = TLSBuildError(
                "asyncpp could not build its torch thread-local-state extension "
                f"({SOURCE.name}): {type(err).__name__}: {str(err).strip()[-1500:]}\n"
                "It needs a C++ compiler (g++), the Python headers (python3-dev) and ninja "
                "(`pip install ninja`). To run without it, set the environment variable "
                f"{ENV_SWITCH}=0: blocks then share torch's thread-local state (grad mode, "
                "autocast, modes) with the model's forward."
            )
            _error.__cause__ = err
            raise _error from err
        return _module


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    if not SOURCE.exists():
        raise FileNotFoundError(f"{SOURCE} is missing (asyncpp must be installed from its source tree)")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    venv_bin = str(Path(sys.executable).parent)
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")  # ninja lives here
    return cpp_extension.load(
        name=f"asyncpp_tls_{digest}",
        sources=[str(SOURCE)],
        build_directory=str(out),
        extra_cflags=["-O2"],
        verbose=bool(os.environ.get("ASYNCPP_BUILD_VERBOSE")),
    )

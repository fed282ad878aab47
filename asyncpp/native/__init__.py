"""Building and loading asyncpp's native extension (csrc/): the thread-local-state swap and the
per-module controllers.

Built on first use against the installed torch with its own ``cpp_extension`` tooling (g++ and
ninja), into a cache folder keyed by the torch version, the Python version and the source's hash,
so later runs (and other processes) load it without rebuilding. ``python -m asyncpp.native``
builds it ahead of time. With ``ASYNCPP_NATIVE=0`` nothing is built: the swap is off and the
controllers are pure Python (slower; see docs/performance.md). ``ASYNCPP_TLS_SWAP``, the switch's
former name, is still honoured for one release (with a DeprecationWarning), as is ``TLSBuildError``,
the former name of :class:`NativeBuildError`.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

from ..kernel.errors import AsyncppError

CSRC = Path(__file__).resolve().parent.parent.parent / "csrc"
SOURCES = (
    "module.cpp",
    "tls_swap.cpp",
    "autocast_tls.cpp",
    "controller.cpp",
    "rows.cpp",
    "trap_await.cpp",
    "tap_op.cpp",
)
ENV_SWITCH = "ASYNCPP_NATIVE"  # 0/false/off/no: no native extension
OLD_ENV_SWITCH = "ASYNCPP_TLS_SWAP"  # its deprecated former name, honoured for one release
_OFF = ("0", "false", "off", "no")

_lock = threading.Lock()
_module: ModuleType | None = None
_error: BaseException | None = None
_warned_old_switch = False


class NativeBuildError(AsyncppError, RuntimeError):
    """The native extension (thread-local-state swap, controllers) could not be built or loaded."""


TLSBuildError = NativeBuildError  # its deprecated former name (the same class), kept for one release


def enabled() -> bool:
    """Whether the native extension is used (``ASYNCPP_NATIVE`` is not 0/false/off/no).

    Without ``ASYNCPP_NATIVE``, its deprecated former name ``ASYNCPP_TLS_SWAP`` is read instead
    (with a DeprecationWarning, once); when both are set, ``ASYNCPP_NATIVE`` wins.
    """
    global _warned_old_switch
    value = os.environ.get(ENV_SWITCH)
    if value is None:
        value = os.environ.get(OLD_ENV_SWITCH)
        if value is None:
            return True
        if not _warned_old_switch:
            _warned_old_switch = True
            warnings.warn(
                f"{OLD_ENV_SWITCH} is deprecated: set {ENV_SWITCH} instead (the switch covers the "
                "whole native extension: the thread-local-state swap and the controllers)",
                DeprecationWarning,
                stacklevel=2,
            )
    return value.strip().lower() not in _OFF


def build_dir() -> Path:
    import torch

    root = os.environ.get("ASYNCPP_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "asyncpp"
    build_id = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
    return base / "ext" / build_id.replace("+", "_")


def load() -> ModuleType:
    """The compiled extension, built on first use (raises :class:`NativeBuildError` if it cannot
    be)."""
    global _module, _error
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise _error
        try:
            module = _build()
            from ..kernel.block import Block, Wait
            from ..kernel.interleaver import Interleaver
            from ..kernel.traps import StepGate
            from ..kernel.views import ValueView
            from ..locations.location import Location

            module.set_types(Location, Block, Wait, Interleaver, StepGate, ValueView)
            from ..kernel import batching

            batching.use_native(module)  # the fast path recognises plain reads by type
            from ..kernel.traps import Gather, Read, StepGate

            for trap in (Read, StepGate, Gather):  # Write keeps its own: it marks itself awaited
                module.install_await(trap)
            _module = module
        except Exception as err:
            _error = NativeBuildError(
                "asyncpp could not build its native extension (csrc/: the torch thread-local-state "
                f"swap and the module controllers): {type(err).__name__}: {str(err).strip()[-1500:]}\n"
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

    paths = [CSRC / name for name in SOURCES]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{missing} missing (asyncpp must be installed from its source tree)")
    h = hashlib.sha256()
    for p in sorted(CSRC.iterdir()):
        if p.suffix in (".cpp", ".h"):
            h.update(p.name.encode() + p.read_bytes())
    digest = h.hexdigest()[:10]
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    venv_bin = str(Path(sys.executable).parent)
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")  # ninja lives here
    return cpp_extension.load(
        name=f"asyncpp_native_{digest}",
        sources=[str(p) for p in paths],
        build_directory=str(out),
        extra_cflags=["-O2"],
        verbose=bool(os.environ.get("ASYNCPP_BUILD_VERBOSE")),
    )

"""Torch thread-local state isolated per block: the interleaver's switch hook.

The swap itself is C++ (csrc/tls_swap.cpp), in asyncpp's native extension. On by default; set
``ASYNCPP_NATIVE=0`` to turn the extension off knowingly (blocks then share grad mode, autocast and
mode stacks with the forward, as plain coroutines on one thread do).
"""

from __future__ import annotations

from typing import Any

from . import ENV_SWITCH, NativeBuildError, TLSBuildError, enabled, load


def get_switch() -> Any | None:
    """The native module (``BlockState``, ``enter``, ``leave``) or None when switched off.

    Raises :class:`NativeBuildError` when the swap is on but the extension cannot be built.
    """
    if not enabled():
        return None
    return load()


__all__ = ["ENV_SWITCH", "NativeBuildError", "TLSBuildError", "enabled", "get_switch", "load"]

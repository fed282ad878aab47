"""Torch thread-local state isolated per block: the interleaver's switch hook.

On by default; set ``ASYNCPP_TLS_SWAP=0`` to turn it off knowingly (blocks then share grad mode,
autocast and mode stacks with the forward, as plain coroutines on one thread do).
"""

from __future__ import annotations

import os
from typing import Any

from .build import ENV_SWITCH, TLSBuildError, load


def enabled() -> bool:
    """Whether the swap is on (the environment variable ``ASYNCPP_TLS_SWAP`` is not 0/false/off)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def get_switch() -> Any | None:
    """The extension module (``BlockState``, ``enter``, ``leave``) or None when switched off.

    Raises :class:`TLSBuildError` when the swap is on but the extension cannot be built.
    """
    if not enabled():
        return None
    return load()


__all__ = ["TLSBuildError", "enabled", "get_switch", "load"]

"""Deprecated alias of :mod:`asyncpp.native.tls` (the thread-local-state swap hook now lives with
the rest of the native extension); kept for one release."""

from __future__ import annotations

import warnings

from .native.tls import ENV_SWITCH, NativeBuildError, TLSBuildError, enabled, get_switch, load

warnings.warn(
    "asyncpp.tls is deprecated: import asyncpp.native.tls instead", DeprecationWarning, stacklevel=2
)

__all__ = ["ENV_SWITCH", "NativeBuildError", "TLSBuildError", "enabled", "get_switch", "load"]

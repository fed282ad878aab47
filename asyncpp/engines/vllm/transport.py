"""Deprecated alias of :mod:`asyncpp.engines.vllm.packing` (how blocks and their outcomes travel to
and from vLLM workers as bytes); kept for one release."""

from __future__ import annotations

import warnings

from .packing import RemoteBlockError, pack_block, pack_outcome, unpack_block, unpack_outcome

warnings.warn(
    "asyncpp.engines.vllm.transport is deprecated: import asyncpp.engines.vllm.packing instead",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["RemoteBlockError", "pack_block", "pack_outcome", "unpack_block", "unpack_outcome"]

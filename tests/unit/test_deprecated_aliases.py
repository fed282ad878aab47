"""Deprecated aliases of renamed modules and names: they still work, and warn, for one release."""

from __future__ import annotations

import pytest


def test_vllm_transport_is_a_deprecated_alias_of_packing() -> None:
    import importlib
    import sys

    from asyncpp.engines.vllm import packing

    with pytest.warns(DeprecationWarning, match=r"asyncpp\.engines\.vllm\.packing"):
        if "asyncpp.engines.vllm.transport" in sys.modules:
            importlib.reload(sys.modules["asyncpp.engines.vllm.transport"])
        else:
            importlib.import_module("asyncpp.engines.vllm.transport")
    old = sys.modules["asyncpp.engines.vllm.transport"]
    for name in ("RemoteBlockError", "pack_block", "pack_outcome", "unpack_block", "unpack_outcome"):
        assert getattr(old, name) is getattr(packing, name), name

"""Serving asyncpp: blocks an operator registers by name, and the data-only wire format.

A served model runs only blocks its operator registered (:class:`Registry`); a client names one and
passes data, which :meth:`Registry.bind` checks against the block's declared parameter types before
anything runs. Requests and responses carry tensors as safetensors and everything else as JSON
(:mod:`asyncpp.serve.wire`): nothing on either side is ever unpickled.

``import asyncpp`` does not import this package; the wire codec imports ``safetensors`` only when a
body with tensors is encoded or decoded.
"""

from __future__ import annotations

from .app import ServeLimits, create_app
from .auth import load_tokens
from .client import RemoteBlockError, RemoteEngine, RemoteError
from .registry import (
    BlockArgumentError,
    BlockSpec,
    Bound,
    MaxLen,
    ParamSpec,
    Range,
    Registry,
    Tensor,
    UnknownBlockError,
    block,
    load_module,
)
from .wire import (
    CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    WireError,
    WireLimits,
    decode,
    decode_body,
    decode_json,
    encode,
    encode_json,
)

__all__ = [
    "BlockArgumentError",
    "BlockSpec",
    "Bound",
    "CONTENT_TYPE",
    "JSON_CONTENT_TYPE",
    "MaxLen",
    "ParamSpec",
    "Range",
    "Registry",
    "RemoteBlockError",
    "RemoteEngine",
    "RemoteError",
    "ServeLimits",
    "Tensor",
    "UnknownBlockError",
    "WireError",
    "WireLimits",
    "block",
    "create_app",
    "decode",
    "decode_body",
    "decode_json",
    "encode",
    "encode_json",
    "load_module",
    "load_tokens",
]

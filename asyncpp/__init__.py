"""asyncpp: async intervention blocks that read and edit a model's internals while it runs.

async def steer(m, vec):
    out = await m.model.layers[1].output
    out[:, -1] += vec
    return (await m.logits)[:, -1].argmax(-1)

async with asyncpp.trace(model) as t:
    h = t.invoke(prompt_ids, steer, vec)
h.result
"""

from __future__ import annotations

from typing import Any

from .engines.base import Engine
from .engines.inputs import InputError
from .engines.local import LocalEngine
from .kernel.errors import (
    AsyncppError,
    BlockTimeoutError,
    EngineDeadError,
    ForeignAwaitError,
    InternalError,
    MissingAwaitError,
    NeverReachedError,
    OrderError,
    PathError,
    TapError,
    WriteError,
)
from .kernel.grad import backward
from .kernel.slot import Slot, SlotError
from .kernel.traps import Gather
from .locations.location import Location
from .locations.standard import StandardViewError
from .native import NativeBuildError, TLSBuildError
from .pp.merge import NOT_HERE, RankDivergenceWarning
from .pp.pulls import PullError, PullTimeout
from .pp.remote import RemoteValueError, pull
from .trace.api import Invoke, Trace, generate, trace
from .trace.stream import StreamEvent, emit

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "VllmEngine":  # imported on first use: `import asyncpp` never imports vLLM
        from .engines.vllm import VllmEngine

        return VllmEngine
    if name == "RemoteEngine":  # the client of `asyncpp serve` (imports httpx when it runs)
        from .serve.client import RemoteEngine

        return RemoteEngine
    raise AttributeError(f"module 'asyncpp' has no attribute {name!r}")


def gather(*awaitables: Any) -> Gather:
    """Wait on several locations (and slots) at once, in any order; returns their values as a list.

    ``a, b = await asyncpp.gather(m.model.layers[3].output, m.model.layers[1].output)``. The block
    resumes when the last one arrives, so in-place edits only land in the last-served value.
    """
    return Gather(awaitables)


__all__ = [
    "AsyncppError",
    "BlockTimeoutError",
    "Engine",
    "EngineDeadError",
    "ForeignAwaitError",
    "InternalError",
    "InputError",
    "Invoke",
    "LocalEngine",
    "Location",
    "MissingAwaitError",
    "NativeBuildError",
    "NeverReachedError",
    "OrderError",
    "NOT_HERE",
    "PathError",
    "TapError",
    "PullError",
    "PullTimeout",
    "RankDivergenceWarning",
    "RemoteValueError",
    "StandardViewError",
    "Slot",
    "StreamEvent",
    "SlotError",
    "TLSBuildError",
    "Trace",
    "VllmEngine",
    "RemoteEngine",
    "WriteError",
    "backward",
    "emit",
    "gather",
    "generate",
    "pull",
    "trace",
]

"""Per-module controllers: the hot path of a local run.

During a run every module's ``forward`` is shadowed by a controller (an instance attribute, so the
module's own ``__call__`` wrappers still run). A call of a module nobody waits on costs a set lookup
before and after the call and a counter bump; a call some block waits on goes to the interleaver's
``visit``. Between runs the controllers are removed: the model carries no asyncpp state.

The controllers are native (csrc/controller.cpp) when the extension is available; the Python ones
here do the same, slower, when it is switched off (``ASYNCPP_TLS_SWAP=0``).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from . import enabled, load


class PyRunSlot:
    """The run a model's controllers serve (the Python twin of the native ``RunSlot``)."""

    __slots__ = ("kernel", "hot_in", "hot_out", "counts", "bypass", "step", "fast", "in_visit")

    def __init__(self):
        self.step = 0
        self.fast = self.in_visit = False  # the single-read fast path is native only
        self.kernel: Any = None
        self.hot_in: set = set()
        self.hot_out: set = set()
        self.counts: list = []
        self.bypass = False

    def activate(self, kernel: Any) -> None:
        self.kernel, self.hot_in, self.hot_out = kernel, kernel.hot_in, kernel.hot_out
        self.counts, self.bypass = kernel.counts, False

    def deactivate(self) -> None:
        self.kernel, self.bypass = None, False


def py_controller(slot: PyRunSlot, index: int, forward: Callable, replaced: Any) -> Callable:
    def controller(*args, **kwargs):
        kernel = slot.kernel
        if kernel is None or slot.bypass:
            return forward(*args, **kwargs)
        if index in slot.hot_in:
            return kernel.visit(index, forward, args, kwargs)
        out = forward(*args, **kwargs)
        if index in slot.hot_out:  # a block waits on this call's output (perhaps since it began)
            return kernel.visit_output(index, out)
        slot.counts[index] += 1
        return out

    controller.__wrapped__ = forward  # type: ignore[attr-defined]
    controller.asyncpp_replaced = replaced  # type: ignore[attr-defined]
    return controller


def _py_install(entries: list) -> None:
    for d, ctrl, _ in entries:
        d["forward"] = ctrl


def _py_remove(entries: list) -> None:
    for d, _, own in entries:
        if own is None:
            d.pop("forward", None)
        else:
            d["forward"] = own


def _weak_forward(module: nn.Module) -> Callable:
    """The module's forward without a strong reference to the module (for the root, so that an
    engine cached per model does not keep its model alive)."""
    ref = weakref.ref(module)
    fn = type(module).forward

    def forward(*args, **kwargs):
        return fn(ref(), *args, **kwargs)

    # callers that inspect the forward's parameters (Hugging Face's generate asks whether it takes
    # position_ids) must see the module's own, not (*args, **kwargs)
    try:
        sig = inspect.signature(fn)
        forward.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    except (TypeError, ValueError):
        pass
    return forward


class Controllers:
    """The controllers of one model and their shared slot, installed for a run and removed after."""

    def __init__(self, modules: list[nn.Module]):
        native = load() if enabled() else None
        if native is not None:
            self.slot = native.RunSlot()
            make, self._install, self._remove = native.Controller, native.install, native.remove
        else:
            self.slot = PyRunSlot()
            make, self._install, self._remove = py_controller, _py_install, _py_remove
        self._entries: list = []
        for index, module in enumerate(modules):
            if module is None:  # a module this process does not hold (another pipeline stage's)
                continue
            own = module.__dict__.get("forward")  # an instance-level forward someone else set
            if hasattr(own, "asyncpp_replaced"):  # another engine's controller, mid-run
                own = own.asyncpp_replaced
            if own is not None:
                forward = own
            elif index == 0:
                forward = _weak_forward(module)
            else:
                forward = type(module).forward.__get__(module)
            self._entries.append((module.__dict__, make(self.slot, index, forward, own), own))

    def install(self, kernel: Any) -> None:
        self.slot.activate(kernel)
        self._install(self._entries)

    def remove(self) -> None:
        self._remove(self._entries)
        self.slot.deactivate()

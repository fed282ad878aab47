"""Per-module controllers: the hot path of a local run.

During a run every module's ``forward`` is shadowed by a controller (an instance attribute, so the
module's own ``__call__`` wrappers still run). A call of a module nobody waits on costs one set
lookup before and after the call and a counter bump; a call some block waits on goes to the interleaver's ``visit``. Between
runs the controllers are removed: the model carries no asyncpp state.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn


class _Bypass:
    """Stands in for the interleaver while a block's own code runs: a block that calls one of the
    model's modules (``model.lm_head(h)`` in a logit lens) runs it plainly, unseen by the run."""

    __slots__ = ("hot", "counts")

    def __init__(self, n: int):
        self.hot: frozenset = frozenset()
        self.counts = [0] * n  # scratch: calls made by blocks are not the run's calls


class RunSlot:
    """Holds the interleaver of the run in progress, read by every controller. While a block runs,
    the interleaver swaps in ``bypass``."""

    __slots__ = ("kernel", "bypass")

    def __init__(self, n: int):
        self.kernel: Any = None
        self.bypass = _Bypass(n)


def make_controller(slot: RunSlot, index: int, forward: Callable) -> Callable:
    def controller(*args, **kwargs):
        kernel = slot.kernel
        if index in kernel.hot:
            return kernel.visit(index, forward, args, kwargs)
        out = forward(*args, **kwargs)
        if index in kernel.hot:  # a block started waiting on this call's output while it ran
            return kernel.visit_output(index, out)
        kernel.counts[index] += 1
        return out

    controller.__wrapped__ = forward  # type: ignore[attr-defined]
    return controller


def _weak_forward(module: nn.Module) -> Callable:
    """The module's forward without a strong reference to the module (for the root, so that an
    engine cached per model does not keep its model alive)."""
    ref = weakref.ref(module)
    fn = type(module).forward

    def forward(*args, **kwargs):
        return fn(ref(), *args, **kwargs)

    return forward


class Controllers:
    """The controllers of one model, installed for a run and removed after it."""

    def __init__(self, modules: list[nn.Module], slot: RunSlot):
        self._entries = []
        for index, module in enumerate(modules):
            own = module.__dict__.get("forward")  # an instance-level forward someone else set
            if hasattr(own, "asyncpp_replaced"):  # another engine's controller, mid-run
                own = own.asyncpp_replaced
            if own is not None:
                forward = own
            elif index == 0:
                forward = _weak_forward(module)
            else:
                forward = type(module).forward.__get__(module)
            ctrl = make_controller(slot, index, forward)
            ctrl.asyncpp_replaced = own  # type: ignore[attr-defined]
            self._entries.append((module.__dict__, ctrl, own))

    def install(self) -> None:
        for d, ctrl, _ in self._entries:
            d["forward"] = ctrl

    def remove(self) -> None:
        for d, _, own in self._entries:
            if own is None:
                d.pop("forward", None)
            else:
                d["forward"] = own

"""Per-module controllers: the hot path of a local run, and their contract with the kernel.

During a run every module's ``forward`` is shadowed by a controller (an instance attribute, so the
module's own ``__call__`` wrappers still run). A call of a module nobody waits on costs a set lookup
before and after the call and a counter bump; a call some block waits on goes to the interleaver's
``visit``. Between runs the controllers are removed: the model carries no asyncpp state.

The controllers are native (csrc/controller.cpp) when the extension is available, with a fast path
that serves plain reads in C; the Python ones here (:class:`PyRunLink`, :func:`py_controller`) are
their twin without the fast path, so every call goes through the interleaver, which owns the
semantics. ``ASYNCPP_CONTROLLERS=python`` selects the twin while the rest of the extension (the
thread-local-state swap) stays on: the test suite runs both ways.

The contract. All controllers of a model share one run link (``RunLink`` natively, the twin
:class:`PyRunLink`). ``link.attach(fields)`` hands it a run's fields by name, a dict
(``Interleaver.link_fields()``):

* ``kernel``: the interleaver; ``hot_in`` / ``hot_out``: sets of module indices some wait refers to
  at the input stage / output; ``counts``: completed calls per module in the current step (list);
  these are read once and mutated in place by the kernel;
* ``visit(index, forward, args, kwargs)`` / ``visit_output(index, out)``: a hot call;
* ``guarded``: modules whose output waits the kernel parks itself (its ``refuse`` hook may reject
  them): the fast path does not park a block's next wait there. A ``set`` is read live (its owner
  may change it between steps: an auto vLLM engine empties it for its eager steps); any other
  iterable is copied;
* for the native fast path only: ``waits`` (wait key -> list of ``kernel.block.Wait``),
  ``refs_out``, ``ready``, ``resume(block, value, exc, msg, entered)``, ``complete(block, value)``,
  ``fail(block, exc)``, ``serve()``, ``budget_enter(block)`` / ``budget_leave(block)``, ``special``
  (modules whose values the kernel transforms, left to it) and ``fast`` (whether the fast path may
  serve: derived from the run's hooks), ``step`` (the current step; the kernel keeps ``link.step``
  in sync).

The link's own fields: ``bypass`` (set by the kernel while a block's code runs: the block's own
module calls run plainly), ``in_visit``, ``visit_index``, ``visit_n`` and ``visit_out`` (the call
the fast path is serving; a block's write there replaces ``visit_out``). Besides these the fast path
reads and writes named fields of the kernel's classes (offsets looked up once by ``set_types``):
``Location.key/occ/keys`` (of a Location or a subclass; the keys applied as
``batching.get_item`` does, calling ``ValueView.present``), ``Block.coro/state/rows/step/order/waiting/done/ended/req_step``, every
field of ``Wait``, ``StepGate.after/every`` and ``Interleaver.current/position/batch_size/budget/gates``.
The native link's one method besides attach/detach: ``resume(block, value)`` (the kernel's
``_resume`` for one block, parking its next plain read or step-loop iteration natively; the kernel
calls it only while ``fast`` holds, which the twin never sets).
"""

from __future__ import annotations

import inspect
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from . import enabled, load

ENV_CONTROLLERS = "ASYNCPP_CONTROLLERS"  # "python": the Python twin even when the extension is on


def python_controllers() -> bool:
    """Whether runs use the Python controllers (the extension is off, or the twin is asked for)."""
    return not enabled() or os.environ.get(ENV_CONTROLLERS, "").strip().lower() == "python"


class PyRunLink:
    """The run a model's controllers serve (the Python twin of the native ``RunLink``)."""

    __slots__ = ("kernel", "hot_in", "hot_out", "counts", "visit", "visit_output", "bypass", "step", "fast")

    def __init__(self):
        self.step = 0
        self.fast = False  # the single-read fast path is native only
        self.kernel: Any = None
        self.hot_in: set = set()
        self.hot_out: set = set()
        self.counts: list = []
        self.visit = self.visit_output = None
        self.bypass = False

    @property
    def in_visit(self) -> bool:
        return False  # (no fast path: no call is ever being served here)

    def attach(self, fields: dict[str, Any]) -> None:
        self.kernel, self.hot_in, self.hot_out = fields["kernel"], fields["hot_in"], fields["hot_out"]
        self.counts, self.visit, self.visit_output = fields["counts"], fields["visit"], fields["visit_output"]
        self.step, self.bypass = fields["step"], False

    def detach(self) -> None:
        self.kernel = self.visit = self.visit_output = None
        self.bypass = False


def py_controller(link: PyRunLink, index: int, forward: Callable, replaced: Any, owner: dict) -> Callable:
    def controller(*args, **kwargs):
        if link.kernel is None or link.bypass:
            return forward(*args, **kwargs)
        if index in link.hot_in:
            return link.visit(index, forward, args, kwargs)
        out = forward(*args, **kwargs)
        if link.kernel is None:  # the run ended while this call ran (an aborted run)
            return out
        if index in link.hot_out:  # a block waits on this call's output (perhaps since it began)
            return link.visit_output(index, out)
        link.counts[index] += 1
        return out

    controller.__wrapped__ = forward  # type: ignore[attr-defined]
    controller.asyncpp_replaced = replaced  # type: ignore[attr-defined]
    controller.owner = owner  # type: ignore[attr-defined]
    return controller


def _py_install(controllers: list) -> None:
    for c in controllers:
        c.owner["forward"] = c


def _py_remove(controllers: list) -> None:
    for c in controllers:
        if c.asyncpp_replaced is None:
            c.owner.pop("forward", None)
        else:
            c.owner["forward"] = c.asyncpp_replaced


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


def _no_forward(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("asyncpp: an output server's controller is never called")


class Controllers:
    """The controllers of one model and their shared link, installed for a run and removed after."""

    def __init__(self, modules: list[nn.Module]):
        if python_controllers():
            self.link: Any = PyRunLink()
            make, self._install, self._remove = py_controller, _py_install, _py_remove
        else:
            native = load()
            self.link = native.RunLink()
            make, self._install, self._remove = native.Controller, native.install, native.remove
        self.native = not isinstance(self.link, PyRunLink)
        self._make = make
        self._controllers: list = self._made(enumerate(modules))

    def _made(self, modules: Iterable[tuple[int, nn.Module | None]]) -> list:
        made = []
        for index, module in modules:
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
            made.append(self._make(self.link, index, forward, own, module.__dict__))
        return made

    def extend(self, modules: Iterable[tuple[int, nn.Module]]) -> None:
        """Control more modules (``(index, module)`` pairs) from now on, installed at once: for
        modules that may not be shadowed until later (a compiled engine's, once vLLM has traced
        them)."""
        more = self._made(modules)
        self._install(more)
        self._controllers.extend(more)

    def output_server(self, index: int) -> Callable[[Any], Any]:
        """``serve(out) -> out``: what module ``index``'s controller does once a call of the module
        has returned ``out``, for calls that run where no controller can (a compiled engine's tap):
        serve its output waits, natively where the fast path may, or count the call."""
        if self.native:
            return load().Controller(self.link, index, _no_forward, None, {}).after
        link = self.link

        def after(out: Any) -> Any:
            if link.kernel is None or link.bypass:
                return out
            if index in link.hot_out:
                return link.visit_output(index, out)
            link.counts[index] += 1
            return out

        return after

    def install(self, kernel: Any) -> None:
        """Attach ``kernel``'s run to the link and shadow every module's forward."""
        self.link.attach(kernel.link_fields())
        self._install(self._controllers)

    def remove(self) -> None:
        self._remove(self._controllers)
        self.link.detach()

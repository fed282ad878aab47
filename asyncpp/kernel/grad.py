"""Gradients in traces with ``grad=True``: per-invoke rows inside the autograd graph, and backward
passes a block starts, whose gradients it awaits at locations.

Rows. Narrowing a value after the module ran (``out[a:b]``) gives a view the model never uses, so
no gradient of anything the model computes next reaches it. In a gradient run each invoke's rows of
a served value are therefore cut where the value is produced (:class:`RowParts`), and the model
goes on with those very pieces put back together (``torch.cat``): every block's rows, its in-place
edits and its replacements are on the graph, and a block that sees the whole batch still holds the
original tensor, which the pieces are views of.

Backward. ``async with asyncpp.backward(loss):`` opens a session; the first ``await loc.grad``
inside it parks the block and the interleaver runs the backward pass, outside the block's frame.
Hooks on the values the block awaited in the forward resume it when their gradient arrives, in the
order the backward reaches them; ``await loc.grad.set(g)`` replaces the gradient flowing on. The
block's code runs between hook calls, as it runs between module calls in the forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import batching
from .answers import PARKED, RUN_BACKWARD, Throw
from .batching import _rebuild, narrow
from .errors import AsyncppError, NeverReachedError, OrderError, WriteError
from .traps import BACKWARD, GRAD
from .views import ValueView

# ------------------------------------------------------------------------------------------------
# rows inside the graph


class RowParts:
    """The pieces invokes took of one value at one visit (kind), keyed by their rows."""

    __slots__ = ("base", "pieces", "batch")

    def __init__(self, base: Any, batch: int):
        self.base = base  # the value the pieces were cut from
        self.pieces: dict[tuple[int, int], Any] = {}
        self.batch = batch

    def get(self, rows: tuple[int, int]) -> Any:
        piece = self.pieces.get(rows)
        if piece is None:
            piece = self.pieces[rows] = narrow(self.base, rows, self.batch)
        return piece

    def rebuild(self) -> Any:
        """The value with every invoke's piece in its rows, for the model to go on with."""
        if not self.pieces:
            return self.base
        return _reassemble(self.base, sorted(self.pieces.items()), self.batch)


def _reassemble(full: Any, parts: list, batch: int) -> Any:
    if isinstance(full, Tensor):
        if not (full.dim() and full.shape[0] == batch):
            return full
        if not full.requires_grad and all(
            _is_view(full, rows, p) and not p.requires_grad for rows, p in parts
        ):
            return full  # nothing to differentiate, and nothing replaced
        pieces, pos = [], 0
        for (a, b), p in parts:
            if a > pos:
                pieces.append(full[pos:a])
            pieces.append(p)
            pos = b
        if pos < batch:
            pieces.append(full[pos:])
        return torch.cat(pieces)
    if isinstance(full, dict):
        return _rebuild(
            full, {k: _reassemble(v, [(r, p[k]) for r, p in parts], batch) for k, v in full.items()}
        )
    if isinstance(full, (tuple, list)):
        return _rebuild(
            full, [_reassemble(v, [(r, p[i]) for r, p in parts], batch) for i, v in enumerate(full)]
        )
    return full


def _is_view(full: Tensor, rows: tuple[int, int], p: Any) -> bool:
    if not isinstance(p, Tensor):
        return False
    a, b = rows
    return p.data_ptr() == full[a:b].data_ptr() and p.shape == full[a:b].shape


# ------------------------------------------------------------------------------------------------
# the traps of a backward session


class Backward:
    """``async with asyncpp.backward(loss):``: a backward pass the block starts. Entering opens the
    session (no wait); the first ``await loc.grad`` in it runs the pass; leaving waits for the pass
    to end (and runs it, if nothing in the body did)."""

    TRAP = BACKWARD
    __slots__ = (
        "loss",
        "gradient",
        "retain_graph",
        "inputs",
        "op",
        "state",
        "block",
        "waiting",
        "fired",
        "serving",
        "replacement",
        "error",
        "line",
    )

    def __init__(self, loss: Any, gradient: Any, retain_graph: bool, inputs: Any, line: str):
        self.loss = loss
        self.gradient = gradient
        self.retain_graph = retain_graph
        self.inputs = inputs
        self.line = line
        self.op = "open"  # what the block asks when it yields this object: "open" or "close"
        self.state = "new"  # new -> open -> running -> done
        self.block: Any = None
        self.waiting: Any = None  # the GradWait the block is parked on during the pass
        self.fired: set[int] = set()  # ids of the tensors whose gradient has arrived
        self.serving: tuple[int, Any] | None = None  # (tensor id, gradient) being served now
        self.replacement: Any = None
        self.error: BaseException | None = None

    async def __aenter__(self) -> Backward:
        if self.state != "new":
            raise AsyncppError("this asyncpp.backward(...) was already used; make a new one")
        self.op = "open"
        await self
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.op = "close"
        await self

    def __await__(self):
        return (yield self)

    def __repr__(self) -> str:
        return f"<asyncpp.backward {self.state}>"


class GradWait:
    """``await loc.grad`` (``value is None``) or ``await loc.grad.set(value)``: the gradient
    flowing through a location the block awaited in the forward."""

    TRAP = GRAD
    __slots__ = ("target", "grad_keys", "value", "replace", "line", "awaited")

    def __init__(
        self, target: Any, grad_keys: tuple, value: Any = None, replace: bool = False, line: str = ""
    ):
        self.target = target  # the forward location (a Read), with the keys that reach a tensor
        self.grad_keys = grad_keys  # keys applied to the gradient itself (a slice of it)
        self.value = value
        self.replace = replace
        self.line = line
        self.awaited = False

    def __await__(self):
        self.awaited = True
        return (yield self)

    def describe(self) -> str:
        name = self.target.describe()
        for k in self.grad_keys:
            name += f"[{k!r}]"
        return name + ".grad"


def backward(
    loss: Tensor, *, gradient: Any = None, retain_graph: bool = True, inputs: Any = None
) -> Backward:
    """A backward pass of ``loss`` that the block drives: ``async with asyncpp.backward(loss):``,
    then ``await loc.grad`` / ``await loc.grad.set(g)`` inside it, in backward order.

    :param gradient: the gradient of ``loss`` (needed when it is not a scalar), as in
        ``torch.autograd.backward``.
    :param retain_graph: keep the graph after the pass (default ``True``: a batched trace shares one
        graph between its invokes, so another invoke, or another pass, may need it).
    :param inputs: as in ``torch.autograd.backward``: accumulate ``.grad`` only into these leaves
        (default: all the leaves the loss depends on, the model's parameters included).
    """
    import sys

    f = sys._getframe(1)
    if not isinstance(loss, Tensor):
        raise TypeError(f"asyncpp.backward() needs a tensor, got {type(loss).__name__}")
    return Backward(loss, gradient, retain_graph, inputs, f"{f.f_code.co_filename}:{f.f_lineno}")


def tensors_of(value: Any) -> list[Tensor]:
    """The tensors in a served value (inside tuples, lists and dicts)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    return []


def split_keys(value: Any, keys: tuple) -> tuple[Any, tuple]:
    """Follow ``keys`` through containers; return the tensor reached and the keys left (which
    index that tensor, and so its gradient). A :class:`~.views.ValueView` key (a standard point)
    stays for the gradient, past a tuple's first element (the tensor such views present)."""
    i = 0
    while i < len(keys):
        if isinstance(value, Tensor):
            return value, keys[i:]
        k = keys[i]
        if isinstance(k, ValueView):
            if not isinstance(value, (tuple, list)) or not value:
                return value, keys[i:]
            value = value[0]
            continue
        value = value[k]
        i += 1
    return value, ()


# ------------------------------------------------------------------------------------------------
# the interleaver's handlers of the backward traps (``k`` is the interleaver)


def on_backward(k: Any, block: Any, session: Backward) -> Any:
    """``async with asyncpp.backward(...)``: open the session, or close it (running the pass if
    nothing in the body did, or waiting until the running one ends)."""
    if session.op == "open":
        if not k.grad:
            return Throw(
                AsyncppError(
                    "asyncpp.backward() needs a trace with gradients: asyncpp.trace(engine, grad=True) "
                    "on a LocalEngine (vLLM runs the model under inference mode, without gradients)"
                )
            )
        if block.session is not None:
            return Throw(AsyncppError("a block can drive one asyncpp.backward(...) at a time"))
        if session.state != "new":
            return Throw(AsyncppError("this asyncpp.backward(...) was already used; make a new one"))
        session.state, session.block = "open", block
        block.session = session
        return session
    if block.session is not session:
        return None
    if session.state == "open":
        return RUN_BACKWARD
    if session.state == "running":
        return PARKED  # resumed by run_backward when the pass ends
    block.session = None
    return None


def on_grad(k: Any, block: Any, wait: GradWait) -> Any:
    """``await loc.grad`` / ``await loc.grad.set(g)`` inside a backward session."""
    if wait.replace:
        try:
            block.writes.remove(wait)
        except ValueError:
            pass
    session = block.session
    what = wait.describe()
    if session is None or session.state == "done":
        return Throw(
            AsyncppError(
                f"{what} can only be awaited inside `async with asyncpp.backward(loss):` in the "
                f"block that awaited {wait.target.describe()} in the forward"
            )
        )
    target = wait.target
    seen = None if block.seen is None else block.seen.get((target.key, block.step, target.occ))
    if seen is None:
        return Throw(
            AsyncppError(
                f"{what}: the block did not await {target.describe()} in the forward; await the "
                f"location first (its value is what the gradient is taken with respect to)"
            )
        )
    tensor, rest = split_keys(seen, target.keys)
    if not isinstance(tensor, torch.Tensor):
        return Throw(AsyncppError(f"{what}: the value there is a {type(tensor).__name__}, not a tensor"))
    tid = id(tensor)
    serving = session.serving
    if serving is not None and serving[0] == tid:  # the gradient being served right now
        return _grad_now(session, wait, serving[1], rest)
    if tid in session.fired:
        return Throw(
            OrderError(
                f"{what} has already passed in this backward pass: await gradients in the order "
                f"the backward reaches them, from the loss back towards the inputs"
            )
        )
    session.waiting = (tid, wait, rest)
    return RUN_BACKWARD if session.state == "open" else PARKED


def _grad_now(session: Backward, wait: GradWait, gradient: Any, rest: tuple) -> Any:
    """Serve ``wait`` with the gradient arriving now (the value the hook will pass on)."""
    current = gradient if session.replacement is None else session.replacement
    block = session.block
    if not wait.replace:
        return batching.get_item(current, rest, block) if rest else current
    where = wait.describe()
    new = wait.value
    if rest:  # a part of the gradient (loc[:, -1].grad): assigned into a copy of it
        current = current.clone()
        part = batching.get_item(current, rest[:-1], block)
        last = rest[-1]
        if isinstance(last, ValueView):  # a standard point: the view's part, same shape
            part = last.present(part, block)
            if not isinstance(new, torch.Tensor) or new.shape != part.shape:
                shape = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
                return Throw(
                    WriteError(
                        f"{where}: the replacement has shape {shape}, the gradient {tuple(part.shape)}"
                    )
                )
            part.copy_(new)
        else:
            part[last] = new
        new = current
    elif not isinstance(new, torch.Tensor) or new.shape != gradient.shape:
        shape = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
        return Throw(
            WriteError(f"{where}: the replacement has shape {shape}, the gradient {tuple(gradient.shape)}")
        )
    session.replacement = new
    return None


def run_backward(k: Any, block: Any) -> None:
    """Run the backward pass of ``block``'s session; hooks on the values it awaited resume it."""
    session = block.session
    session.state = "running"
    targets: dict[int, torch.Tensor] = {}
    for value in (block.seen or {}).values():
        for t in tensors_of(value):
            if t.requires_grad:
                targets[id(t)] = t
    handles = [t.register_hook(_grad_hook(k, session, tid)) for tid, t in targets.items()]
    error: BaseException | None = None
    try:
        torch.autograd.backward(
            session.loss, session.gradient, retain_graph=session.retain_graph, inputs=session.inputs
        )
    except Exception as err:
        error = err
    finally:
        for h in handles:
            h.remove()
    session.state = "done"
    if error is None and session.error is not None:
        error = session.error
    if block.done:
        return
    waiting = block.waiting
    block.waiting = None
    if getattr(waiting, "TRAP", None) == GRAD:
        session.waiting = None
        if error is None:
            error = NeverReachedError(
                f"{waiting.describe()} was never reached: the backward pass of the loss (from "
                f"{session.line}) ended without a gradient for it (the loss does not depend on it)"
            )
    elif waiting is session:
        block.session = None
    elif error is None:
        return  # parked elsewhere (a forward location): nothing to resume here
    k._resume(block, None, error)


def _grad_hook(k: Any, session: Backward, tid: int):
    def hook(gradient: torch.Tensor):
        session.fired.add(tid)
        w = session.waiting
        if w is None or w[0] != tid or session.block.done:
            return None
        session.waiting = None
        session.serving, session.replacement = (tid, gradient), None
        block = session.block
        try:
            value = _grad_now(session, w[1], gradient, w[2])
            if type(value) is Throw:
                k._resume(block, None, value.exc)
            else:
                k._resume(block, value, None)
        finally:
            session.serving = None
        return session.replacement

    return hook

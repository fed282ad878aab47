"""Serving a module visit: the values of the call being served, read by blocks and replaced by
their writes.

A :class:`Visit` holds a call's current values (a write replaces them, and the blocks after it, and
the model, see the replacement). Reads are narrowed to the block's rows (of tokens, or of requests
for request-level modules such as logits) and indexed by the location's keys; writes are checked
and put back at the block's rows. Gradient runs cut rows inside the autograd graph instead
(:class:`.grad.RowParts`).
"""

from __future__ import annotations

from typing import Any

from . import batching, grad
from .answers import NOTHING
from .errors import WriteError
from .traps import INPUT, INPUTS, OUTPUT, SKIP, Read


class Visit:
    """The module visit being served: its current (possibly replaced) values."""

    __slots__ = ("index", "n", "stage", "args", "kwargs", "out", "skip", "parts")

    def __init__(self, index: int, n: int, stage: int, args=(), kwargs=None, out=None):
        self.index = index
        self.n = n
        self.stage = stage  # INPUT for the input stage (input, inputs, skip), OUTPUT after the call
        self.args = args
        self.kwargs = kwargs
        self.out = out
        self.skip = NOTHING
        self.parts: dict | None = None  # gradient runs: kind -> grad.RowParts cut at this visit

    def get(self, kind: int) -> Any:
        if kind == OUTPUT:
            return self.out
        if kind == INPUT:
            if self.args:
                return self.args[0]
            if self.kwargs:
                return next(iter(self.kwargs.values()))
            return None
        if kind == INPUTS:
            return (self.args, self.kwargs)
        return None if self.skip is NOTHING else self.skip

    def set(self, kind: int, value: Any, where: str) -> None:
        if kind == OUTPUT:
            self.out = value
        elif kind == INPUT:
            if self.args:
                self.args = (value, *self.args[1:])
            elif self.kwargs:
                key = next(iter(self.kwargs))
                self.kwargs = {**self.kwargs, key: value}
            else:
                raise WriteError(f"{where}: this call has no input to replace")
        elif kind == INPUTS:
            if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)):
                raise WriteError(f"{where}: inputs must be replaced by a tuple (args, kwargs)")
            self.args, self.kwargs = tuple(value[0]), dict(value[1])
        else:
            self.skip = value


class NativeVisit(Visit):
    """The call the native fast path is serving: its output lives in the controllers' link, so a
    write by the block being resumed there reaches the model."""

    __slots__ = ("link",)

    def __init__(self, link: Any):
        self.link = link
        self.index, self.n, self.stage = link.visit_index, link.visit_n, OUTPUT
        self.args, self.kwargs, self.skip = (), None, NOTHING
        self.parts = None

    @property
    def out(self) -> Any:  # type: ignore[override]
        return self.link.visit_out

    @out.setter
    def out(self, value: Any) -> None:
        self.link.visit_out = value


def stage_of(kind: int) -> int:
    """The stage of a call at which a location of ``kind`` is served."""
    return OUTPUT if kind == OUTPUT else INPUT


def read_value(k: Any, block: Any, v: Visit, trap: Read) -> Any:
    """What ``block`` reads of visit ``v`` at ``trap`` (interleaver ``k``)."""
    value = v.out if trap.kind == OUTPUT else v.get(trap.kind)
    if v.index in k.hooks.request_level:
        value = batching.narrow(value, block.req_rows, k.req_batch)
    elif k.grad:
        if block.rows is not None:
            value = parts_of(k, v, trap.kind, value).get(block.rows)
        if block.seen is None:
            block.seen = {}
        block.seen[(trap.key, k.step, v.n)] = value
    elif block.rows is not None:
        value = batching.narrow(value, block.rows, k.batch_size)
    if trap.keys:
        value = batching.get_item(value, trap.keys, block)
    return value


def apply_write(k: Any, block: Any, v: Visit, write: Any) -> None:
    """Apply ``block``'s write to visit ``v`` (raises WriteError when it does not fit)."""
    target = write.target
    where = target.describe()
    if target.kind == SKIP:
        if block.rows is not None:
            where = f"{k.names[target.index]}.skip"
            raise WriteError(
                f"{where}: skipping a module is only possible from an invoke that sees the whole "
                f"batch (invoke without input, or run this invoke in a trace of its own)"
            )
        v.skip = write.value
        return
    current = v.get(target.kind)
    if v.index in k.hooks.request_level:
        rows, batch = block.req_rows, k.req_batch
    else:
        rows, batch = block.rows, k.batch_size
    if k.grad and rows is not None:
        _write_rows(k, block, v, target, write.value, current, where)
        return
    new = batching.put_at(current, target.keys, write.value, rows, batch, where, block)
    v.set(target.kind, new, where)
    if k.grad and not target.keys and block.seen is not None:
        block.seen[(target.key, k.step, v.n)] = new  # the value the model goes on with


def _same_value(a: Any, b: Any) -> bool:
    """Whether a visit's value is still the one pieces were cut from (``inputs`` is rebuilt as a
    fresh ``(args, kwargs)`` pair each time it is read)."""
    if a is b:
        return True
    return type(a) is tuple and type(b) is tuple and len(a) == len(b) == 2 and a[0] is b[0] and a[1] is b[1]


def parts_of(k: Any, v: Visit, kind: int, value: Any) -> grad.RowParts:
    """The row pieces of ``v``'s value of ``kind``, cut afresh if the value was replaced."""
    parts = v.parts
    if parts is None:
        parts = v.parts = {}
    p = parts.get(kind)
    if p is None or not _same_value(p.base, value):
        p = parts[kind] = grad.RowParts(value, k.batch_size)
    return p


def _write_rows(k: Any, block: Any, v: Visit, target: Read, new: Any, current: Any, where: str) -> None:
    """A write by an invoke that owns rows, in a gradient run: its piece is replaced (or edited
    in place, for a sub-location), and the model goes on with the pieces put back together."""
    rows = block.rows
    part = parts_of(k, v, target.kind, current)
    if target.keys:
        batching.put_at(part.get(rows), target.keys, new, None, k.batch_size, where, block)
        return
    batching.widen(current, new, rows, k.batch_size, where, build=False)  # the checks only
    part.pieces[rows] = new
    if block.seen is not None:
        block.seen[(target.key, k.step, v.n)] = new  # the value the model goes on with


def rebuild(v: Visit) -> None:
    """Put the row pieces of a gradient run's visit back together as the values the model sees."""
    for kind in (INPUT, INPUTS, OUTPUT):
        p = v.parts.get(kind)
        if p is not None and p.pieces and _same_value(p.base, v.get(kind)):
            v.set(kind, p.rebuild(), "")
    v.parts = None


__all__ = ["NativeVisit", "Visit", "apply_write", "read_value", "rebuild", "stage_of"]

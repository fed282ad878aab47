"""Lazy remote values: what a block gets when it awaits a location another pipeline stage owns.

``await m.model.layers[3].output`` on a stage that does not hold layer 3 returns a
:class:`RemoteValue` at once, with no traffic: the owning stage runs the same block and serves the
location itself. Indexing, arithmetic, tensor methods and torch functions on it stay lazy (a
:class:`Lazy` records the operation). A use that needs the data *forces* the value:

* synchronously (``bool()``, ``float()``, ``.shape``, an in-place edit of a real tensor with it, a
  write of it into the model) when the value already exists: its owner is upstream of this stage,
  or it belongs to an earlier round of the request. The data is pulled right there;
* only through ``await asyncpp.pull(value)`` when it cannot exist yet (a downstream owner, this
  round): the block waits and is resumed at the next serve point outside the forward. A synchronous
  use raises :class:`RemoteValueError` saying so. ``pull`` of a real value (on the stage that owns
  it, or on one stage) returns it at once, so the same line works on every stage.

A lazy value that is never forced costs nothing; in a block's result it becomes "not on this rank"
and the engine takes the owner's real value when it merges the stages' results.
"""

from __future__ import annotations

import dis
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..kernel.errors import AsyncppError
from ..kernel.traps import PULL
from .pull_format import selectable_key, selectable_view

_UNSET = object()


class RemoteValueError(AsyncppError):
    """A remote value used in a way this stage cannot serve (yet)."""


class Resolver:
    """What forcing needs from the stage: is a leaf's data there to pull now, and pull it."""

    def available(self, leaf: RemoteValue) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def fetch(self, leaf: RemoteValue, select: tuple = ()) -> Any:  # pragma: no cover - interface
        """The leaf's value with the selection ``select`` applied (the owner applies it, so that
        only the selected part crosses; see :func:`pull_plan`)."""
        raise NotImplementedError

    def fetch_all(self, plan: list[tuple[LazyValue, RemoteValue, tuple]]) -> list[Any]:
        """:meth:`fetch` of every ``(node, leaf, select)`` of a pull plan, in order (a stage sends
        them all before it waits for any)."""
        return [self.fetch(leaf, select) for _, leaf, select in plan]

    def stage(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError


_resolver: Resolver | None = None


def set_resolver(resolver: Resolver | None) -> None:
    """Install the stage's resolver (one per worker process)."""
    global _resolver
    _resolver = resolver


def is_lazy(value: Any) -> bool:
    return isinstance(value, LazyValue)


class LazyValue:
    """Common behaviour of remote values and the lazy operations on them."""

    __slots__ = ("_value",)
    TRAP = None  # not a trap: duck-typing checks (``getattr(x, "TRAP", None)``) must not see a method

    # --- forcing ---------------------------------------------------------------------------------

    def leaves(self) -> list[RemoteValue]:
        raise NotImplementedError

    def _compute(self) -> Any:
        raise NotImplementedError

    def force(self, plan: list[tuple[LazyValue, RemoteValue, tuple]] | None = None) -> Any:
        """The real value, pulled if needed; raises if it cannot exist on this stage yet. ``plan``:
        its :func:`pull_plan`, where the caller has just made it."""
        if self._value is _UNSET:
            if plan is None:
                plan = pull_plan(self)
            if plan:
                for _, leaf, _ in plan:
                    leaf.check_pullable()
                for (node, _, _), value in zip(plan, _resolver.fetch_all(plan), strict=True):
                    node._value = value
            if self._value is _UNSET:  # (unless it was one of the pulls)
                self._value = self._compute()
        return self._value

    def set_value(self, value: Any) -> None:
        """Fill in the pulled value (the serve point that resolved an awaited pull)."""
        self._value = value

    def __await__(self):  # `await value`: the same as `await asyncpp.pull(value)`
        return _Pulling(self).__await__()

    # --- lazy operations -------------------------------------------------------------------------

    @classmethod
    def __torch_function__(
        cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _mutates_real(func, args):
            return func(*_forced(args), **_forced(kwargs))  # an edit of a real tensor needs the data
        return Lazy(func, args, kwargs)

    def __getitem__(self, key: Any) -> Lazy:
        return Lazy(operator.getitem, (self, key), {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _METADATA:
            return getattr(self.force(), name)
        return Lazy(getattr, (self, name), {})  # an attribute, or a method: calling it stays lazy

    def __call__(self, *args: Any, **kwargs: Any) -> Lazy:
        return Lazy(_call, (self, *args), kwargs)

    def __bool__(self) -> bool:
        return bool(self.force())

    def __float__(self) -> float:
        return float(self.force())

    def __int__(self) -> int:
        return int(self.force())

    def __index__(self) -> int:
        return operator.index(self.force())

    def __len__(self) -> int:
        return len(self.force())

    def __iter__(self):
        n = _unpacking(sys._getframe(1))
        if n is not None:  # `a, b = value`: its elements, lazily (the line says how many)
            return iter([self[i] for i in range(n)])
        return iter(self.force())

    def __array__(self, *args: Any) -> Any:
        return self.force().__array__(*args)

    def __setitem__(self, key: Any, value: Any) -> None:
        """An in-place edit of a remote value is absorbed, like a write to a remote location: the
        stage that owns it runs the same line and edits the real value."""

    def describe(self) -> str:
        leaves = self.leaves()
        names = ", ".join(sorted({leaf.where for leaf in leaves}))
        return f"a value computed from {names}" if not isinstance(self, RemoteValue) else self.where


def _binary(op: Callable, swap: bool = False) -> Callable:
    if swap:

        def method(self: LazyValue, other: Any) -> Lazy:
            return Lazy(op, (other, self), {})

    else:

        def method(self: LazyValue, other: Any) -> Lazy:
            return Lazy(op, (self, other), {})

    return method


for _name, _op in [
    ("add", operator.add),
    ("sub", operator.sub),
    ("mul", operator.mul),
    ("truediv", operator.truediv),
    ("floordiv", operator.floordiv),
    ("mod", operator.mod),
    ("pow", operator.pow),
    ("matmul", operator.matmul),
    ("and", operator.and_),
    ("or", operator.or_),
    ("xor", operator.xor),
]:
    setattr(LazyValue, f"__{_name}__", _binary(_op))
    setattr(LazyValue, f"__r{_name}__", _binary(_op, swap=True))
for _name, _op in [
    ("lt", operator.lt),
    ("le", operator.le),
    ("gt", operator.gt),
    ("ge", operator.ge),
    ("eq", operator.eq),
    ("ne", operator.ne),
]:
    setattr(LazyValue, f"__{_name}__", _binary(_op))
for _name, _op in [
    ("neg", operator.neg),
    ("pos", operator.pos),
    ("abs", operator.abs),
    ("invert", operator.invert),
]:
    setattr(LazyValue, f"__{_name}__", lambda self, _op=_op: Lazy(_op, (self,), {}))
LazyValue.__hash__ = object.__hash__  # type: ignore[assignment]  (__eq__ above is lazy)

_METADATA = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "names"})


class RemoteValue(LazyValue):
    """The value of a location owned by another stage, for one request and round."""

    __slots__ = ("owner", "req", "key", "visit", "round", "where")

    def __init__(self, owner: int, req: int, key: int, visit: int, round: int, where: str):
        self._value = _UNSET
        self.owner = owner  # the stage that owns the location
        self.req = req  # the request's number (the same on every rank)
        self.key = key  # the location's wait key (index * 4 + kind)
        self.visit = visit  # the request's round and the call number (stage.visit_of)
        self.round = round  # the request's round the value belongs to
        self.where = where  # e.g. "model.layers.3.output"

    def leaves(self) -> list[RemoteValue]:
        return [self]

    def _compute(self) -> Any:
        return self._value

    def check_pullable(self) -> None:
        """Raise RemoteValueError where this value cannot be pulled now, saying why."""
        r = _resolver
        if r is None:
            raise RemoteValueError(f"{self.where} is owned by stage {self.owner} and cannot be pulled here")
        if not r.available(self):
            raise RemoteValueError(
                f"{self.where} is owned by stage {self.owner}, downstream of this stage "
                f"({r.stage()}), and does not exist yet in this round of the forward: write "
                f"`value = await asyncpp.pull(value)` to wait for it (the block resumes once stage "
                f"{self.owner} has run)"
            )

    def __repr__(self) -> str:
        state = "pulled" if self._value is not _UNSET else "not pulled"
        return f"<remote value {self.where} (owned by stage {self.owner}, {state})>"


class ElsewhereValue(RemoteValue):
    """A value only another stage can compute, because it holds what it takes (``m.std.unembed``
    on a stage without the model's head): that stage returns it in the block's result, but it
    cannot be pulled."""

    __slots__ = ()

    def __init__(self, owner: int, where: str):
        super().__init__(owner, -1, -1, -1, -1, where)

    def check_pullable(self) -> None:
        raise RemoteValueError(self.unavailable())

    def unavailable(self) -> str:
        return (
            f"{self.where} is computed on pipeline stage {self.owner} only, which holds what it "
            f"takes: return it (or values computed from it) from the block, where stage "
            f"{self.owner}'s value is taken; the other stages cannot use or pull it"
        )


class Lazy(LazyValue):
    """An operation on lazy values, run when the result is forced."""

    __slots__ = ("fn", "args", "kwargs", "_leaves", "has_real")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self._value = _UNSET
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        found: dict[int, RemoteValue] = {}
        real = [False]
        _collect(args, found, real)
        _collect(kwargs, found, real)
        self._leaves = list(found.values())
        self.has_real = real[0]  # a real tensor takes part (a local value, or a constant)

    def leaves(self) -> list[RemoteValue]:
        return self._leaves

    def _compute(self) -> Any:
        return self.fn(*_forced(self.args), **_forced(self.kwargs))

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", repr(self.fn))
        return f"<lazy {name}(...) of {self.describe()}>"


def pull_plan(obj: Any) -> list[tuple[LazyValue, RemoteValue, tuple]]:
    """The pulls that forcing ``obj`` takes, as ``(node, leaf, select)``: ``node``'s value is the
    remote value ``leaf``'s with the selection ``select`` applied (``node`` is ``leaf`` for an empty
    one). A chain of indexing and standard views over a remote value is a selection, which its
    owner applies so that only that part crosses; a remote value any other operation uses is
    pulled whole, once, and its selections are then computed here from it."""
    plan: list[tuple[LazyValue, RemoteValue, tuple]] = []
    seen: set[int] = set()
    whole: set[int] = set()

    def walk(x: Any) -> None:
        if isinstance(x, LazyValue):
            if x._value is not _UNSET or id(x) in seen:
                return
            seen.add(id(x))
            if isinstance(x, RemoteValue):
                plan.append((x, x, ()))
                whole.add(id(x))
                return
            found = _selection(x)
            if found is not None:
                plan.append((x, *found))
                return
            walk(x.args)
            walk(x.kwargs)
        elif isinstance(x, (tuple, list)):
            for o in x:
                walk(o)
        elif isinstance(x, dict):
            for o in x.values():
                walk(o)

    walk(obj)
    return [p for p in plan if not p[2] or id(p[1]) not in whole] if whole else plan


def _selection(node: Lazy) -> tuple[RemoteValue, tuple] | None:
    """``(leaf, select)`` when ``node`` is a chain of selections over a remote value not pulled
    yet, else None."""
    ops: list[tuple[str, Any]] = []
    x: Any = node
    while isinstance(x, Lazy):
        if x._value is not _UNSET or x.kwargs or not x.args:
            return None
        fn, args = x.fn, x.args
        if fn is operator.getitem and len(args) == 2 and selectable_key(args[1]):
            ops.append(("index", args[1]))
        elif (
            len(args) == 1
            and getattr(fn, "__name__", "") == "remote"
            and selectable_view(getattr(fn, "__self__", None))
        ):
            ops.append(("view", fn.__self__))
        else:
            return None
        x = args[0]
    if type(x) is not RemoteValue or x._value is not _UNSET:
        return None
    ops.reverse()
    return x, tuple(ops)


_UNPACK_SEQUENCE = dis.opmap["UNPACK_SEQUENCE"]


def _unpacking(frame: Any) -> int | None:
    """The element count when ``frame`` is unpacking a value into names (``a, b = value``), read
    from the instruction it is running; None for any other use (a loop, ``list(value)``)."""
    code, i = frame.f_code.co_code, frame.f_lasti
    if 0 <= i < len(code) - 1 and code[i] == _UNPACK_SEQUENCE:
        return code[i + 1]
    return None


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def pull(value: Any) -> Any:
    """``await asyncpp.pull(value)``: the value with every remote value in it pulled, waiting (at
    the next serve point) for the ones downstream stages produce in this round. A value without
    remote values comes back as it is, so the same line works on every stage and on one stage."""
    return _Pulling(value)


class _Pulling:
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __await__(self):
        value = self.value
        if isinstance(value, LazyValue):
            if value._value is not _UNSET:
                return value._value
            return (yield Pull(value))
        found: dict[int, RemoteValue] = {}
        _collect(value, found)
        if not found:
            return value
        return (yield Pull(Lazy(_forced, (value,), {})))


class Pull:
    """The trap of ``await lazy_value``: resume with the forced value (at a serve point if it
    cannot be pulled now)."""

    TRAP = PULL
    __slots__ = ("value",)

    def __init__(self, value: LazyValue):
        self.value = value

    def __await__(self):
        return (yield self)


def _collect(obj: Any, found: dict[int, RemoteValue], real: list[bool] | None = None) -> None:
    if isinstance(obj, LazyValue):
        for leaf in obj.leaves():
            found[id(leaf)] = leaf
        if real is not None and isinstance(obj, Lazy) and obj.has_real:
            real[0] = True
    elif isinstance(obj, torch.Tensor):
        if real is not None:
            real[0] = True
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _collect(o, found, real)
    elif isinstance(obj, dict):
        for o in obj.values():
            _collect(o, found, real)


def _forced(obj: Any) -> Any:
    if isinstance(obj, LazyValue):
        return obj.force()
    if type(obj) is tuple:
        return tuple(_forced(o) for o in obj)
    if type(obj) is list:
        return [_forced(o) for o in obj]
    if type(obj) is dict:
        return {k: _forced(v) for k, v in obj.items()}
    return obj


def _mutates_real(func: Callable, args: tuple) -> bool:
    """An in-place torch operation whose target is a real tensor (``out += lazy``)."""
    name = getattr(func, "__name__", "")
    inplace = (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
    return inplace and bool(args) and isinstance(args[0], torch.Tensor) and not isinstance(args[0], LazyValue)


_INPLACE_DUNDERS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
     "__ipow__", "__iand__", "__ior__", "__ixor__", "__imatmul__"}
)  # fmt: skip

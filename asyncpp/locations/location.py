"""Locations: the awaitable points of a model (a module's input, inputs or output).

``await m.model.layers[2].output`` parks the block until the model finishes that call of the module
and returns its value, narrowed to the block's rows. A location used without ``await`` fails loudly
on any tensor-like use, since that is the most common mistake in intervention code.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from ..kernel.errors import MissingAwaitError
from ..kernel.grad import GradWait
from ..kernel.interleaver import active_interleaver
from ..kernel.traps import Read, Write


class _NeedsAwait:
    """Every value-like use of an awaitable location fails with a message that says to await it
    (a forgotten ``await`` is the most common mistake in intervention code)."""

    __slots__ = ()

    def _missing(self, what: str) -> NoReturn:
        raise MissingAwaitError(
            f"{self.describe()} is a location, not a value ({what}): write `(await ...)` around it "
            f"to get the value"
        )

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        self._missing(f"it has no attribute .{name}")

    def __setitem__(self, key, value) -> NoReturn:
        self._missing("item assignment")

    def __bool__(self) -> NoReturn:
        self._missing("truth value")

    def __iter__(self) -> NoReturn:
        self._missing("iteration")

    def __len__(self) -> NoReturn:
        self._missing("len()")

    def __float__(self) -> NoReturn:
        self._missing("float()")

    def __int__(self) -> NoReturn:
        self._missing("int()")

    def __index__(self) -> NoReturn:
        self._missing("used as an index")

    def __array__(self, *a, **k) -> NoReturn:
        self._missing("numpy conversion")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None) -> NoReturn:
        for a in (*args, *(kwargs or {}).values()):
            if isinstance(a, _NeedsAwait):
                a._missing(f"passed to {getattr(func, '__name__', func)}")
        raise MissingAwaitError("a location was passed to a torch function: await it first")

    def __eq__(self, other) -> NoReturn:  # type: ignore[override]
        self._missing("comparison")

    __hash__ = object.__hash__


def _binary(op: str):
    def method(self, *other):
        self._missing(f"operator {op}")

    return method


for _op in (
    "add radd sub rsub mul rmul matmul rmatmul truediv rtruediv floordiv rfloordiv mod rmod pow rpow "
    "and rand or ror xor rxor lshift rlshift rshift rrshift neg pos abs invert lt le gt ge ne iadd "
    "isub imul itruediv"
).split():
    setattr(_NeedsAwait, f"__{_op}__", _binary(_op))


class Location(_NeedsAwait, Read):
    """A module's ``input``, ``inputs`` or ``output``, for one call (occurrence) of it.

    * ``await loc`` - the value (this invoke's rows of it).
    * ``loc.at(n)`` - the same location at the module's call ``n`` within the step (default 0).
    * ``loc[k]`` - element ``k`` of the value (a tuple output's element, a slice of a tensor).
    * ``await loc.set(value)`` - replace the value when the model reaches it (or now, if it is the
      location being served).
    * ``await loc.grad`` - the gradient flowing through it, in a backward pass the block drives
      (``async with asyncpp.backward(loss):``, traces with ``grad=True``).
    """

    __slots__ = ()

    def at(self, call: int) -> Location:
        """This location at call number ``call`` of the module (within the current step)."""
        if not isinstance(call, int) or call < 0:
            raise ValueError(f"{self.describe()}.at(): call number must be an int >= 0, got {call!r}")
        return Location(self.index, self.kind, self.path, call, self.keys)

    def __getitem__(self, key: Any) -> Location:
        return Location(self.index, self.kind, self.path, self.occ, (*self.keys, key))

    def set(self, value: Any) -> Write:
        """Replace the value at this location; must be awaited: ``await loc.set(value)``."""
        f = sys._getframe(1)
        write = Write(self, value, f"{f.f_code.co_filename}:{f.f_lineno}")
        kernel = active_interleaver()
        if kernel is not None and kernel.current is not None:
            kernel.current.writes.append(write)
        return write

    @property
    def grad(self) -> GradLocation:
        """The gradient of this location's value in the block's backward pass: ``await loc.grad``
        reads it, ``await loc.grad.set(g)`` replaces it."""
        return GradLocation(self, ())

    def __repr__(self) -> str:
        return f"<location {self.describe()}>"


class GradLocation(_NeedsAwait, GradWait):
    """``loc.grad``: awaitable inside ``async with asyncpp.backward(loss):``."""

    __slots__ = ()

    def set(self, value: Any) -> GradWait:
        """Replace the gradient flowing through this location; must be awaited."""
        f = sys._getframe(1)
        write = GradWait(self.target, self.grad_keys, value, True, f"{f.f_code.co_filename}:{f.f_lineno}")
        kernel = active_interleaver()
        if kernel is not None and kernel.current is not None:
            kernel.current.writes.append(write)
        return write

    def __repr__(self) -> str:
        return f"<location {self.describe()}>"

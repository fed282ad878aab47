"""Blocks an operator registers by name, with typed parameters that clients fill with data only.

```python
from typing import Annotated
from asyncpp.serve import MaxLen, Range, Registry, Tensor

blocks = Registry()

@blocks.block
async def steer(m, layer: Annotated[int, Range(0, 3)], vec: Tensor[torch.float32, (128,)], scale: float = 1.0):
    "Add scale * vec to the last position of one layer's output."
    out = await m.model.layers[layer].output
    out[:, -1] += scale * vec
    return (await m.logits)[:, -1].argmax(-1)

block, kwargs = blocks.bind("steer", {"layer": 2, "vec": torch.zeros(128)})   # checks, runs nothing
t.invoke(prompt, block, **kwargs)
```

The first parameter of a block is the model's location tree and is not a client parameter. Every
other parameter needs one of these annotations (checked when the block is registered, else a
``TypeError`` naming the block and the parameter):

- ``int``, ``float``, ``str``, ``bool``; ``Annotated[int | float, Range(lo, hi)]`` bounds a number,
  ``Annotated[str, MaxLen(n)]`` a string's length;
- ``list[int]`` (or ``float``, ``str``, ``bool``, each possibly ``Annotated`` itself), with
  ``Annotated[list[int], MaxLen(n)]`` for a maximum length;
- ``Tensor[dtype, max_shape]``: a tensor of exactly that dtype (``torch.float32`` or its name
  ``"float32"``; see :data:`DTYPES`) with ``len(max_shape)`` dimensions, each at most its entry
  (``None``: any size). Linters (ruff, pyflakes) read a string inside an annotation as a forward
  reference (``F821 undefined name 'float32'``), so prefer the ``torch`` dtype there;
- any of these ``| None`` (``Optional[...]``), which accepts ``null``.

A parameter with a default may be left out by the client. :meth:`Registry.bind` checks a client's
arguments the way JSON types them: ``true`` is not an ``int``, an ``int`` is accepted (and converted)
for a ``float``, a list may not be longer than its ``MaxLen``, a tensor must have the declared dtype,
number of dimensions and sizes. Every failure is a :class:`BlockArgumentError` naming the block, the
parameter and what was expected.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, NamedTuple, Union

import torch

from ..kernel.errors import AsyncppError

__all__ = [
    "BlockArgumentError",
    "BlockSpec",
    "Bound",
    "MaxLen",
    "ParamSpec",
    "Range",
    "Registry",
    "Tensor",
    "UnknownBlockError",
    "block",
    "load_module",
]


class BlockArgumentError(AsyncppError, ValueError):
    """A client's block name or arguments do not match what the operator registered.

    ``block`` and ``parameter`` name what failed (``parameter`` is ``None`` for a problem with the
    request as a whole, such as an unknown block or arguments that are not an object)."""

    def __init__(self, message: str, *, block: str | None = None, parameter: str | None = None):
        super().__init__(message)
        self.block = block
        self.parameter = parameter


class UnknownBlockError(BlockArgumentError):
    """A client named a block that is not registered (the message lists the registered ones)."""


# dtype names a Tensor annotation (and the wire format) accepts, and their torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


_JSON_KINDS = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    list: "list",
    tuple: "list",
    dict: "object",
    type(None): "null",
}


def json_kind(value: Any) -> str:
    """A client value's JSON type name, as error messages give it."""
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    """A client value as error messages show it: its JSON-ish type and a short repr."""
    if isinstance(value, torch.Tensor):
        dtype = DTYPE_NAMES.get(value.dtype, str(value.dtype).removeprefix("torch."))
        return f"a {dtype} tensor of shape {tuple(value.shape)}"
    kind = json_kind(value)
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


# ---------------------------------------------------------------------------------------------
# Annotation helpers


class MaxLen:
    """``Annotated[list[int], MaxLen(16)]``: at most ``n`` items (characters, for a ``str``)."""

    def __init__(self, n: int):
        if type(n) is not int or n < 0:
            raise TypeError(f"MaxLen needs an int >= 0, got {n!r}")
        self.n = n

    def __repr__(self) -> str:
        return f"MaxLen({self.n})"


class Range:
    """``Annotated[int, Range(0, 3)]``: a number in ``[lo, hi]`` (either end may be ``None``)."""

    def __init__(self, lo: int | float | None = None, hi: int | float | None = None):
        for end in (lo, hi):
            if end is not None and (type(end) not in (int, float) or not math.isfinite(end)):
                raise TypeError(f"Range needs finite numbers or None, got {end!r}")
        if lo is not None and hi is not None and lo > hi:
            raise TypeError(f"Range({lo!r}, {hi!r}) is empty")
        self.lo = lo
        self.hi = hi

    def __repr__(self) -> str:
        return f"Range({self.lo!r}, {self.hi!r})"


class _TensorAnnotation:
    """Base of the classes ``Tensor[dtype, max_shape]`` makes (one per distinct declaration)."""

    dtype_name: str = ""
    max_shape: tuple[int | None, ...] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("Tensor[...] is a parameter annotation for registered blocks, not a constructor")


@functools.cache
def _tensor_annotation(dtype_name: str, max_shape: tuple[int | None, ...]) -> type:
    dims = ", ".join("None" if d is None else str(d) for d in max_shape)
    name = f"Tensor[{dtype_name!r}, ({dims}{',' if len(max_shape) == 1 else ''})]"
    return type(name, (_TensorAnnotation,), {"dtype_name": dtype_name, "max_shape": max_shape})


class Tensor:
    """``Tensor[torch.float32, (128,)]`` (or ``Tensor["float32", (128,)]``): a tensor parameter of
    that dtype and at most that shape.

    ``max_shape`` has one entry per dimension (the number of dimensions must match exactly): the
    largest size allowed there, or ``None`` for any size. ``Tensor["int64", ()]`` is a 0-d tensor.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError('Tensor is used as an annotation: Tensor["float32", (128,)]')

    def __class_getitem__(cls, params: Any) -> type:
        if not isinstance(params, tuple) or len(params) != 2:
            raise TypeError(
                f'Tensor[...] takes a dtype and a max shape, e.g. Tensor["float32", (128,)]; got {params!r}'
            )
        dtype, max_shape = params
        if isinstance(dtype, torch.dtype):
            if dtype not in DTYPE_NAMES:
                raise TypeError(
                    f"Tensor[...]: dtype {dtype} is not supported; use one of {', '.join(DTYPES)}"
                )
            dtype = DTYPE_NAMES[dtype]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise TypeError(f"Tensor[...]: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        if not isinstance(max_shape, tuple | list):
            raise TypeError(
                f"Tensor[...]: the max shape must be a tuple such as (128,) or (None, 64), got {max_shape!r}"
            )
        for d in max_shape:
            if d is not None and (type(d) is not int or d < 0):
                raise TypeError(f"Tensor[...]: each max shape entry must be an int >= 0 or None, got {d!r}")
        return _tensor_annotation(dtype, tuple(max_shape))


# ---------------------------------------------------------------------------------------------
# Parameter types: each checks (and normalizes) a client's value, and describes itself as JSON.


class _Fail(Exception):
    """Raised by a type check with what was expected; turned into a BlockArgumentError by bind."""


class _Type:
    def check(self, value: Any) -> Any:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def expected(self) -> str:
        raise NotImplementedError


class _Bool(_Type):
    def check(self, value: Any) -> Any:
        if type(value) is not bool:
            raise _Fail(f"expected bool, got {_short(value)}")
        return value

    def describe(self) -> dict[str, Any]:
        return {"type": "bool"}

    def expected(self) -> str:
        return "bool"


class _Number(_Type):
    def __init__(self, kind: type, bounds: Range | None = None):
        self.kind = kind
        self.bounds = bounds

    def expected(self) -> str:
        name = self.kind.__name__
        if self.bounds is None:
            return name
        lo, hi = self.bounds.lo, self.bounds.hi
        if lo is not None and hi is not None:
            return f"{name} in [{lo}, {hi}]"
        return f"{name} >= {lo}" if lo is not None else f"{name} <= {hi}"

    def check(self, value: Any) -> Any:
        if self.kind is int:
            ok = type(value) is int
        else:  # float: a JSON int is a number too (converted); a bool is not
            ok = type(value) in (int, float)
        if not ok:
            raise _Fail(f"expected {self.expected()}, got {_short(value)}")
        if self.kind is float and type(value) is int:
            try:
                value = float(value)
            except OverflowError:
                raise _Fail(f"expected {self.expected()}, got an int too large for a float") from None
        if self.bounds is not None:
            lo, hi = self.bounds.lo, self.bounds.hi
            if (lo is not None and not value >= lo) or (hi is not None and not value <= hi):
                raise _Fail(f"expected {self.expected()}, got {_short(value)}")
        return value

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind.__name__}
        if self.bounds is not None:
            if self.bounds.lo is not None:
                out["min"] = self.bounds.lo
            if self.bounds.hi is not None:
                out["max"] = self.bounds.hi
        return out


class _Str(_Type):
    def __init__(self, max_len: int | None = None):
        self.max_len = max_len

    def expected(self) -> str:
        return "str" if self.max_len is None else f"str of at most {self.max_len} characters"

    def check(self, value: Any) -> Any:
        if type(value) is not str:
            raise _Fail(f"expected {self.expected()}, got {_short(value)}")
        if self.max_len is not None and len(value) > self.max_len:
            raise _Fail(f"expected {self.expected()}, got a str of {len(value)} characters")
        return value

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "str"}
        if self.max_len is not None:
            out["max_len"] = self.max_len
        return out


class _List(_Type):
    def __init__(self, item: _Type, max_len: int | None = None):
        self.item = item
        self.max_len = max_len

    def expected(self) -> str:
        limit = "" if self.max_len is None else f" of at most {self.max_len} items"
        return f"list[{self.item.expected()}]{limit}"

    def check(self, value: Any) -> Any:
        if type(value) not in (list, tuple):
            raise _Fail(f"expected {self.expected()}, got {_short(value)}")
        if self.max_len is not None and len(value) > self.max_len:
            raise _Fail(f"expected {self.expected()}, got a list of {len(value)} items")
        out = []
        for i, item in enumerate(value):
            try:
                out.append(self.item.check(item))
            except _Fail as e:
                raise _Fail(f"item {i}: {e}") from None
        return out

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "list", "items": self.item.describe()}
        if self.max_len is not None:
            out["max_len"] = self.max_len
        return out


class _Tensor(_Type):
    def __init__(self, dtype_name: str, max_shape: tuple[int | None, ...]):
        self.dtype_name = dtype_name
        self.dtype = DTYPES[dtype_name]
        self.max_shape = max_shape

    def expected(self) -> str:
        dims = ", ".join("any" if d is None else f"<= {d}" for d in self.max_shape)
        return f"a {self.dtype_name} tensor with {len(self.max_shape)} dims ({dims})"

    def check(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            raise _Fail(f"expected {self.expected()}, got {_short(value)}")
        if value.layout is not torch.strided:
            raise _Fail(f"expected {self.expected()}, got a {value.layout} tensor")
        if value.dtype != self.dtype:
            raise _Fail(f"expected {self.expected()}, got {_short(value)} (wrong dtype)")
        if value.dim() != len(self.max_shape):
            raise _Fail(f"expected {self.expected()}, got {_short(value)} ({value.dim()} dims)")
        for i, (size, limit) in enumerate(zip(value.shape, self.max_shape)):
            if limit is not None and size > limit:
                raise _Fail(f"expected {self.expected()}, got {_short(value)} (dim {i} is {size} > {limit})")
        return value

    def describe(self) -> dict[str, Any]:
        return {"type": "tensor", "dtype": self.dtype_name, "max_shape": list(self.max_shape)}


def _parse(annotation: Any) -> tuple[_Type, bool]:
    """(type, nullable) for a parameter annotation; ``_Fail`` with the reason if it is not allowed."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *meta = typing.get_args(annotation)
        kind, nullable = _parse(base)
        for item in meta:
            if isinstance(item, MaxLen) and isinstance(kind, _Str | _List):
                kind.max_len = item.n
            elif isinstance(item, Range) and isinstance(kind, _Number):
                kind.bounds = item
            else:
                raise _Fail(
                    f"Annotated metadata {item!r} does not apply to {kind.expected()} "
                    "(MaxLen applies to str and list, Range to int and float)"
                )
        return kind, nullable
    if origin in (Union, types.UnionType):
        args = typing.get_args(annotation)
        others = [a for a in args if a is not type(None)]
        if len(others) == 1 and len(args) == 2:
            kind, _ = _parse(others[0])
            return kind, True
        raise _Fail(f"{annotation!r}: only X | None unions are allowed (use one type per parameter)")
    if origin is list:
        args = typing.get_args(annotation)
        if len(args) != 1:
            raise _Fail("list needs an item type: list[int], list[float], list[str] or list[bool]")
        item, nullable = _parse(args[0])
        if nullable or not isinstance(item, _Bool | _Number | _Str):
            raise _Fail(f"list items must be int, float, str or bool, not {args[0]!r}")
        return _List(item), False
    if annotation is bool:
        return _Bool(), False
    if annotation is int or annotation is float:
        return _Number(annotation), False
    if annotation is str:
        return _Str(), False
    if isinstance(annotation, type) and issubclass(annotation, _TensorAnnotation):
        return _Tensor(annotation.dtype_name, annotation.max_shape), False
    if annotation is list:
        raise _Fail("list needs an item type: list[int], list[float], list[str] or list[bool]")
    if annotation is torch.Tensor or annotation is Tensor:
        raise _Fail('a tensor parameter needs a dtype and a max shape: Tensor["float32", (128,)]')
    raise _Fail(
        f"type {getattr(annotation, '__name__', annotation)!r} is not allowed; use int, float, str, bool, "
        'list[...] of those, Tensor["dtype", max_shape], or one of them | None'
    )


_REQUIRED: Any = inspect.Parameter.empty


class ParamSpec:
    """One client parameter of a registered block: its name, type, default and limits."""

    def __init__(self, name: str, kind: _Type, nullable: bool, default: Any = _REQUIRED):
        self.name = name
        self.kind = kind
        self.nullable = nullable
        self.default = default

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def check(self, value: Any) -> Any:
        if value is None:
            if self.nullable:
                return None
            raise _Fail(f"expected {self.kind.expected()}, got null")
        return self.kind.check(value)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, **self.kind.describe(), "nullable": self.nullable}
        out["required"] = self.required
        if not self.required:
            out["default"] = list(self.default) if isinstance(self.default, tuple) else self.default
        return out

    def __repr__(self) -> str:
        return f"ParamSpec({self.name!r}, {self.kind.expected()}{' | None' if self.nullable else ''})"


class BlockSpec:
    """A registered block: its name, the ``async def`` function and its client parameters."""

    def __init__(self, name: str, fn: Callable[..., Any], params: tuple[ParamSpec, ...], doc: str):
        self.name = name
        self.fn = fn
        self.params = params
        self.doc = doc
        self._by_name = {p.name: p for p in params}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "doc": self.doc, "params": [p.describe() for p in self.params]}

    def __repr__(self) -> str:
        return f"BlockSpec({self.name!r}, params={[p.name for p in self.params]})"


def _spec(fn: Any, name: str | None) -> BlockSpec:
    """Check a block's declaration and build its spec; ``TypeError`` naming the block and parameter."""
    label = name or getattr(fn, "__name__", None) or repr(fn)
    if name is None:
        name = getattr(fn, "__name__", None)
        if not isinstance(name, str) or name == "<lambda>":
            raise TypeError(f"block {label}: give it a name (registry.block(name=...))")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"block name {name!r} is not allowed (letters, digits, '_', '.', '-', not starting with a digit)"
        )
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"block {name!r} must be an `async def` function, got {type(fn).__name__} {label}")
    try:
        sig = inspect.signature(fn, eval_str=True)
    except (NameError, SyntaxError, AttributeError, TypeError) as e:
        raise TypeError(f"block {name!r}: cannot read its parameter annotations: {e}") from e
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise TypeError(
            f"block {name!r}: its first parameter must be the model tree (async def {name}(m, ...))"
        )
    out: list[ParamSpec] = []
    for p in params[1:]:
        where = f"block {name!r}, parameter {p.name!r}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            star = "*" if p.kind is p.VAR_POSITIONAL else "**"
            raise TypeError(f"{where}: {star}{p.name} is not allowed; declare each parameter with its type")
        if p.kind is p.POSITIONAL_ONLY:
            raise TypeError(f"{where}: positional-only parameters cannot be passed by name by a client")
        if p.annotation is p.empty:
            raise TypeError(
                f"{where}: needs a type annotation (int, float, str, bool, list[...], Tensor[...])"
            )
        try:
            kind, nullable = _parse(p.annotation)
        except _Fail as e:
            raise TypeError(f"{where}: {e}") from None
        spec = ParamSpec(p.name, kind, nullable)
        if p.default is not p.empty:
            default = p.default
            if isinstance(kind, _Tensor) and default is not None:
                raise TypeError(f"{where}: a tensor parameter's default can only be None")
            if type(default) is float and not math.isfinite(default):
                raise TypeError(
                    f"{where}: the default {default!r} is not a finite number (not representable in JSON)"
                )
            try:
                default = spec.check(default)
            except _Fail as e:
                raise TypeError(f"{where}: the default {default!r} does not fit its type: {e}") from None
            spec.default = tuple(default) if isinstance(default, list) else default
        out.append(spec)
    doc = inspect.getdoc(fn) or ""
    return BlockSpec(name, fn, tuple(out), doc.strip().splitlines()[0] if doc.strip() else "")


_MARK = "__asyncpp_block__"


def _mark(fn: Any, spec: BlockSpec) -> bool:
    try:
        setattr(fn, _MARK, spec)
    except (AttributeError, TypeError):
        return False
    return True


def block(fn: Any = None, *, name: str | None = None) -> Any:
    """Mark an ``async def`` block for :func:`load_module` without a :class:`Registry`.

    ``@block`` or ``@block(name="steer")``; the declaration is checked here, as by
    :meth:`Registry.block`. The function is returned unchanged (it can still be invoked locally).
    """

    def deco(f: Any) -> Any:
        spec = _spec(f, name)
        if not _mark(f, spec):
            raise TypeError(f"block {spec.name!r}: cannot mark {f!r}; register it with Registry.add instead")
        return f

    return deco if fn is None else deco(fn)


class Bound(NamedTuple):
    """What :meth:`Registry.bind` returns: ``block, kwargs = registry.bind(...)``."""

    block: Callable[..., Any]
    kwargs: dict[str, Any]


class Registry:
    """The named blocks a server runs; clients reach only these, with checked data arguments."""

    def __init__(self) -> None:
        self._blocks: dict[str, BlockSpec] = {}

    # registration ------------------------------------------------------------------------------

    def block(self, fn: Any = None, *, name: str | None = None) -> Any:
        """Decorator: ``@registry.block`` or ``@registry.block(name="steer")``. Returns ``fn``."""

        def deco(f: Any) -> Any:
            self.add(f, name=name)
            return f

        return deco if fn is None else deco(fn)

    def add(self, fn: Any, name: str | None = None) -> BlockSpec:
        """Register ``fn`` (an ``async def`` block, bound method or partial) under ``name``."""
        spec = _spec(fn, name)
        self._insert(spec)
        _mark(fn, spec)
        return spec

    def _insert(self, spec: BlockSpec) -> None:
        old = self._blocks.get(spec.name)
        if old is not None and (old is spec or old.fn == spec.fn):
            return  # the same block again
        if old is not None:
            raise ValueError(f"a block named {spec.name!r} is already registered ({old.fn!r})")
        self._blocks[spec.name] = spec

    def update(self, other: Registry) -> None:
        """Add every block of ``other`` (a name registered in both for different blocks: ValueError)."""
        for spec in other:
            self._insert(spec)

    # lookup -------------------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._blocks

    def __getitem__(self, name: str) -> BlockSpec:
        return self._blocks[name]

    def __iter__(self) -> Iterator[BlockSpec]:
        return iter(list(self._blocks.values()))

    def __len__(self) -> int:
        return len(self._blocks)

    def names(self) -> list[str]:
        return list(self._blocks)

    def __repr__(self) -> str:
        return f"Registry({self.names()})"

    def describe(self) -> list[dict[str, Any]]:
        """A JSON-able description of every block, in registration order: name, the docstring's
        first line, and each parameter's name, type, limits, nullability and default."""
        return [spec.describe() for spec in self._blocks.values()]

    # binding ------------------------------------------------------------------------------------

    def bind(self, name: Any, args: Mapping[str, Any] | None) -> Bound:
        """Check a client's request for block ``name`` with arguments ``args`` (decoded data: JSON
        values and tensors) against the block's declaration, before anything runs.

        Returns ``(block, kwargs)`` for ``t.invoke(prompt, block, **kwargs)``: the registered function
        and the checked arguments (ints given for floats converted, lists as lists; parameters left
        out take the function's own defaults). Raises :class:`BlockArgumentError`
        (:class:`UnknownBlockError` for a name that is not registered)."""
        if not isinstance(name, str):
            raise BlockArgumentError(f"the block name must be a string, got {_short(name)}")
        spec = self._blocks.get(name)
        if spec is None:
            known = ", ".join(self._blocks) or "(none)"
            close = difflib.get_close_matches(name, list(self._blocks), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UnknownBlockError(f"no block named {name!r}{hint} (registered blocks: {known})", block=name)
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise BlockArgumentError(
                f"block {name!r}: the arguments must be an object of parameter names to values, got {_short(args)}",
                block=name,
            )
        declared = ", ".join(p.name for p in spec.params) or "(none)"
        for key in args:
            if not isinstance(key, str) or key not in spec._by_name:
                raise BlockArgumentError(
                    f"block {name!r} has no parameter {key!r} (its parameters: {declared})",
                    block=name,
                    parameter=key if isinstance(key, str) else None,
                )
        kwargs: dict[str, Any] = {}
        for p in spec.params:
            if p.name not in args:
                if p.required:
                    raise BlockArgumentError(
                        f"block {name!r}, parameter {p.name!r}: missing (expected "
                        f"{p.kind.expected()}{' or null' if p.nullable else ''})",
                        block=name,
                        parameter=p.name,
                    )
                continue
            try:
                kwargs[p.name] = p.check(args[p.name])
            except _Fail as e:
                raise BlockArgumentError(
                    f"block {name!r}, parameter {p.name!r}: {e}", block=name, parameter=p.name
                ) from None
        return Bound(spec.fn, kwargs)


# ---------------------------------------------------------------------------------------------
# Loading an operator's module


def _import(target: str) -> types.ModuleType:
    path = Path(target)
    if target.endswith(".py") or path.is_file() or "/" in target or "\\" in target:
        if not path.is_file():
            raise FileNotFoundError(f"blocks module {target!r}: no such file")
        path = path.resolve()
        modname = f"_asyncpp_blocks_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{abs(hash(str(path))):x}"
        if modname in sys.modules:
            return sys.modules[modname]
        spec = importlib.util.spec_from_file_location(modname, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"blocks module {target!r}: cannot be loaded as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module  # so the module's own dataclasses, annotations etc. resolve
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[modname]
            raise
        return module
    return importlib.import_module(target)


def load_module(target: str | types.ModuleType) -> Registry:
    """The blocks an operator's module registers, as one :class:`Registry`.

    ``target`` is a file path (``blocks.py``), a dotted module name (``mypkg.blocks``) or a module.
    Every :class:`Registry` among the module's globals and every function marked with :func:`block`
    is collected (in the module's order); two different blocks under one name are a ``ValueError``,
    as is a module that registers no block."""
    module = target if isinstance(target, types.ModuleType) else _import(target)
    out = Registry()
    for value in list(vars(module).values()):
        if isinstance(value, Registry):
            out.update(value)
        else:
            try:  # a module global may be anything, with any __getattr__
                spec = getattr(value, _MARK, None) if callable(value) else None
            except Exception:
                spec = None
            if isinstance(spec, BlockSpec):
                out._insert(spec)
    if not len(out):
        raise ValueError(
            f"blocks module {module.__name__!r} registers no blocks: decorate `async def` blocks with "
            "@registry.block (registry = asyncpp.serve.Registry()) or @asyncpp.serve.block"
        )
    return out

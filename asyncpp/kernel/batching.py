"""Row narrowing on read and widening on write.

A block that owns rows ``[a, b)`` of the batch sees every tensor whose first dimension is the batch
size as the view ``t[a:b]`` (so in-place edits land in the model), inside tuples, lists, named tuples
and dicts alike. Tensors of any other leading size are shared by the whole batch and are passed as
they are. A block with ``rows=None`` sees the whole batch, untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from .errors import MissingAwaitError, WriteError
from .views import ValueView

_native_narrow: Any = None  # csrc/rows.cpp's narrow_rows, once the native extension is loaded


def use_native(native: Any) -> None:
    """Let :func:`narrow` hand tensors, tuples and lists to the native implementation
    (``native.narrow_rows``), which hands back the containers it does not build itself."""
    global _native_narrow
    _native_narrow = native.narrow_rows
    native.set_narrow_fallback(_narrow_rows)


def _narrow_rows(value: Any, start: int, stop: int, batch: int) -> Any:
    return narrow(value, (start, stop), batch)


def narrow(value: Any, rows: tuple[int, int] | None, batch: int) -> Any:
    """Return ``value`` restricted to ``rows`` (views, no copies)."""
    if rows is None:
        return value
    t = type(value)
    if _native_narrow is not None and (t is Tensor or t is tuple or t is list):
        return _native_narrow(value, rows[0], rows[1], batch)
    if t is Tensor or isinstance(value, Tensor):
        if value.ndim and value.shape[0] == batch:
            return value[rows[0] : rows[1]]
        return value
    if t is tuple:  # the common container (vLLM's (hidden, residual), a linear's (out, bias))
        a, b = rows
        return tuple(
            [
                (v[a:b] if v.ndim and v.shape[0] == batch else v)
                if type(v) is Tensor
                else narrow(v, rows, batch)
                for v in value
            ]
        )
    if isinstance(value, (tuple, list, dict)):
        return _map(value, lambda x: narrow(x, rows, batch))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: narrow(getattr(value, f.name), rows, batch) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    return value


def widen(
    full: Any, new: Any, rows: tuple[int, int] | None, batch: int, where: str, build: bool = True
) -> Any:
    """Return ``full`` with the rows ``rows`` replaced by ``new`` (out of place); with
    ``build=False`` only check that ``new`` fits (raising the same errors), and return None."""
    if new is full:
        return new
    if rows is None:
        _check_shapes(full, new, where)
        return new
    if isinstance(full, Tensor) and full.dim() and full.shape[0] == batch:
        a, b = rows
        part = full[a:b]
        if (
            isinstance(new, Tensor)
            and new.data_ptr() == part.data_ptr()
            and new.shape == part.shape
            and new.stride() == part.stride()
        ):
            return full  # the block's own view, already edited in place
        if not isinstance(new, Tensor) or new.shape != part.shape:
            shape = tuple(new.shape) if isinstance(new, Tensor) else type(new).__name__
            raise WriteError(
                f"{where}: the replacement has shape {shape}, but this invoke's rows {a}:{b} of the "
                f"value have shape {tuple(part.shape)}"
            )
        if not build:
            return None
        out = full.clone()
        out[a:b] = new
        return out
    if isinstance(full, (tuple, list)) and isinstance(new, (tuple, list)):
        if len(full) != len(new):
            raise WriteError(f"{where}: the replacement has {len(new)} elements, the value has {len(full)}")
        items = [widen(f, n, rows, batch, f"{where}[{i}]", build) for i, (f, n) in enumerate(zip(full, new))]
        return _rebuild(full, items) if build else None
    if isinstance(full, dict) and isinstance(new, dict):
        if full.keys() != new.keys():
            raise WriteError(f"{where}: the replacement's keys {list(new)} differ from {list(full)}")
        items = {k: widen(full[k], new[k], rows, batch, f"{where}[{k!r}]", build) for k in full}
        return _rebuild(full, items) if build else None
    if new is not full and not _same_leaf(full, new):
        raise WriteError(
            f"{where}: this value is shared by the whole batch; an invoke that owns only rows "
            f"{rows[0]}:{rows[1]} cannot replace it (invoke without input to see the whole batch)"
        )
    return full


def _check_shapes(full: Any, new: Any, where: str) -> None:
    """A whole-batch replacement must keep the shape of every tensor it replaces."""
    if isinstance(full, Tensor) and isinstance(new, Tensor):
        if full.shape != new.shape:
            raise WriteError(
                f"{where}: the replacement has shape {tuple(new.shape)}, the value it replaces has "
                f"shape {tuple(full.shape)}"
            )
    elif isinstance(full, (tuple, list)) and isinstance(new, (tuple, list)) and len(full) == len(new):
        for i, (f, n) in enumerate(zip(full, new)):
            _check_shapes(f, n, f"{where}[{i}]")


def get_item(value: Any, keys: tuple, block: Any = None) -> Any:
    """Index ``value`` by each key in turn (the element path of a sub-location); a
    :class:`~.views.ValueView` key presents the value reached so far (to ``block``)."""
    for k in keys:
        value = k.present(value, block) if isinstance(k, ValueView) else value[k]
    return value


def put_at(
    full: Any,
    keys: tuple,
    new: Any,
    rows: tuple[int, int] | None,
    batch: int,
    where: str,
    block: Any = None,
) -> Any:
    """Return ``full`` with the element at ``keys`` replaced by ``new`` for the given rows.

    Keys that index containers (a tuple output's element) rebuild the container; once a tensor or
    a value view is reached, the remaining keys index the block's own rows of it and the
    assignment is in place.
    """
    if not keys:
        return widen(full, new, rows, batch, where)
    k = keys[0]
    if isinstance(full, Tensor) or isinstance(k, ValueView):
        own = narrow(full, rows, batch)
        last = keys[-1]
        if isinstance(last, ValueView):
            last.write(get_item(own, keys[:-1], block), new, block, where)
        else:
            get_item(own, keys[:-1], block)[last] = new
        return full
    child = put_at(full[k], keys[1:], new, rows, batch, where, block)
    if isinstance(full, dict):
        items = dict(full)
        items[k] = child
        return _rebuild(full, items)
    items = list(full)
    items[k] = child
    return _rebuild(full, items)


def detach(value: Any) -> Any:
    """Copy a block's result out of the model's buffers: tensors are detached and cloned."""
    t = type(value)
    if t is Tensor or isinstance(value, Tensor):
        return value.detach().clone() if value.requires_grad else value.clone()
    if t is list or t is tuple:
        items = [
            (v.clone() if not v.requires_grad else v.detach().clone()) if type(v) is Tensor else detach(v)
            for v in value
        ]
        return items if t is list else tuple(items)
    if isinstance(value, (tuple, list, dict)):
        return _map(value, detach)
    if getattr(value, "TRAP", None) is not None and hasattr(value, "describe"):
        raise MissingAwaitError(
            f"the block returned the location object {value.describe()} instead of its value: "
            f"add `await` in front of it"
        )
    return value


def copy(value: Any) -> Any:
    """A copy of every tensor in ``value`` (structure kept), for the model to edit in place."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (tuple, list, dict)):
        return _map(value, copy)
    return value


def _same_leaf(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def _map(value: Any, fn) -> Any:
    if isinstance(value, dict):
        return _rebuild(value, {k: fn(v) for k, v in value.items()})
    return _rebuild(value, [fn(v) for v in value])


def _rebuild(like: Any, items: Any) -> Any:
    """Build a container of ``like``'s type from ``items`` (a list, or a dict for mappings)."""
    t = type(like)
    if isinstance(like, dict):
        if t is dict:
            return items
        try:
            return t(**items)  # dataclass-style mappings (Hugging Face ModelOutput)
        except TypeError:
            try:
                return t(items)
            except TypeError:
                return dict(items)
    if t is tuple or t is list:
        return t(items)
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return t(*items)
    try:
        return t(items)
    except TypeError:
        return type(items)(items)

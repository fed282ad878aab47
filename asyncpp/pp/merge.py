"""Merge the per-stage results of one block run on a pipeline-parallel engine.

Every pipeline stage runs the same user block. A stage only owns some of the values the block
touches; the others come back as :data:`NOT_HERE`. :func:`merge` folds the per-stage results
(in stage order) into the one result the user sees:

- :data:`NOT_HERE` loses to anything real; a slot that no stage owns stays :data:`NOT_HERE`.
- dicts are united by key (first appearance in stage order) and merged key by key; lists are
  merged by position (a longer list contributes its extra positions); tuples, named tuples and
  torch ``return_types`` are merged element-wise when every stage has the same type and length.
- anything else is a leaf. Equal leaves (tensors: dtype, shape and values, NaN == NaN; floats
  NaN-aware; others ``==``) keep the first; leaves that genuinely differ raise a
  :class:`RankDivergenceWarning` naming the slot and the stages, and the value of the highest
  stage that has one wins: late values (logits, last layers) are owned downstream.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Any

import torch

__all__ = ["NOT_HERE", "RankDivergenceWarning", "merge"]


class _NotHere:
    """The type of :data:`NOT_HERE`: a value this pipeline stage does not own."""

    __slots__ = ()
    _instance: _NotHere | None = None

    def __new__(cls) -> _NotHere:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<not on this rank>"

    def __reduce__(self) -> str:
        # A string makes pickle (and cloudpickle) store a reference to the module-level name,
        # so unpickling gives back the singleton itself.
        return "NOT_HERE"

    def __copy__(self) -> _NotHere:
        return self

    def __deepcopy__(self, memo: dict) -> _NotHere:
        return self


NOT_HERE: _NotHere = _NotHere()
"""Stands in for a value the stage that produced a result does not own."""


class RankDivergenceWarning(UserWarning):
    """Two or more pipeline stages returned different real values for the same slot."""


# A path is a tuple: (where, *segments); a segment is ("key", k), ("index", i) or ("field", name).
# Formatting is deferred until a warning needs it.
_Path = tuple


def merge(values: list, where: str = "result") -> Any:
    """Merge one result per pipeline stage (in stage order) into one result.

    Leaves that differ between stages warn with :class:`RankDivergenceWarning` (naming the slot,
    e.g. ``result['logits'][2]``, and the stages) and resolve to the value of the highest stage
    that has one, since the owner of late values is usually downstream. Returns :data:`NOT_HERE`
    when no stage has a real value; the caller decides whether that is an error.
    """
    divergences: list[tuple[_Path, list[tuple[int, Any]], int]] = []
    out = _merge(list(values), (where,), divergences)
    for path, real, kept in divergences:
        warnings.warn(_divergence_message(path, real, kept), RankDivergenceWarning, stacklevel=2)
    return out


def _merge(vals: list, path: _Path, divergences: list) -> Any:
    """Merge ``vals`` (one per stage, NOT_HERE where missing) at ``path``."""
    real = [(stage, v) for stage, v in enumerate(vals) if v is not NOT_HERE]
    if not real:
        return NOT_HERE
    if len(real) == 1:
        return real[0][1]
    first = real[0][1]
    kind = type(first)
    same_type = all(type(v) is kind for _, v in real)
    if isinstance(first, dict) and all(isinstance(v, dict) for _, v in real):
        return _merge_dicts(vals, first if same_type else None, path, divergences)
    if same_type and isinstance(first, list):
        return _merge_lists(vals, real, path, divergences)
    if same_type and isinstance(first, tuple) and all(len(v) == len(first) for _, v in real):
        rebuilt = _merge_tuple(vals, first, path, divergences)
        if rebuilt is not None:
            return rebuilt
    return _merge_leaf(real, path, divergences)


def _merge_dicts(vals: list, proto: dict | None, path: _Path, divergences: list) -> dict:
    keys: dict = {}  # insertion-ordered set: first appearance in stage order
    for v in vals:
        if v is not NOT_HERE:
            keys.update(dict.fromkeys(v))
    out = _new_dict(proto)
    for k in keys:
        per_stage = [NOT_HERE if v is NOT_HERE else v.get(k, NOT_HERE) for v in vals]
        out[k] = _merge(per_stage, (*path, ("key", k)), divergences)
    return out


def _new_dict(proto: dict | None) -> dict:
    """An empty dict of ``proto``'s type where that is easy to build, else a plain dict."""
    if proto is None or type(proto) is dict:
        return {}
    try:
        if isinstance(proto, defaultdict):
            return type(proto)(proto.default_factory)
        return type(proto)()
    except Exception:
        return {}


def _merge_lists(vals: list, real: list, path: _Path, divergences: list) -> list:
    length = max(len(v) for _, v in real)
    items = []
    for i in range(length):
        per_stage = [NOT_HERE if v is NOT_HERE or i >= len(v) else v[i] for v in vals]
        items.append(_merge(per_stage, (*path, ("index", i)), divergences))
    kind = type(real[0][1])
    if kind is list:
        return items
    try:
        return kind(items)
    except Exception:
        return items


def _merge_tuple(vals: list, first: tuple, path: _Path, divergences: list) -> tuple | None:
    """Merge same-type, same-length tuples element-wise; None if the type cannot be rebuilt."""
    kind = type(first)
    if kind is tuple:
        fields = None
        build = tuple
    elif hasattr(kind, "_make") and hasattr(kind, "_fields"):  # named tuple
        fields = kind._fields
        build = kind._make
    elif getattr(kind, "n_sequence_fields", None) is not None and getattr(kind, "n_fields", None) == len(
        first
    ):
        # structseq (torch.return_types.*): every field is a sequence field, so it rebuilds whole
        fields = getattr(kind, "__match_args__", None)
        build = kind
    else:
        return None
    if fields is not None and len(fields) != len(first):
        fields = None
    items = []
    for i in range(len(first)):
        per_stage = [NOT_HERE if v is NOT_HERE else v[i] for v in vals]
        seg = ("field", fields[i]) if fields is not None else ("index", i)
        items.append(_merge(per_stage, (*path, seg), divergences))
    return build(items)


def _merge_leaf(real: list[tuple[int, Any]], path: _Path, divergences: list) -> Any:
    first = real[0][1]
    if all(_equal(first, v) for _, v in real[1:]):
        return first
    stage, value = real[-1]
    divergences.append((path, real, stage))
    return value


def _equal(a: Any, b: Any) -> bool:
    """Whether two leaves are the same value; never raises."""
    if a is b:
        return True
    try:
        a_tensor, b_tensor = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
        if a_tensor or b_tensor:
            return a_tensor and b_tensor and _tensors_equal(a, b)
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return bool(a == b)
    except Exception:
        return False


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    return False


def _format_path(path: _Path) -> str:
    parts = [str(path[0])]
    for kind, x in path[1:]:
        if kind == "field":
            parts.append(f".{x}")
        elif kind == "key":
            parts.append(f"[{_safe_repr(x)}]")
        else:
            parts.append(f"[{x}]")
    return "".join(parts)


def _safe_repr(x: Any, limit: int = 60) -> str:
    try:
        text = repr(x)
    except Exception:
        text = f"<{type(x).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor(shape={tuple(v.shape)}, dtype={v.dtype})"
    return _safe_repr(v)


def _divergence_message(path: _Path, real: list[tuple[int, Any]], kept: int) -> str:
    groups: list[list[tuple[int, Any]]] = []
    for stage, v in real:
        for group in groups:
            if _equal(group[0][1], v):
                group.append((stage, v))
                break
        else:
            groups.append([(stage, v)])
    stages = ", ".join(str(s) for s, _ in real)
    detail = "; ".join(
        f"stage{'s' if len(g) > 1 else ''} {', '.join(str(s) for s, _ in g)}: {_describe(g[0][1])}"
        for g in groups
    )
    return (
        f"pipeline stages {stages} returned different values for {_format_path(path)} ({detail}); "
        f"keeping stage {kept}'s value"
    )

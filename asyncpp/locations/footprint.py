"""The locations a block may touch, read from its source before it runs (an over-estimate).

An engine that serves some locations faster than others (a compiled vLLM engine serves only its
taps inside the compiled graph) asks, when a block is invoked, which locations the block's code can
reach. The answer is a :class:`Footprint`: module path patterns (a part is a name, or ``None`` for
"any child", as in ``layers[i]``) with the location kind that follows (``output``, ``input``,
``inputs``, ``skip``, or ``None`` where the code names a module without one of its locations), or
``None`` when the code cannot be read that far: the source is missing, or a module node escapes
into code this reading does not follow (a helper function it is passed to, a container, an
attribute, ``getattr`` with a computed name). Unlike the path check at invoke (which reports only
what is sure to run), every branch counts here: the footprint covers whatever the block might do.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .location import Location
from .tree import Node
from .validate import block_ast, block_function

KINDS = frozenset({"output", "input", "inputs", "skip"})
_ALIASES = frozenset({"logits", "samples"})  # the root's run-wide locations
_VALUES = frozenset({"path", "module_type", "steps"})  # attributes of a node that are not modules
# builtins that take a node without awaiting anything of it
_HARMLESS = frozenset(
    {"len", "print", "repr", "str", "isinstance", "type", "id", "hasattr", "bool", "format"}
)
# builtins whose result iterates (or indexes) as the node's children do
_SAME_CHILDREN = frozenset({"list", "tuple", "iter"})
# and those whose result holds the children in another order (indexing it may give any of them)
_REORDERED = frozenset({"reversed", "sorted"})
_SEQ = "<seq>"  # a pattern's last part for some of its children in some order (a slice)
_STD = ("<std>",)  # the pattern of ``m.std`` (then "layers", a layer, as a module path grows)
STD_MODEL_POINTS = frozenset({"embed", "final_norm", "logits"})
STD_LAYER_POINTS = frozenset({"resid_in", "attn_out", "mlp_out", "resid_out"})
_MAX_DEPTH = 16  # longer patterns come from a loop that walks down the tree: not followed
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)

Pattern = tuple  # of str | None


@dataclass(frozen=True)
class Footprint:
    """What a block's code names: ``(pattern, kind)`` pairs, and the run-wide aliases."""

    locations: frozenset[tuple[Pattern, str | None]]
    aliases: frozenset[str]
    #: points of the standard view: (layer number, or None for any, point name)
    standard: frozenset[tuple[int | None, str]] = frozenset()

    def modules(self, paths: Iterable[str]) -> dict[str, set[str | None]]:
        """The module paths among ``paths`` each pattern matches, with the kinds named at each."""
        out: dict[str, set[str | None]] = {}
        split = [(p, tuple(p.split(".")) if p else ()) for p in paths]
        for pattern, kind in self.locations:
            for path, parts in split:
                if len(parts) == len(pattern) and all(a is None or a == b for a, b in zip(pattern, parts)):
                    out.setdefault(path, set()).add(kind)
        return out


class _Unknown(Exception):
    """The code goes where this reading cannot follow it."""


def block_footprint(block: Callable, args: tuple = (), kwargs: dict | None = None) -> Footprint | None:
    """The footprint of ``block(tree, *args, **kwargs)``, or None when it cannot be told."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, (Node, Location)):
            return None  # a node handed in: the block may reach anything under it
    fn, offset = block_function(block)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    key = (code, offset)
    try:
        return _CACHE[key]
    except KeyError:
        pass
    result = _CACHE[key] = _read(fn, offset)
    if len(_CACHE) > _CACHE_SIZE:  # (shipped code makes a new code object per request)
        del _CACHE[next(iter(_CACHE))]
    return result


_CACHE: dict[tuple[Any, int], Footprint | None] = {}  # oldest first
_CACHE_SIZE = 1024


def _read(fn: Callable, offset: int) -> Footprint | None:
    parsed = block_ast(fn)
    if parsed is None:
        return None
    node = parsed[0]
    if not isinstance(node, _FUNCS):
        return None  # a lambda (its line holds more than the function)
    params = [*node.args.posonlyargs, *node.args.args]
    if offset >= len(params):
        return None
    try:
        return _Reader(node, params[offset].arg).run()
    except _Unknown:
        return None


class _Reader:
    """Follows the tree's name and its aliases through a function's whole body."""

    def __init__(self, fn: ast.AST, root: str):
        self.fn = fn
        self.env: dict[str, set[Pattern]] = {root: {()}}
        self.locations: set[tuple[Pattern, str | None]] = set()
        self.aliases: set[str] = set()
        self.standard: set[tuple[int | None, str]] = set()
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(fn):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent

    def run(self) -> Footprint:
        # names bound to nodes, until nothing new is bound (a loop may bind from its own names)
        for _ in range(_MAX_DEPTH):
            before = {k: set(v) for k, v in self.env.items()}
            for st in ast.walk(self.fn):
                self._bind_from(st)
            if self.env == before:
                break
        else:
            raise _Unknown
        for expr in ast.walk(self.fn):
            if (
                isinstance(expr, ast.expr)
                and not isinstance(getattr(expr, "ctx", None), ast.Store)
                and self.nodes(expr)
            ):
                self._check_use(expr)
        return Footprint(frozenset(self.locations), frozenset(self.aliases), frozenset(self.standard))

    # --- what an expression is -------------------------------------------------------------------

    def nodes(self, e: ast.AST) -> set[Pattern]:
        """The module patterns ``e`` evaluates to (empty: not a module node)."""
        if isinstance(e, ast.Name):
            return self.env.get(e.id, set())
        if isinstance(e, ast.Attribute):
            if self._children_dict(e.value):
                return set()  # a method of the children dict (see _call and _check_use)
            base = self.nodes(e.value)
            if not base:
                return set()
            name = e.attr
            if name == "std" and () in base:
                return {_STD}
            std = {p for p in base if p and p[0] == _STD[0]}
            if std:
                return self._standard(std, name)
            if name in KINDS:
                self.locations.update((p, name) for p in base)
                return set()
            if name in _ALIASES and () in base:
                self.aliases.add(name)
                return {p + (name,) for p in base if p}
            if name in _VALUES or name.startswith("__"):
                return set()
            if name in ("find", "children"):
                return set()  # the call decides (see _call)
            return self._grow(base, name)
        if isinstance(e, ast.Subscript):
            base = self.nodes(e.value)
            if not base:
                return set()
            key = e.slice
            if isinstance(key, ast.Slice):
                return _reordered(base)
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                name = key.value
            elif isinstance(key, ast.Constant) and type(key.value) is int and key.value >= 0:
                name = str(key.value)
            else:
                name = None
            return self._child(base, name)
        if isinstance(e, ast.Call):
            return self._call(e)
        if isinstance(e, ast.NamedExpr):
            return self.nodes(e.value)
        if isinstance(e, ast.IfExp):
            return self.nodes(e.body) | self.nodes(e.orelse)
        if isinstance(e, ast.BoolOp):
            out: set[Pattern] = set()
            for v in e.values:
                out |= self.nodes(v)
            return out
        if isinstance(e, ast.Starred):
            return self.nodes(e.value)
        return set()

    def _standard(self, base: set[Pattern], name: str) -> set[Pattern]:
        """``name`` of a standard-view object: a point (recorded), ``layers``, or something else."""
        for p in base:
            if p == _STD and name in STD_MODEL_POINTS:
                self.standard.add((None, name))
            elif len(p) == 3 and name in STD_LAYER_POINTS:
                self.standard.add((None if p[2] is None else int(p[2]), name))
            elif not (p == _STD and name == "layers"):
                return set()  # an attribute that is no point (its value, or the view's error)
        return {p + (name,) for p in base if p == _STD and name == "layers"}

    def _call(self, e: ast.Call) -> set[Pattern]:
        func = e.func
        if isinstance(func, ast.Attribute) and func.attr in ("find", "children"):
            base = self.nodes(func.value)
            if not base:
                return set()
            if func.attr == "children":
                return base  # a dict of the children: followed where it is iterated
            arg = e.args[0] if len(e.args) == 1 and not e.keywords else None
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                raise _Unknown  # a path built at run time
            out = base
            for part in arg.value.split(".") if arg.value else ():
                out = self._grow(out, part)
            return out
        if isinstance(func, ast.Name) and func.id in _SAME_CHILDREN and len(e.args) == 1:
            return self.nodes(e.args[0])
        if isinstance(func, ast.Name) and func.id in _REORDERED and e.args:
            return _reordered(self.nodes(e.args[0]))
        if isinstance(func, ast.Name) and func.id == "getattr" and len(e.args) >= 2:
            base = self.nodes(e.args[0])
            if not base:
                return set()
            name = e.args[1]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                raise _Unknown
            return self.nodes(ast.Attribute(value=e.args[0], attr=name.value, ctx=ast.Load()))
        if isinstance(func, ast.Attribute) and func.attr == "values":
            return self._children_dict(func.value)  # the children, as the node iterates them
        return set()

    def _child(self, base: set[Pattern], name: str | None) -> set[Pattern]:
        """Indexing: the named child of a node, any child of a reordered run of children."""
        seqs = {p[:-1] + (None,) for p in base if p and p[-1] == _SEQ}
        return seqs | self._grow({p for p in base if not p or p[-1] != _SEQ}, name)

    def _grow(self, base: set[Pattern], part: str | None) -> set[Pattern]:
        out = {p + (part,) for p in base}
        if any(len(p) > _MAX_DEPTH for p in out):
            raise _Unknown
        return out

    def _children_of(self, e: ast.expr) -> set[Pattern]:
        """What iterating ``e`` yields, where it yields module nodes."""
        return self._child(self.nodes(e), None)

    def _children_dict(self, e: ast.expr) -> set[Pattern]:
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "children":
            return self.nodes(e.func.value)
        return set()

    # --- names bound to nodes --------------------------------------------------------------------

    def _bind(self, target: ast.AST, pats: set[Pattern]) -> None:
        if not pats:
            return
        if isinstance(target, ast.Name):
            self.env.setdefault(target.id, set()).update(pats)
        elif isinstance(target, ast.Starred):
            self._bind(target.value, pats)
        else:
            raise _Unknown  # a node stored in an attribute, an item or a tuple of names

    def _bind_from(self, st: ast.AST) -> None:
        if isinstance(st, ast.Assign):
            for target in st.targets:
                self._bind_pair(target, st.value)
        elif isinstance(st, (ast.AnnAssign, ast.AugAssign)) and st.value is not None:
            self._bind_pair(st.target, st.value)
        elif isinstance(st, ast.NamedExpr):
            self._bind(st.target, self.nodes(st.value))
        elif isinstance(st, (ast.For, ast.AsyncFor, ast.comprehension)):
            self._bind_loop(st.target, st.iter)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            for item in st.items:
                if item.optional_vars is not None and self.nodes(item.context_expr):
                    raise _Unknown

    def _bind_pair(self, target: ast.AST, value: ast.expr) -> None:
        if isinstance(value, (ast.Tuple, ast.List)) and _unpacks(target, value):
            for t, v in zip(target.elts, value.elts):
                self._bind_pair(t, v)
            return
        pats = self.nodes(value)
        if pats and isinstance(target, (ast.Tuple, ast.List)):
            raise _Unknown  # unpacking a node: its children
        self._bind(target, pats)

    def _bind_loop(self, target: ast.AST, it: ast.expr) -> None:
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id in ("enumerate", "zip"):
            parts = it.args if it.func.id == "zip" else it.args[:1]
            if not parts or it.keywords:
                return
            yields = [self._children_of(a) for a in parts]
            if not any(yields):
                return
            if not isinstance(target, (ast.Tuple, ast.List)):
                raise _Unknown
            elts = target.elts[1:] if it.func.id == "enumerate" else target.elts
            if len(elts) != len(yields):
                raise _Unknown
            for t, pats in zip(elts, yields):
                self._bind(t, pats)
            return
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items":
            pats = {p + (None,) for p in self._children_dict(it.func.value)}
            if pats:
                if not (isinstance(target, ast.Tuple) and len(target.elts) == 2):
                    raise _Unknown
                self._bind(target.elts[1], pats)
            return
        self._bind(target, self._children_of(it))

    # --- where a node may go ---------------------------------------------------------------------

    def _check_use(self, e: ast.expr) -> None:
        """Raise :class:`_Unknown` where the node ``e`` goes somewhere this reading does not follow."""
        parent = self.parents.get(e)
        if isinstance(parent, ast.Attribute) and parent.value is e and self._children_dict(e):
            if parent.attr in ("values", "keys"):
                return
            if parent.attr == "items" and self._loop_iter(self.parents.get(parent)):
                return
            raise _Unknown  # (name, child) pairs kept for later, or a child by a computed name
        if isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is e:
            return
        if isinstance(parent, (ast.For, ast.AsyncFor, ast.comprehension)) and parent.iter is e:
            return
        if (
            isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr))
            and parent.value is e
        ):
            return
        if isinstance(parent, (ast.Tuple, ast.List)):
            grand = self.parents.get(parent)
            if (
                isinstance(grand, ast.Assign)
                and grand.value is parent
                and all(_unpacks(t, parent) for t in grand.targets)
            ):
                return  # bound element-wise
        if isinstance(parent, (ast.Expr, ast.Compare, ast.Await, ast.FormattedValue, ast.IfExp, ast.BoolOp)):
            return
        if isinstance(parent, ast.keyword):
            parent = self.parents.get(parent)
        if isinstance(parent, ast.Call):
            func = parent.func
            if isinstance(func, ast.Name) and func.id in (
                _HARMLESS | _SAME_CHILDREN | _REORDERED | {"getattr"}
            ):
                return
            if isinstance(func, ast.Name) and func.id in ("enumerate", "zip") and self._loop_iter(parent):
                return  # followed where the loop binds its target
        raise _Unknown

    def _loop_iter(self, e: ast.expr) -> bool:
        parent = self.parents.get(e)
        return isinstance(parent, (ast.For, ast.AsyncFor, ast.comprehension)) and parent.iter is e


def _unpacks(target: ast.AST, value: ast.Tuple | ast.List) -> bool:
    """Whether ``target = value`` binds item by item (``a, b = m.x, m.y``)."""
    return (
        isinstance(target, (ast.Tuple, ast.List))
        and len(target.elts) == len(value.elts)
        and not any(isinstance(x, ast.Starred) for x in (*target.elts, *value.elts))
    )


def _reordered(base: set[Pattern]) -> set[Pattern]:
    return {p if p and p[-1] == _SEQ else p + (_SEQ,) for p in base}

"""The location tree: the object a block receives as ``m``, mirroring the model's module tree.

Built once per model from ``named_modules()``: every module gets an index (its controller's key) and
its dotted path, computed here once and used in every error, repr and ownership table.
``m.model.layers[0].mlp.output`` is an attribute walk over prebuilt nodes, no string formatting.
"""

from __future__ import annotations

import difflib
import inspect
import os
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..kernel.errors import PathError
from ..kernel.traps import INPUT, INPUTS, OUTPUT, SKIP, Write
from .location import Location
from .steps import Steps

RESERVED = frozenset(
    {"output", "input", "inputs", "skip", "steps", "logits", "samples", "std", "path", "module_type"}
)


class Node:
    """One module of the model. ``.output``, ``.input`` (first argument), ``.inputs`` ((args,
    kwargs)) are its locations; children are attributes (``node.mlp``) or items (``node[0]``,
    ``node["output"]`` for a child whose name is reserved here)."""

    def __init__(self, path: str, index: int, module_type: str):
        d = self.__dict__
        d["path"] = path
        d["module_type"] = module_type
        d["_index"] = index
        d["_children"] = {}
        d["_ordered"] = []  # children in order when they are named 0..n-1, else None
        d["output"] = Location(index, OUTPUT, path)
        d["input"] = Location(index, INPUT, path)
        d["inputs"] = Location(index, INPUTS, path)

    def _add(self, name: str, child: Node) -> None:
        self._children[name] = child
        ordered = self._ordered
        if ordered is not None:
            if name == str(len(ordered)):
                ordered.append(child)
            else:
                self.__dict__["_ordered"] = None
        if name.isidentifier() and name not in RESERVED:
            self.__dict__[name] = child

    def skip(self, value: Any) -> Write:
        """Supply this module's output without running it; must be awaited:
        ``await m.model.layers[3].mlp.skip(zeros)``."""
        from ..kernel.interleaver import active_interleaver

        f = sys._getframe(1)
        write = Write(Location(self._index, SKIP, self.path), value, f"{f.f_code.co_filename}:{f.f_lineno}")
        kernel = active_interleaver()
        if kernel is not None and kernel.current is not None:
            kernel.current.writes.append(write)
        return write

    def __getattr__(self, name: str) -> Node:
        if name.startswith("__"):
            raise AttributeError(name)
        raise PathError(_unknown(self, name) + _where())

    def __getitem__(self, key: int | str) -> Node:
        if type(key) is int:
            ordered = self._ordered  # a ModuleList / Sequential: children named 0..n-1 in order
            if ordered is not None and -len(ordered) <= key < len(ordered):
                return ordered[key]
        children = self._children
        if isinstance(key, int):
            n = len(children)
            k = key + n if key < 0 else key
            child = children.get(str(k))
        else:
            child = children.get(key)
        if child is None:
            raise PathError(_unknown(self, str(key)) + _where())
        return child

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"{self._label()} is a module of the location tree; write to a location with "
            f"`await {self._label()}.output.set(value)`"
        )

    def __iter__(self) -> Iterator[Node]:
        return iter(self._children.values())

    def __len__(self) -> int:
        return len(self._children)

    def __await__(self):
        raise TypeError(
            f"{self._label()} is a module, not a location: await {self._label()}.output (or .input / .inputs)"
        )

    def children(self) -> dict[str, Node]:
        """This module's children by name."""
        return dict(self._children)

    def _label(self) -> str:
        return self.path or "the root module"

    def __repr__(self) -> str:
        return f"<module {self._label()} ({self.module_type})>"


class Root(Node):
    """The whole model: a module node plus run-wide locations (``logits``) and ``steps()``."""

    def __init__(self, index: int, module_type: str, aliases: dict[str, str] | None = None):
        super().__init__("", index, module_type)
        self.__dict__["_aliases"] = dict(aliases or {})

    def __getattr__(self, name: str) -> Node:
        if name in ("logits", "samples"):  # the property raised (Python then asks here): its error
            self._alias(name)
        if name == "std":
            self._standard()
        return super().__getattr__(name)

    @property
    def std(self) -> Any:
        """The standard view of the model (:mod:`asyncpp.locations.standard`): the same points,
        shapes and numbers on every engine and supported architecture."""
        return self._standard()

    def _standard(self) -> Any:
        view = self.__dict__.get("_std")
        if view is None:
            reason = self.__dict__.get("_std_error", "this engine gives no standard view of its model")
            raise PathError(f"m.std: {reason}; use the raw module tree (m.<module path>)" + _where())
        return view

    def steps(self, select: int | range | list[int] | None = None) -> Steps:
        """Iterate generation steps: ``async for step in m.steps(): ...`` (all), ``m.steps(range(2,
        5))``, ``m.steps([0, 3])``. The loop ends when generation ends."""
        return Steps(select)

    @property
    def logits(self) -> Location:
        """The model's logits (the engine decides which module produces them)."""
        return self._alias("logits")

    @property
    def samples(self) -> Location:
        """The sampled tokens of a generation step (engines that sample: vLLM)."""
        return self._alias("samples")

    def _alias(self, name: str) -> Location:
        target = self._aliases.get(name)
        if target is None:
            raise PathError(
                f"this model has no {name} location on this engine (a {self.module_type}); "
                f"await m.output or a module's output instead" + _where()
            )
        if type(target) is tuple:  # (module path, key): an element of that module's output
            path, key = target
            return self.find(path).output[key]
        return self.find(target).output

    def find(self, path: str) -> Node:
        """The node at a dotted module path ('' for the root)."""
        node: Node = self
        if not path:
            return node
        for part in path.split("."):
            node = node[part]
        return node

    def _label(self) -> str:
        return "the root module"


def build_tree(
    model: nn.Module, aliases: dict[str, str] | None = None, extra: dict[str, nn.Module] | None = None
) -> tuple[Root, list[nn.Module], list[str]]:
    """Index every module of ``model`` (and of ``extra``, mounted at the given top-level names);
    return the root node, and the modules and their paths by index."""
    modules: list[nn.Module] = []
    paths: list[str] = []
    for path, module in model.named_modules(remove_duplicate=True):
        modules.append(module)
        paths.append(path)
    for name, sub in (extra or {}).items():
        for path, module in sub.named_modules(prefix=name, remove_duplicate=True):
            modules.append(module)
            paths.append(path)
    root = tree_from_paths([(p, type(m).__name__) for p, m in zip(paths, modules)], aliases)
    return root, modules, paths


def tree_from_paths(entries: list[tuple[str, str]], aliases: dict[str, str] | None = None) -> Root:
    """The location tree of a module tree given as (path, type name) in index order, the root
    ('') first: what a driver builds from the module list a remote worker reports."""
    nodes: dict[str, Node] = {}
    root: Root | None = None
    for index, (path, type_name) in enumerate(entries):
        if not path:
            root = Root(index, type_name, aliases)
            nodes[""] = root
            continue
        parent_path, _, name = path.rpartition(".")
        node = Node(path, index, type_name)
        nodes[path] = node
        nodes[parent_path]._add(name, node)
    if root is None:
        raise ValueError("a module tree needs its root ('') first")
    return root


_PACKAGE = tuple(
    {os.path.dirname(os.path.dirname(p)) + os.sep for p in (__file__, os.path.abspath(__file__))}
)
_CO_COROUTINE = inspect.CO_COROUTINE


def _where() -> str:
    """Where a path that does not exist was named, as the static check says it (``\\n  in block
    name, file:line``): the innermost caller outside asyncpp. Only computed for an error."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f = f.f_back
    if f is None:
        return ""
    code = f.f_code
    kind = "block " if code.co_flags & _CO_COROUTINE else ""
    return f"\n  in {kind}{code.co_qualname}, {code.co_filename}:{f.f_lineno}"


def _unknown(node: Node, name: str) -> str:
    names = list(node._children)
    where = f"{node.path}.{name}" if node.path else name
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    listing = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "") if names else "none"
    return f"the model has no module {where!r}{hint} (children of {node._label()}: {listing})"

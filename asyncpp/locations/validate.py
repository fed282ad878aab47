"""Static check of the module paths a block names, run when the block is invoked.

``m.model.layerz[0].output`` in a block's source fails at ``t.invoke(...)``, before anything runs,
naming the path, the nearest valid names and the block's line. Chains are read from the block's own
source (its first parameter is the model); a non-constant index (``layers[i]``) matches any child.
Paths built dynamically (``getattr``) are checked when the block runs, with the same message.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

from ..kernel.errors import PathError
from .tree import RESERVED, Node, Root, _unknown

_STOP = RESERVED | {"at", "set", "find", "children"}


def check_block_paths(block: Callable, tree: Root) -> None:
    """Raise :class:`PathError` if ``block`` names a module path ``tree`` does not have."""
    code = getattr(block, "__code__", None)
    if code is None:
        return
    seen = tree.__dict__.get("_checked_codes")
    if seen is None:
        seen = tree.__dict__["_checked_codes"] = set()
    if code in seen:
        return
    try:
        lines, first = inspect.getsourcelines(block)
        fn = ast.parse(textwrap.dedent("".join(lines))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        seen.add(code)
        return
    if not isinstance(fn, (ast.AsyncFunctionDef, ast.FunctionDef)) or not fn.args.args:
        seen.add(code)
        return
    root_name = fn.args.args[0].arg
    for node in ast.walk(fn):
        chain = _chain(node, root_name)
        if chain is None:
            continue
        error = _resolve(tree, chain)
        if error is not None:
            line = first + node.lineno - 1
            raise PathError(f"{error}\n  in block {block.__qualname__}, {code.co_filename}:{line}")
    seen.add(code)


def _chain(node: ast.AST, root_name: str) -> list | None:
    """The access chain of a maximal ``root.a.b[0].c`` expression, or None."""
    if not isinstance(node, (ast.Attribute, ast.Subscript)):
        return None
    parts: list = []
    cur = node
    while isinstance(cur, (ast.Attribute, ast.Subscript)):
        if isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
        else:
            s = cur.slice
            parts.append(s.value if isinstance(s, ast.Constant) and isinstance(s.value, (int, str)) else ...)
        cur = cur.value
    if not (isinstance(cur, ast.Name) and cur.id == root_name):
        return None
    parts.reverse()
    return parts


def _resolve(tree: Root, chain: list) -> str | None:
    frontier: list[Node] = [tree]
    for part in chain:
        if isinstance(part, str) and part in _STOP:
            return None
        nxt: list[Node] = []
        for n in frontier:
            children = n._children
            if part is ...:
                nxt.extend(children.values())
            elif isinstance(part, int):
                k = part + len(children) if part < 0 else part
                if str(k) in children:
                    nxt.append(children[str(k)])
            elif part in children:
                nxt.append(children[part])
        if not nxt:
            if len(frontier) == 1:
                return _unknown(frontier[0], str(part))
            return f"no module of {frontier[0].path or 'the model'} and its siblings has a child {part!r}"
        frontier = nxt
    return None

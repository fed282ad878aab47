"""Static check of the module paths a block names, run when the block is invoked.

``m.model.layerz[0].output`` in a block's source fails at ``t.invoke(...)``, before anything runs,
naming the path, the nearest valid names and the block's line. Chains are read from the block's own
source; a non-constant index (``layers[i]``) matches any child.

The check follows Python's scoping and reports only what the block is sure to evaluate:

* the tree is the parameter the block receives it in: the first one, the second of a bound method
  (``async def block(self, m)``), or the one after those a ``functools.partial`` binds;
* a name bound again in an inner scope (a comprehension's target, a lambda's or a nested function's
  parameter) is not the tree there, and from the statement where the block itself rebinds its
  tree's name (``m = ...``, ``for m in ...``, ``nonlocal m`` in a helper) on, nothing is checked;
* only chains on every path through the block count: the code up to the first statement that may
  leave it (``return``, ``raise``, ``assert``, ``break``/``continue``), not inside an ``if``/``match``
  branch, the second operand of ``and``/``or``, a conditional expression's arms, a ``try`` body
  whose handlers may catch the :class:`PathError` (``AttributeError``, ``Exception``, ...), a
  ``contextlib.suppress`` body, nested functions and lambdas, generator expressions, or a loop (or
  comprehension) that may run zero times. Loops over a constant ``range``, a literal, a tree node
  with children (``for layer in m.model.layers``) or ``m.steps()`` run at least once and count.

A chain the check cannot prove is on every path, and paths built at run time (``getattr``), are
checked when the block runs, with the same message (see :meth:`Node.__getattr__`).

An engine that can never serve some locations (a compiled vLLM engine: only its taps) gives a
``refuse`` function; a wait the block is sure to make, ``await`` directly on a constant chain
(``await m.model.layers[1].mlp.output``, ``.input``, ``.inputs``, ``.skip(...)``, ``.at(n)``,
``.set(...)``), that it refuses fails at invoke in the same way. The engine refuses other waits
when they are made.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
from collections.abc import Callable
from types import FunctionType, MethodType

from ..kernel.errors import PathError, TapError
from ..kernel.traps import KIND_CODES
from .tree import RESERVED, Node, Root, _unknown

_STOP = RESERVED | {"at", "set", "find", "children"}
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_COMPS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
# the exception classes a PathError (or a TapError) is an instance of: a handler naming one of
# them catches it
_CATCHERS = frozenset(c.__name__ for c in (*PathError.__mro__, *TapError.__mro__))
Refuse = Callable[[int, int], Exception | None]
# iterables of these builtins are as empty as their argument
_SAME_LENGTH = frozenset({"enumerate", "reversed", "list", "tuple", "sorted", "iter", "set"})


def check_block_paths(block: Callable, tree: Root, refuse: Refuse | None = None) -> None:
    """Raise :class:`PathError` if ``block`` is sure to name a module path ``tree`` does not have,
    or the error ``refuse(index, kind)`` gives for a wait it is sure to make (an engine's)."""
    fn, offset = block_function(block)
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    key = code if offset == 0 else (code, offset)
    seen = tree.__dict__.get("_checked_codes")  # (the tree is its engine's: so is ``refuse``)
    if seen is None:
        seen = tree.__dict__["_checked_codes"] = set()
    if key in seen:
        return
    parsed = block_ast(fn)
    if parsed is None:
        seen.add(key)
        return
    node, first = parsed
    params = [*node.args.posonlyargs, *node.args.args] if isinstance(node, _FUNCS) else []
    if offset < len(params):
        found = _Checker(tree, params[offset].arg, refuse).run(node)
        if found is not None:
            at, error = found
            line = first + at.lineno - 1
            where = f"\n  in block {fn.__qualname__}, {code.co_filename}:{line}"
            if isinstance(error, Exception):
                raise type(error)(f"{error}{where}")
            raise PathError(f"{error}{where}")
    seen.add(key)


def block_ast(fn: Callable) -> tuple[ast.AST, int] | None:
    """The syntax tree of ``fn``'s source and its first line, or None without a readable source."""
    try:
        lines, first = inspect.getsourcelines(fn)
        return ast.parse(textwrap.dedent("".join(lines))).body[0], first
    except (OSError, TypeError, SyntaxError, IndexError):
        return None


def block_function(block: Callable) -> tuple[Callable, int]:
    """The function under bound methods and partials, and the index of the parameter that
    receives the tree: ``partial(f, a)(m)`` calls ``f(a, m)``, ``obj.f(m)`` calls ``f(obj, m)``."""
    if type(block) is FunctionType:
        return block, 0
    offset = 0
    while True:
        if isinstance(block, functools.partial):
            offset += len(block.args)
            block = block.func
        elif isinstance(block, MethodType):
            offset += 1
            block = block.__func__
        else:
            return block, offset


class _Checker:
    """Walks what a block is sure to evaluate and resolves its chains on the tree's name."""

    def __init__(self, tree: Root, root: str, refuse: Refuse | None = None):
        self.tree, self.root, self.refuse = tree, root, refuse

    def run(self, fn: ast.AST) -> tuple[ast.AST, str | Exception] | None:
        try:
            self.body(fn.body, top=True)
        except _Found as found:
            return found.node, found.error
        return None

    # --- statements --------------------------------------------------------------------------

    def body(self, stmts: list[ast.stmt], top: bool = False) -> None:
        """Visit ``stmts`` in order up to the first that may leave them (it included)."""
        for st in stmts:
            if top and _binds(st, self.root):
                return  # the tree's name means something else from here on (the block rebinds it)
            self.stmt(st)
            if _leaves(st, 0):
                return

    def stmt(self, st: ast.stmt) -> None:
        expr = self.expr
        if isinstance(st, (ast.Expr, ast.Return)):
            if st.value is not None:
                expr(st.value)
        elif isinstance(st, ast.Assign):
            expr(st.value)
            for target in st.targets:
                expr(target)
        elif isinstance(st, ast.AugAssign):
            expr(st.value)
            expr(st.target, load=True)  # `m.a.b += x` reads m.a.b
        elif isinstance(st, ast.AnnAssign):  # (a local annotation is not evaluated)
            if st.value is not None:
                expr(st.value)
            expr(st.target)
        elif isinstance(st, ast.Delete):
            for target in st.targets:
                expr(target)
        elif isinstance(st, (ast.For, ast.AsyncFor)):
            expr(st.iter)
            expr(st.target)
            if self.nonempty(st.iter):
                self.body(st.body)
        elif isinstance(st, ast.While):
            expr(st.test)
            if isinstance(st.test, ast.Constant) and st.test.value:  # `while True:` runs once at least
                self.body(st.body)
        elif isinstance(st, ast.If):
            expr(st.test)
            if isinstance(st.test, ast.Constant):  # `if True:` / `if 0:`: one branch is taken
                self.body(st.body if st.test.value else st.orelse)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            for item in st.items:
                expr(item.context_expr)
                if item.optional_vars is not None:
                    expr(item.optional_vars)
            if not any(_suppresses(item.context_expr) for item in st.items):
                self.body(st.body)
        elif isinstance(st, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            if not any(_catches(h.type) for h in st.handlers):
                self.body(st.body)
            self.body(st.finalbody)  # (runs on every path; the handlers and `else` do not)
        elif isinstance(st, ast.Match):
            expr(st.subject)
        elif isinstance(st, ast.Raise):
            if st.exc is not None:
                expr(st.exc)
            if st.cause is not None:
                expr(st.cause)
        elif isinstance(st, ast.Assert):
            expr(st.test)  # (the message is evaluated only when the assertion fails)
        elif isinstance(st, (*_FUNCS, ast.ClassDef)):  # defined, not run (its body is not sure to)
            for e in _at_definition(st):
                expr(e)

    # --- expressions -------------------------------------------------------------------------

    def expr(self, e: ast.expr, root: bool = True, load: bool = False) -> None:
        """Visit what evaluating ``e`` is sure to evaluate; ``root``: the tree's name is the tree
        in this scope."""
        expr = self.expr
        if isinstance(e, (ast.Attribute, ast.Subscript)):
            parts, base, slices = _parts(e)
            for s in slices:
                expr(s, root)
            if root and isinstance(base, ast.Name) and base.id == self.root:
                if not load and not isinstance(e.ctx, ast.Load):
                    parts = parts[:-1]  # `m.a.b = x` reads m.a and sets b (which the tree refuses)
                error, _ = _resolve(self.tree, parts)
                if error is not None:
                    raise _Found(e, error)
            else:
                expr(base, root)
        elif isinstance(e, ast.Await):
            expr(e.value, root)
            if root and self.refuse is not None:
                self.awaited(e)
        elif isinstance(e, ast.IfExp):
            expr(e.test, root)
        elif isinstance(e, ast.BoolOp):
            expr(e.values[0], root)
        elif isinstance(e, ast.Lambda):
            for d in _at_definition(e):
                expr(d, root)
        elif isinstance(e, _COMPS):
            self.comprehension(e, root)
        else:
            for child in ast.iter_child_nodes(e):
                if isinstance(child, ast.expr):
                    expr(child, root)
                elif isinstance(child, ast.keyword):
                    expr(child.value, root)

    def awaited(self, e: ast.Await) -> None:
        """Refuse ``await <chain>`` if the engine can never serve that location (a constant
        chain to one module; anything else is the engine's to refuse when the wait is made)."""
        v = e.value
        while (
            isinstance(v, ast.Call)
            and isinstance(v.func, ast.Attribute)
            and v.func.attr in ("at", "set", "skip")
        ):
            v = v.func if v.func.attr == "skip" else v.func.value
        if not isinstance(v, (ast.Attribute, ast.Subscript)):
            return
        parts, base, _ = _parts(v)
        if not (isinstance(base, ast.Name) and base.id == self.root):
            return
        at = next((i for i, p in enumerate(parts) if isinstance(p, str) and p in _STOP), None)
        if at is None or parts[at] not in KIND_CODES or ... in parts[:at]:
            return
        error, frontier = _resolve(self.tree, parts[:at])
        if error is None and len(frontier) == 1:
            refusal = self.refuse(frontier[0]._index, KIND_CODES[parts[at]])
            if refusal is not None:
                raise _Found(e, refusal)

    def comprehension(self, e: ast.expr, root: bool) -> None:
        gens = e.generators
        self.expr(gens[0].iter, root)  # evaluated in the enclosing scope, before anything is bound
        if isinstance(e, ast.GeneratorExp):  # the rest runs only when (if ever) it is consumed
            return
        targets = {n.id for g in gens for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        inner = root and self.root not in targets
        for i, g in enumerate(gens):
            if i:
                self.expr(g.iter, inner)
            if not self.nonempty(g.iter, root if i == 0 else inner):
                return
            if g.ifs:
                self.expr(g.ifs[0], inner)
                return  # a filter may drop every item: what follows is not sure to run
        if isinstance(e, ast.DictComp):
            self.expr(e.key, inner)
            self.expr(e.value, inner)
        else:
            self.expr(e.elt, inner)

    def nonempty(self, e: ast.expr, root: bool = True) -> bool:
        """Whether iterating ``e`` is sure to give one item at least."""
        if isinstance(e, (ast.List, ast.Tuple, ast.Set)):
            return bool(e.elts) and not any(isinstance(x, ast.Starred) for x in e.elts)
        if isinstance(e, ast.Dict):
            return bool(e.keys) and None not in e.keys
        if isinstance(e, ast.Constant):
            return isinstance(e.value, (str, bytes)) and len(e.value) > 0
        if isinstance(e, ast.Call):
            f, args = e.func, e.args
            if isinstance(f, ast.Name) and not any(isinstance(a, ast.Starred) for a in args):
                if f.id == "range":
                    if len(args) == 1 and _is_call(args[0], "len") and len(args[0].args) == 1:
                        return self.has_children(args[0].args[0], root)
                    values = [_int(a) for a in args]
                    return 1 <= len(values) <= 3 and None not in values and len(range(*values)) > 0
                if f.id in _SAME_LENGTH and len(args) == 1:
                    return self.nonempty(args[0], root)
                if f.id == "zip" and args:
                    return all(self.nonempty(a, root) for a in args)
                return False
            if isinstance(f, ast.Attribute) and f.attr == "steps" and self.is_root(f.value, root):
                if e.keywords or len(args) > 1:
                    return False
                return not args or _selects_step_0(args[0])  # (a trace's step 0 always comes)
            return False
        return self.has_children(e, root)

    def has_children(self, e: ast.expr, root: bool) -> bool:
        """Whether ``e`` is a chain on the tree whose nodes all have children."""
        if not isinstance(e, (ast.Attribute, ast.Subscript)):
            return False
        parts, base, _ = _parts(e)
        if not self.is_root(base, root) or any(isinstance(p, str) and p in _STOP for p in parts):
            return False
        error, frontier = _resolve(self.tree, parts)
        return error is None and bool(frontier) and all(n._children for n in frontier)

    def is_root(self, e: ast.expr, root: bool) -> bool:
        return root and isinstance(e, ast.Name) and e.id == self.root


class _Found(Exception):
    def __init__(self, node: ast.AST, error: str | Exception):
        self.node, self.error = node, error


def _parts(e: ast.expr) -> tuple[list, ast.expr, list[ast.expr]]:
    """The access chain of ``base.a.b[0].c``, its base and its non-constant subscripts."""
    parts: list = []
    slices: list[ast.expr] = []
    cur = e
    while isinstance(cur, (ast.Attribute, ast.Subscript)):
        if isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
        else:
            s = cur.slice
            if isinstance(s, ast.Constant) and isinstance(s.value, (int, str)):
                parts.append(s.value)
            else:
                k = _int(s)
                parts.append(... if k is None else k)
                if k is None:
                    slices.append(s)
        cur = cur.value
    parts.reverse()
    return parts, cur, slices


def _resolve(tree: Root, chain: list) -> tuple[str | None, list[Node]]:
    """The error message of the first part of ``chain`` that names no module (or None), and the
    nodes the chain may reach (up to a reserved name such as ``output``)."""
    frontier: list[Node] = [tree]
    for part in chain:
        if isinstance(part, str) and part in _STOP:
            return None, frontier
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
                return _unknown(frontier[0], str(part)), []
            return f"no module of {frontier[0].path or 'the model'} and its siblings has a child {part!r}", []
        frontier = nxt
    return None, frontier


def _binds(node: ast.AST, name: str) -> bool:
    """Whether running ``node`` (a statement of the block) may rebind ``name`` in the block's
    scope: an assignment, a loop or ``with`` target, ``except ... as``, an import, a walrus (also
    in a comprehension), a nested ``def``/``class`` of that name, or a ``nonlocal`` in a helper."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Name):
            if n.id == name and not isinstance(n.ctx, ast.Load):
                return True
        elif isinstance(n, _SCOPES):  # its body is its own scope, but for a `nonlocal`
            if getattr(n, "name", None) == name:
                return True
            if any(isinstance(s, ast.Nonlocal) and name in s.names for s in ast.walk(n)):
                return True
            stack.extend(_at_definition(n))
        elif isinstance(n, _COMPS):  # its targets are its own, but a walrus in it binds in the block
            if any(
                isinstance(w, ast.NamedExpr) and getattr(w.target, "id", None) == name for w in ast.walk(n)
            ):
                return True
            stack.append(n.generators[0].iter)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            if name in n.names:
                return True
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.partition(".")[0]) == name for a in n.names):
                return True
        else:
            if isinstance(n, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and n.name == name:
                return True
            if isinstance(n, ast.MatchMapping) and n.rest == name:
                return True
            stack.extend(ast.iter_child_nodes(n))
    return False


def _at_definition(n: ast.AST) -> list[ast.expr]:
    """What defining a function, lambda or class evaluates in the enclosing scope."""
    out: list[ast.expr] = list(getattr(n, "decorator_list", []))
    if isinstance(n, ast.ClassDef):
        out += [*n.bases, *(k.value for k in n.keywords)]
    else:
        out += [d for d in [*n.args.defaults, *n.args.kw_defaults] if d is not None]
    return out


def _leaves(st: ast.stmt, loops: int) -> bool:
    """Whether ``st`` may end the statement list it is in early (``loops``: how many loops inside
    that list ``st`` is nested in, which its ``break`` and ``continue`` stay in)."""
    if isinstance(st, (ast.Return, ast.Raise, ast.Assert)):
        return True
    if isinstance(st, (ast.Break, ast.Continue)):
        return loops == 0
    if isinstance(st, (*_FUNCS, ast.ClassDef)):
        return False
    if isinstance(st, _LOOPS):
        forever = isinstance(st, ast.While) and isinstance(st.test, ast.Constant) and bool(st.test.value)
        if forever and not any(isinstance(s, ast.Break) for s in _stmts_in_loop(st.body)):
            return True  # never falls through
        return any(_leaves(s, loops + 1) for s in st.body) or any(_leaves(s, loops) for s in st.orelse)
    children: list[ast.stmt] = []
    for field in ("body", "orelse", "finalbody"):
        children.extend(getattr(st, field, None) or [])
    for h in getattr(st, "handlers", None) or []:
        children.extend(h.body)
    for c in getattr(st, "cases", None) or []:
        children.extend(c.body)
    return any(_leaves(s, loops) for s in children)


def _stmts_in_loop(stmts: list[ast.stmt]):
    """The statements of a loop body that belong to that loop (not to loops or functions in it)."""
    for s in stmts:
        yield s
        if isinstance(s, (*_LOOPS, *_FUNCS, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _stmts_in_loop(getattr(s, field, None) or [])
        for h in getattr(s, "handlers", None) or []:
            yield from _stmts_in_loop(h.body)
        for c in getattr(s, "cases", None) or []:
            yield from _stmts_in_loop(c.body)


def _catches(handler_type: ast.expr | None) -> bool:
    """Whether an ``except`` clause of this type may catch a PathError: a bare ``except``, one of
    PathError's classes (AttributeError, Exception, ...), or anything not a builtin exception."""
    if handler_type is None:
        return True
    if isinstance(handler_type, ast.Tuple):
        return any(_catches(t) for t in handler_type.elts)
    name = handler_type.attr if isinstance(handler_type, ast.Attribute) else getattr(handler_type, "id", None)
    if name is None or name in _CATCHERS:
        return True
    cls = getattr(builtins, name, None)
    return not (
        isinstance(handler_type, ast.Name) and isinstance(cls, type) and issubclass(cls, BaseException)
    )


def _suppresses(e: ast.expr) -> bool:
    """``with contextlib.suppress(...)``: an error in its body does not leave the block."""
    f = e.func if isinstance(e, ast.Call) else None
    return (isinstance(f, ast.Name) and f.id == "suppress") or (
        isinstance(f, ast.Attribute) and f.attr == "suppress"
    )


def _is_call(e: ast.expr, name: str) -> bool:
    return isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == name and not e.keywords


def _int(e: ast.expr) -> int | None:
    """The value of an int literal (``3``, ``-1``), else None."""
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        v = _int(e.operand)
        return None if v is None else -v
    if isinstance(e, ast.Constant) and type(e.value) is int:
        return e.value
    return None


def _selects_step_0(e: ast.expr) -> bool:
    """Whether a constant ``m.steps(...)`` selection includes step 0 (which every trace has)."""
    if _int(e) == 0:
        return True
    if isinstance(e, (ast.List, ast.Tuple, ast.Set)):
        return any(_int(x) == 0 for x in e.elts)
    if _is_call(e, "range"):
        values = [_int(a) for a in e.args]
        return 1 <= len(values) <= 3 and None not in values and 0 in range(*values)
    return False

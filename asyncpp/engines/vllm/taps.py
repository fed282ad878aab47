"""Taps: the locations a compiled vLLM engine serves blocks at, compiled into the model's graph.

vLLM compiles the inner model of a decoder (``model.model``: dynamo and inductor on CPU, piecewise
CUDA graphs on GPUs). Per-module controllers cannot run inside a compiled graph, so before the graph
is traced each tapped module's forward is wrapped to end with one call of the operator
``torch.ops.asyncpp.tap(values, site, layout, stage)`` (and, for an input tap, to begin with one). To the compiler it is opaque and mutates its tensors
in place, so it stays in the graph, in order, between the code that makes the module's output and
the code that reads it. When it runs, it calls back into the worker's interleaver: when no block
waits on the site it counts the call and returns (a set lookup); otherwise the blocks are served as
at a controller, and a replaced value is copied into the graph's own tensors.

Taps serve a module's output, its first argument (a pattern ending in ``.input``) or all its
arguments (``.inputs``: tensors, Nones, Python numbers, strings, and tuples, lists and dicts of
them, by position or keyword). Modules outside the compiled region (the top-level model, the
logits processor, the sampler) keep their controllers and serve every kind of location, as in eager
mode. The tap set is fixed when the engine starts: the default (every direct child of the compiled
model, with each decoder layer of its layer list) plus the user's patterns. A module that a
pattern with a wildcard (or the default set) reaches but whose call cannot be tapped is left out
while vLLM traces the model (:func:`dropped`); one named exactly fails the start.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ...kernel.errors import TapError
from ...kernel.traps import INPUT, INPUTS, KIND_CODES, KIND_NAMES, OUTPUT, SKIP
from ...locations.footprint import Footprint

TAPS_VERSION = 5  # part of vLLM's compile-cache key: bump when the tap operator or wrapper changes

_LIB = torch.library.Library("asyncpp", "DEF")
_LIB.define("tap(Tensor(a!)[] values, int site, int[] layout, int stage) -> ()")

BARE = -1  # layout of an output that is one tensor; else one entry per tuple item: 1 tensor, 0 None
# an inputs tap's layout: one entry per argument, positional ones first (0 None, 1 tensor), then
# keyword ones: KW + 2 j (None) or KW + 2 j + 1 (tensor) for parameter j of the module's forward
KW = 2
# an inputs tap's layout in the general form, for calls with other arguments: GENERAL, the number
# of positional arguments, each one's item, the number of keyword arguments, each one's name (a
# string item) and item. An item is one code, a constant's value after it, a container's length
# and items after it.
GENERAL = -2
_NONE, _TENSOR, _FALSE, _TRUE, _INT, _FLOAT, _STR, _TUPLE, _LIST, _DICT = range(10)


class _Server:
    """The worker's interleaver as the taps see it (one per process: a worker serves one model)."""

    __slots__ = (
        "hot_in",
        "hot_out",
        "counts",
        "visit_input",
        "visit_inputs",
        "after",
        "link",
        "names",
        "paths",
    )

    def __init__(
        self, kernel: Any, controllers: Any, sites: Iterable[int], names: dict[int, tuple[str, ...]]
    ):
        fields = kernel.link_fields()
        self.hot_in, self.hot_out, self.counts = fields["hot_in"], fields["hot_out"], fields["counts"]
        self.visit_input = kernel.visit_input
        self.visit_inputs = kernel.visit_inputs
        # per output tap, what its module's controller would do after the call (native: the fast path)
        self.after = {i: controllers.output_server(i) for i in sites}
        self.link = controllers.link
        self.names = names  # per inputs tap, its forward's keyword names (the layout numbers them)
        self.paths = kernel.names  # module path per module index


_server: _Server | None = None
# the native extension where the controllers are native: its C++ kernel of the operator makes the
# check of a tap nobody waits on (and its count) and calls _tap for the others
_native: Any = None


def bind(
    kernel: Any, controllers: Any, sites: Iterable[int], names: dict[int, tuple[str, ...]] | None = None
) -> None:
    """Serve this process's taps from ``kernel``, through ``controllers`` (the model's
    :class:`~asyncpp.native.controllers.Controllers`, whose link the kernel drives) at the output
    taps ``sites``; ``names``: what :func:`tap_modules` returned."""
    global _server, _native
    unbind()
    _server = server = _Server(kernel, controllers, sites, names or {})
    if controllers.native:
        from ...native import load

        _native = load()
        _native.tap_register()
        _native.tap_bind(server.hot_in, server.hot_out, server.counts, _tap)
        _open_front_door(_native)


def unbind() -> None:
    global _server, _native
    _server = None
    if _native is not None:
        _close_front_door(_native)
        _native.tap_unbind()
        _native.tap_register(False)  # (a later bind may be to Python controllers)
        _native = None


# torch's own entry of the operator's overload, while the native front door stands in its place
_torch_entry: Any = None


def _open_front_door(native: Any) -> None:
    """Put the native ``tap_front`` in place of the overload's entry (``OpOverload._op``, which
    its ``__call__`` calls): the compiled graph's code calls ``torch.ops.asyncpp.tap.default``,
    and a tap nobody waits on then costs a check instead of a trip through torch's dispatcher.
    ``tap_front`` passes every call it does not serve itself on to torch's entry."""
    global _torch_entry
    overload = torch.ops.asyncpp.tap.default
    entry = overload.__dict__.get("_op")
    if _torch_entry is not None or entry is None or type(overload).__call__ is not _OVERLOAD_CALL:
        return  # (a torch whose overloads are called otherwise: the C++ kernel serves, via the dispatcher)
    native.tap_front_door(entry)
    overload._op = native.tap_front
    _torch_entry = entry


def _close_front_door(native: Any) -> None:
    global _torch_entry
    if _torch_entry is not None:
        torch.ops.asyncpp.tap.default._op = _torch_entry
        native.tap_front_door(None)
        _torch_entry = None


_OVERLOAD_CALL = torch._ops.OpOverload.__call__


@contextlib.contextmanager
def standing_aside() -> Iterator[None]:
    """The taps serve nothing meanwhile (their operator returns at once): for a step whose
    modules' controllers serve every location instead (an auto engine's eager step)."""
    global _server
    server, _server = _server, None
    if _native is not None:
        _native.tap_active(False)
    try:
        yield
    finally:
        _server = server
        if _native is not None:
            _native.tap_active(server is not None)


def _tap(values: list[Tensor], site: int, layout: list[int], stage: int) -> None:
    server = _server
    if server is None:
        return
    if stage == OUTPUT:
        if site not in server.hot_out:  # the tap nobody waits on
            server.counts[site] += 1
            return
    else:
        if site not in server.hot_in or server.link.bypass:
            return
        if stage == INPUT:
            new = server.visit_input(site, values[0])
            if new is not values[0]:
                values[0].copy_(new)
            return
        names = server.names.get(site, ())
        args, kwargs = _assemble_call(values, layout, names)
        new_args, new_kwargs = server.visit_inputs(site, args, kwargs)
        if layout[0] == GENERAL:
            _put_back((args, kwargs), (new_args, new_kwargs), f"{server.paths[site]}.inputs")
        else:
            _copy_call(values, layout, names, new_args, new_kwargs)
        return
    out = values[0] if layout[0] == BARE else _assemble(values, layout)
    new = server.after[site](out)
    if new is not out:
        _copy_into(values, new, layout)


def _tap_fake(values: list[Tensor], site: int, layout: list[int], stage: int) -> None:
    return None


_LIB.impl("tap", _tap, "CompositeExplicitAutograd")
torch.library.register_fake("asyncpp::tap", _tap_fake, lib=_LIB)


def _assemble(values: list[Tensor], layout: list[int]) -> tuple:
    if len(values) == len(layout):  # no None in the tuple (a decoder layer's (hidden, residual))
        return tuple(values)
    it = iter(values)
    return tuple([next(it) if code else None for code in layout])


def _assemble_call(values: list[Tensor], layout: list[int], names: tuple[str, ...]) -> tuple[tuple, dict]:
    """An inputs tap's call as (args, kwargs)."""
    if layout[0] == GENERAL:
        return _decode_call(values, layout)
    if layout[-1] < KW:  # positional arguments only
        return _assemble(values, layout), {}
    it = iter(values)
    args, kwargs = [], {}
    for code in layout:
        x = next(it) if code & 1 else None
        if code < KW:
            args.append(x)
        else:
            kwargs[names[(code - KW) >> 1]] = x
    return tuple(args), kwargs


def _copy_call(
    values: list[Tensor], layout: list[int], names: tuple[str, ...], args: tuple, kwargs: dict
) -> None:
    """Put replaced arguments (or a tuple output's items: positional codes only) into the graph's
    tensors (the kernel checked that they fit)."""
    it = iter(values)
    for i, code in enumerate(layout):
        if code & 1:
            old = next(it)
            new = args[i] if code < KW else kwargs[names[(code - KW) >> 1]]
            if new is not old:
                old.copy_(new)


def _copy_into(values: list[Tensor], new: Any, layout: list[int]) -> None:
    """Put a replaced output into the graph's tensors (same shapes: every block on vLLM writes
    its own rows, which the kernel checked)."""
    if layout[0] == BARE:
        if new is not values[0]:
            values[0].copy_(new)
        return
    _copy_call(values, layout, (), new, {})


def flatten(out: Any, path: str) -> tuple[list[Tensor], list[int]]:
    """The tensors of a module's output and their layout (the tap's arguments)."""
    got = _flatten_output(out)
    if got is None:
        raise TapError(_output_refusal(path, out))
    return got


def _flatten_output(out: Any) -> tuple[list[Tensor], list[int]] | None:
    if isinstance(out, Tensor):
        return [out], [BARE]
    if type(out) is tuple and out and all(x is None or isinstance(x, Tensor) for x in out):
        tensors = [x for x in out if x is not None]
        if tensors:
            return tensors, [0 if x is None else 1 for x in out]
    return None


def _output_refusal(path: str, out: Any) -> str:
    return (
        f"{path} cannot be a tap: its output is {_describe(out)}; a tap serves a tensor or a tuple "
        f"of tensors (and Nones)"
    )


def _describe(out: Any) -> str:
    if isinstance(out, tuple):
        return "a tuple of " + ", ".join(type(x).__name__ for x in out)
    return f"a {type(out).__name__}"


def keyword_names(forward: Any) -> tuple[str, ...]:
    """The parameters a call of ``forward`` may pass by keyword, in order."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in params if p.kind in kinds)


def flatten_args(
    args: tuple, kwargs: dict, path: str, names: tuple[str, ...] = ()
) -> tuple[list[Tensor], list[int]]:
    """The tensors of a module call's arguments and their layout (an inputs tap's arguments;
    ``names``: :func:`keyword_names` of the module's forward)."""
    got = _flatten_call(args, kwargs, names)
    if got is None:
        raise TapError(_call_refusal(path, args, kwargs))
    return got


def _flatten_call(args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple[list[Tensor], list[int]] | None:
    """:func:`flatten_args`, or None for a call an inputs tap cannot serve."""
    items = [(0, x) for x in args]
    items += [(KW + 2 * names.index(k) if k in names else None, x) for k, x in kwargs.items()]
    tensors, layout = [], []
    for base, x in items:
        if base is None or not (x is None or isinstance(x, Tensor)):
            return _flatten_general(args, kwargs)
        if x is not None:
            tensors.append(x)
        layout.append(base + (x is not None))
    return (tensors, layout) if tensors else None


def _flatten_general(args: tuple, kwargs: dict) -> tuple[list[Tensor], list[int]] | None:
    """A call's tensors and its layout in the general form (traced by dynamo: the layout is a
    constant of the graph, but for integers vLLM keeps symbolic, which the operator takes as such)."""
    tensors: list[Tensor] = []
    layout = [GENERAL, len(args)]
    for x in args:
        if not _encode(x, layout, tensors):
            return None
    layout.append(len(kwargs))
    for k, x in kwargs.items():
        layout.extend(_constant_codes(k))
        if not _encode(x, layout, tensors):
            return None
    return (tensors, layout) if tensors else None


def _encode(x: Any, layout: list[int], tensors: list[Tensor]) -> bool:
    """Append the item of ``x`` to ``layout`` (its tensors to ``tensors``); False if it has a
    value that cannot be an item (a module, any other object)."""
    if x is None:
        layout.append(_NONE)
    elif isinstance(x, Tensor):
        layout.append(_TENSOR)
        tensors.append(x)
    elif type(x) is bool:
        layout.append(_TRUE if x else _FALSE)
    elif type(x) is int:  # (or an integer vLLM keeps symbolic; not an enum, which would come back an int)
        layout.append(_INT)
        layout.append(x)
    elif type(x) is float or type(x) is str:
        layout.extend(_constant_codes(x))
    elif type(x) is tuple or type(x) is list:
        layout.append(_TUPLE if type(x) is tuple else _LIST)
        layout.append(len(x))
        for y in x:
            if not _encode(y, layout, tensors):
                return False
    elif type(x) is dict:
        layout.append(_DICT)
        layout.append(len(x))
        for k, y in x.items():
            if not isinstance(k, str):
                return False
            layout.extend(_constant_codes(k))
            if not _encode(y, layout, tensors):
                return False
    else:
        return False
    return True


@torch.compiler.assume_constant_result
def _constant_codes(x: float | str) -> tuple[int, ...]:
    """The item of a float (its IEEE bits) or a string (its code points): run for real while
    dynamo traces, its result a constant of the graph."""
    if isinstance(x, float):
        return (_FLOAT, struct.unpack("<q", struct.pack("<d", x))[0])
    return (_STR, len(x), *map(ord, x))


def _decode_call(values: list[Tensor], layout: list[int]) -> tuple[tuple, dict]:
    """A call from its general-form layout and tensors."""
    tensors = iter(values)
    pos = 2
    args = []
    for _ in range(layout[1]):
        x, pos = _decode(layout, pos, tensors)
        args.append(x)
    kwargs = {}
    n, pos = layout[pos], pos + 1
    for _ in range(n):
        k, pos = _decode(layout, pos, tensors)
        kwargs[k], pos = _decode(layout, pos, tensors)
    return tuple(args), kwargs


def _decode(layout: list[int], pos: int, tensors: Iterator[Tensor]) -> tuple[Any, int]:
    code = layout[pos]
    pos += 1
    if code == _TENSOR:
        return next(tensors), pos
    if code <= _TRUE:
        return (None, None, False, True)[code], pos
    if code == _INT:
        return layout[pos], pos + 1
    if code == _FLOAT:
        return struct.unpack("<d", struct.pack("<q", layout[pos]))[0], pos + 1
    n = layout[pos]
    pos += 1
    if code == _STR:
        return "".join(map(chr, layout[pos : pos + n])), pos + n
    items: Any = {} if code == _DICT else []
    for _ in range(n):
        if code == _DICT:
            k, pos = _decode(layout, pos, tensors)
            items[k], pos = _decode(layout, pos, tensors)
        else:
            x, pos = _decode(layout, pos, tensors)
            items.append(x)
    return (tuple(items) if code == _TUPLE else items), pos


def _put_back(old: Any, new: Any, where: str) -> None:
    """Copy the replaced tensors of a general-form call into the graph's tensors. The kernel
    checked a block's rows; a value that is no tensor is a constant of the compiled graph and
    must stay as it was."""
    if isinstance(old, Tensor):
        if new is not old:
            if not isinstance(new, Tensor) or new.shape != old.shape:
                raise TapError(f"{where}: a tensor of the call can only be replaced by one of its shape")
            old.copy_(new)
    elif type(old) in (tuple, list, dict):
        if (
            type(new) is not type(old)
            or len(new) != len(old)
            or (type(old) is dict and new.keys() != old.keys())
        ):
            raise TapError(f"{where}: the replacement does not have the call's structure")
        for k in old if type(old) is dict else range(len(old)):
            _put_back(old[k], new[k], f"{where}[{k!r}]")
    elif new is not old and not (type(new) is type(old) and new == old):
        raise TapError(
            f"{where}: {old!r} is a constant of vLLM's compiled model and cannot be replaced "
            f"(by {new!r}); make the engine with mode='eager' to run the module on other arguments"
        )


def _call_refusal(path: str, args: tuple, kwargs: dict) -> str:
    given = ", ".join(
        [*(type(x).__name__ for x in args), *(f"{k}={type(x).__name__}" for k, x in kwargs.items())]
    )
    return (
        f"{path}.inputs cannot be a tap: the module is called with ({given}); an inputs tap serves "
        f"calls with at least one tensor whose arguments are tensors, None, Python numbers, strings, "
        f"and tuples, lists and dicts of them"
    )


def tapped_forward(
    forward: Any,
    site: int,
    path: str,
    output: bool = True,
    input: bool = False,
    inputs: bool = False,
    names: tuple[str, ...] | None = None,
    optional: frozenset[int] = frozenset(),
) -> Any:
    """``forward`` with the taps of module ``site`` on its output, its first argument and/or all
    its arguments (traced into the graph). A tap of a kind in ``optional`` (a kernel kind code)
    that the call cannot have is left out (:func:`dropped` says why); another raises TapError."""

    if names is None:
        names = keyword_names(forward) if inputs else ()

    def tapped(*args: Any, **kwargs: Any) -> Any:
        if inputs:
            got = _flatten_call(args, kwargs, names)
            if got is not None:
                torch.ops.asyncpp.tap(got[0], site, got[1], INPUTS)
            elif INPUTS in optional:
                _drop(site, INPUTS, _call_refusal(path, args, kwargs))
            else:
                raise TapError(_call_refusal(path, args, kwargs))
        if input:
            first = args[0] if args else next(iter(kwargs.values()), None)  # (as eager mode's .input)
            if isinstance(first, Tensor):
                torch.ops.asyncpp.tap([first], site, [BARE], INPUT)
            elif INPUT in optional:
                _drop(
                    site, INPUT, f"{path}.input cannot be a tap: the module's first argument is not a tensor"
                )
            else:
                raise TapError(f"{path}.input cannot be a tap: the module's first argument is not a tensor")
        out = forward(*args, **kwargs)
        if output:
            got = _flatten_output(out)
            if got is not None:
                torch.ops.asyncpp.tap(got[0], site, got[1], OUTPUT)
            elif OUTPUT in optional:
                _drop(site, OUTPUT, _output_refusal(path, out))
            else:
                raise TapError(_output_refusal(path, out))
        return out

    tapped.__wrapped__ = forward  # type: ignore[attr-defined]
    tapped.asyncpp_tap = site  # type: ignore[attr-defined]
    return tapped


# the taps left out in this process (site, kind) -> why, as vLLM traced the model
_dropped: dict[tuple[int, int], str] = {}


@torch.compiler.assume_constant_result
def _drop(site: int, kind: int, why: str) -> bool:
    """Leave a tap out (run for real while dynamo traces; nothing of it is in the graph)."""
    _dropped[(site, kind)] = why
    return True


def dropped() -> dict[tuple[int, int], str]:
    """The taps left out since the model's modules were wrapped: (site, kind) -> why."""
    return dict(_dropped)


def tap_modules(modules: Sequence[Any], paths: Sequence[str], plan: TapPlan) -> dict[int, tuple[str, ...]]:
    """Wrap the forward of each module ``plan`` taps (before vLLM traces the model); returns what
    :func:`bind` needs: each inputs tap's keyword names."""
    _dropped.clear()
    names = {}
    for i in sorted(plan.sites | plan.in_sites | plan.ins_sites):
        module = modules[i]
        if module is not None:
            if i in plan.ins_sites:
                names[i] = keyword_names(module.forward)
            module.forward = tapped_forward(
                module.forward,
                i,
                paths[i],
                output=i in plan.sites,
                input=i in plan.in_sites,
                inputs=i in plan.ins_sites,
                names=names.get(i),
                optional=plan.optional(i),
            )
    return names


# --- which modules are taps ----------------------------------------------------------------------


def compiled_roots(model: Any) -> list[str]:
    """Paths of the modules vLLM compiles in ``model`` (their forwards become graphs)."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    return [
        path
        for path, module in model.named_modules()
        if isinstance(module, TorchCompileWithNoGuardsWrapper) and not getattr(module, "do_not_compile", True)
    ]


def check_patterns(patterns: Iterable[str]) -> list[str]:
    """The user's tap patterns, checked (dotted module paths; ``*`` matches within one name,
    ``**`` any number of names)."""
    out = []
    for p in patterns:
        if not isinstance(p, str) or not p.strip() or p.strip(".") != p or ".." in p:
            raise ValueError(f"taps: {p!r} is not a module path pattern (such as 'model.layers.*.mlp')")
        out.append(p)
    return out


def matches(pattern: str, path: str) -> bool:
    """Whether module ``path`` matches ``pattern``, name by name."""
    return _match(pattern.split("."), path.split(".") if path else [])


def _match(pat: list[str], parts: list[str]) -> bool:
    if not pat:
        return not parts
    if pat[0] == "**":
        return any(_match(pat[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pat[0]) and _match(pat[1:], parts[1:])


_CONTAINERS = frozenset({"ModuleList", "ModuleDict"})  # module containers: never called, so never tapped


def standard_patterns(tree: Any) -> list[str]:
    """The taps the standard view needs besides the default set (each layer's attention and
    MLP), or none for a model without one."""
    view = tree.__dict__.get("_std")
    return [] if view is None else view.tap_patterns()


class TapPlan:
    """The tap set of one engine: which modules run compiled (only their outputs at taps can be
    served) and which of those are taps. The same on every rank (made from the full tree)."""

    def __init__(
        self,
        paths: Sequence[str],
        types: Sequence[str],
        roots: Sequence[str],
        patterns: Sequence[str],
        auto: bool = False,
    ):
        self.paths = list(paths)
        #: an auto engine runs a step eagerly when a request in it needs a location that is no tap
        self.auto = auto
        #: whether this step runs eagerly (controllers serve every location; the taps stand aside)
        self.eager_now = False
        self._needs: dict[Footprint, bool] = {}  # needs_eager, per footprint
        #: the driver's standard view (``m.std``), to find what its points stand for
        self.standard: Any = None
        self.roots = list(roots)
        self.patterns = list(patterns)
        self._index = index = {p: i for i, p in enumerate(self.paths)}
        inside = set()
        for i, p in enumerate(self.paths):
            if any(_under(p, r) for r in self.roots):
                inside.add(i)
        self.inside = frozenset(inside)
        sites = set()
        for r in self.roots:
            # the layer lists: the module lists inside the root that no other list holds (a
            # Llama's model.layers; an OPT's model.decoder.layers); their modules, the modules
            # beside them (embeddings, final norm) and the root's children are the default taps
            lists = {
                i
                for i in inside
                if types[i] == "ModuleList"
                and _under(self.paths[i], r)
                and not any(types[index[a]] == "ModuleList" for a in _ancestors(self.paths[i], r))
            }
            holders = {r} | {_parent(self.paths[i]) for i in lists}
            for i in sorted(inside):
                parent = _parent(self.paths[i])
                if parent in holders and types[i] not in _CONTAINERS:
                    sites.add(i)
                elif parent in index and index[parent] in lists:
                    sites.add(i)  # a decoder layer of the layer list
        self.unmatched = []
        by_kind: dict[str, set[int]] = {"": sites, ".input": set(), ".inputs": set()}
        kinds = {"": OUTPUT, ".input": INPUT, ".inputs": INPUTS}
        #: the taps a pattern names exactly: one its module's call cannot have fails the start
        #: (others are left out, see :meth:`drop`)
        self.exact: set[tuple[int, int]] = set()
        for pat in self.patterns:
            suffix = next((k for k in (".input", ".inputs") if pat.endswith(k)), "")
            module_pat = pat[: len(pat) - len(suffix)]
            found = [
                i
                for i in inside
                if self.paths[i] not in self.roots
                and types[i] not in _CONTAINERS
                and matches(module_pat, self.paths[i])
            ]
            if not found:
                self.unmatched.append(pat)
            by_kind[suffix].update(found)
            if not any(c in module_pat for c in "*?["):
                self.exact.update((i, kinds[suffix]) for i in found)
        #: the taps left out because their module's call cannot have them: (site, kind) -> why
        self.dropped: dict[tuple[int, int], str] = {}
        self.sites = frozenset(sites)  # output taps
        self.in_sites = frozenset(by_kind[".input"])  # input taps (the module's first argument)
        self.ins_sites = frozenset(by_kind[".inputs"])  # inputs taps (all its arguments)
        #: the kernel's ``refuse_at`` (a set the native link reads live): emptied for eager steps
        self.guarded = set(self.refuse_at)

    def optional(self, index: int) -> frozenset[int]:
        """The kinds of tap on module ``index`` that are left out should its call not have them."""
        return frozenset(k for k in (OUTPUT, INPUT, INPUTS) if (index, k) not in self.exact)

    def drop(self, index: int, kind: int, why: str) -> None:
        """Leave out a tap that module ``index``'s call cannot have (found while vLLM traced
        the model): a wait there is refused with ``why``."""
        self.dropped[(index, kind)] = why
        if kind == OUTPUT:
            self.sites = self.sites - {index}
            if not self.eager_now:
                self.guarded.add(index)
        elif kind == INPUT:
            self.in_sites = self.in_sites - {index}
        else:
            self.ins_sites = self.ins_sites - {index}
        self._needs.clear()

    @property
    def untappable(self) -> dict[str, str]:
        """The locations the tap set reached but left out (see :meth:`drop`), each with why."""
        return {
            self.paths[i] + ("" if k == OUTPUT else f".{KIND_NAMES[k]}"): why
            for (i, k), why in sorted(self.dropped.items())
        }

    @property
    def refuse_at(self) -> frozenset[int]:
        """Modules at whose output a wait may be refused (``RunHooks.refuse_at``)."""
        return self.inside - self.sites

    @property
    def tap_paths(self) -> list[str]:
        """Every tap: module paths (outputs), ``<path>.input`` for input taps and
        ``<path>.inputs`` for inputs taps."""
        every = [
            *((i, self.paths[i]) for i in self.sites),
            *((i, self.paths[i] + ".input") for i in self.in_sites),
            *((i, self.paths[i] + ".inputs") for i in self.ins_sites),
        ]
        return [p for _, p in sorted(every)]

    def error(self) -> str | None:
        """Why the user's patterns cannot be used (a pattern that names no compiled module)."""
        if not self.unmatched:
            return None
        names = ", ".join(repr(p) for p in self.unmatched)
        return (
            f"taps: {names} matches no module inside vLLM's compiled model ({', '.join(self.roots)}); "
            f"modules outside it need no tap. Its modules are, for example: {_examples(self)}"
        )

    def describe(self) -> str:
        """The taps in a few words (layer numbers folded)."""
        return summarize(self.tap_paths)

    def needs_eager(self, footprint: Footprint | None) -> bool:
        """Whether a block with this footprint (None: not known) may wait where a compiled step
        cannot serve it."""
        if footprint is None:
            return True
        known = self._needs.get(footprint)
        if known is None:
            known = self._needs[footprint] = self._reaches_untapped(footprint)
        return known

    def _reaches_untapped(self, footprint: Footprint) -> bool:
        index = self._index
        if any(
            kind is not None and self._refusal(index[path], KIND_CODES[kind]) is not None
            for path, kinds in footprint.modules(self.paths).items()
            for kind in kinds
        ):
            return True
        if not footprint.standard:
            return False
        view = self.standard
        if view is None:
            return True
        try:
            raw = [loc for layer, point in footprint.standard for loc in view.raw_locations(layer, point)]
        except Exception:  # a layer number the model does not have: the block's own error
            return True
        return any(self._refusal(i, kind) is not None for i, kind in raw)

    def refuse(self, index: int, kind: int) -> TapError | None:
        """The error for a wait on (``index``, ``kind``), if this step cannot serve it (the
        kernel's ``refuse`` hook; an eager step serves every location)."""
        return None if self.eager_now else self._refusal(index, kind)

    def _refusal(self, index: int, kind: int) -> TapError | None:
        """The error for a wait on (``index``, ``kind``), if the compiled model cannot serve it."""
        if index not in self.inside:
            return None
        if (
            (kind == OUTPUT and index in self.sites)
            or (kind == INPUT and (index in self.in_sites or index in self.ins_sites))
            or (kind == INPUTS and index in self.ins_sites)
        ):
            return None
        path = self.paths[index]
        what = f"{path}.{KIND_NAMES[kind]}"
        eager = "make the engine with mode='eager' (every location, slower)"
        why = self.dropped.get((index, kind)) or (
            self.dropped.get((index, INPUTS)) if kind == INPUT else None
        )
        if why is not None:
            return TapError(
                f"{what} is not a tap of this VllmEngine: its tap patterns reach it, but the module's "
                f"call cannot have one, so it was left out ({why}). To serve it, {eager}"
            )
        if kind == SKIP:
            return TapError(
                f"{what}: this VllmEngine runs vLLM's compiled model, whose taps serve a module's "
                f"output or its arguments (input, inputs) only; skip needs the module called from "
                f"Python: {eager}"
            )
        if path in self.roots:
            hint = "its value is the top-level model's, `m.output`," if kind == OUTPUT else ""
        elif kind == OUTPUT:
            hint = f"add the tap with VllmEngine(..., taps=[{path!r}]),"
        else:
            hint = f"add the tap with VllmEngine(..., taps=[{f'{path}.{KIND_NAMES[kind]}'!r}]),"
        fix = f"{hint} or {eager}" if hint else eager
        if self.auto:
            return TapError(
                f"{what} is not a tap of this VllmEngine (mode='auto'), and this step runs vLLM's "
                f"compiled model: the block reached it in a way its code does not show at invoke "
                f"(mode='auto' runs a request eagerly when its block's code names a location that "
                f"is no tap; this engine's taps: {self.describe()}). To serve it, {fix}"
            )
        return TapError(
            f"{what} is not a tap of this VllmEngine, which runs vLLM's compiled model: inside it "
            f"only taps can be awaited (this engine's: {self.describe()}). To serve it, {fix}"
        )


def summarize(paths: Sequence[str]) -> str:
    """Paths with their numbered parts folded: ``model.layers.{0..3}.mlp``."""
    groups: dict[tuple, list[tuple]] = {}
    for p in paths:
        parts = p.split(".")
        key = tuple("#" if x.isdigit() else x for x in parts)
        groups.setdefault(key, []).append(tuple(int(x) for x in parts if x.isdigit()))
    out = []
    for key, nums in groups.items():
        if len(nums) == 1 or len(nums[0]) != 1:
            for n in nums:
                it = iter(n)
                out.append(".".join(str(next(it)) if x == "#" else x for x in key))
            continue
        vals = sorted(n[0] for n in nums)
        run = (
            f"{{{vals[0]}..{vals[-1]}}}"
            if vals == list(range(vals[0], vals[-1] + 1))
            else "{" + ",".join(map(str, vals)) + "}"
        )
        out.append(".".join(run if x == "#" else x for x in key))
    return ", ".join(out)


def _examples(plan: TapPlan, n: int = 6) -> str:
    inner = [plan.paths[i] for i in sorted(plan.inside) if plan.paths[i] not in plan.roots]
    return ", ".join(inner[:n]) + (", ..." if len(inner) > n else "")


def _parent(path: str) -> str | None:
    return path.rsplit(".", 1)[0] if "." in path else ("" if path else None)


def _ancestors(path: str, root: str) -> list[str]:
    """The modules strictly between ``root`` and ``path``."""
    out = []
    parent = _parent(path)
    while parent is not None and parent != root and _under(parent, root):
        out.append(parent)
        parent = _parent(parent)
    return out


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")

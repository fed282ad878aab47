"""The standard view (``m.std``): the same named points on every engine and architecture.

The raw tree mirrors each architecture's modules, and what a module returns differs between
engines: a Hugging Face decoder layer returns ``[rows, seq, hidden]``, a vLLM one
``(mlp_out, residual)`` over the batch's flat token rows. The standard view names the points that
interpretability work reads and edits, by layer number, with one meaning and one shape everywhere::

    m.std.embed                    the embeddings as the first layer reads them [rows, seq, hidden]
    m.std.layers[i].resid_in       residual stream entering layer i (embed, for i = 0)
    m.std.layers[i].attn_out       the attention module's output
    m.std.layers[i].mlp_out        the MLP's (or mixture of experts') output
    m.std.layers[i].resid_out      residual stream leaving layer i
    m.std.final_norm               the final norm's output
    m.std.logits                   what the model samples from [rows, seq or 1, vocab]
    m.std.unembed(h)               h decoded as the model decodes its last layer (the logit lens)

Each point is a raw location (a :class:`Layout` per model family says which module) plus a
:class:`~asyncpp.kernel.views.ValueView` that the engine supplies (:class:`Presenters`): it
presents the raw value in the standard form, as a view of the model's storage, so in-place edits
and ``await point.set(value)`` land where the model reads. ``layers[i].resid_in`` is
``layers[i - 1].resid_out`` for ``i > 0`` (nothing runs between two layers in any supported
family), served at the same call; ``embed`` is ``layers[0].resid_in``: token embeddings, scaled
where the family scales them (Gemma), plus position embeddings where it has them (GPT-2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..kernel.errors import AsyncppError, PathError
from ..kernel.traps import INPUT, INPUTS, KIND_NAMES
from ..kernel.views import ValueView
from .location import Location
from .tree import Node, Root, _where

POINTS = ("resid_in", "attn_out", "mlp_out", "resid_out")  # of each layer, in the order they run
MODEL_POINTS = ("embed", "layers", "final_norm", "logits")


class StandardViewError(AsyncppError, LookupError):
    """The model's architecture has no standard view (the message names what is missing)."""


@dataclass(frozen=True)
class Layout:
    """Where the standard points are in one model family's module tree (the same names on
    Hugging Face and on vLLM); a part may list alternatives, ``"block_sparse_moe|mlp"``."""

    layers: str  # the decoder layer list
    attn: str  # inside a layer: the attention module
    mlp: str  # inside a layer: the MLP or mixture of experts
    embed: str  # the token embedding
    norm: str  # the final norm
    #: the embedding's output is the stream the first layer reads, on vLLM (not where the model
    #: scales it, as Gemma's do there, or adds position embeddings, as GPT-2 does)
    embed_is_stream: bool = True

    def resolve(self, root: Root) -> tuple[Layout | None, list[str]]:
        """This layout with each alternative chosen for ``root``'s tree, or None and what the
        tree lacks."""
        missing: list[str] = []

        def pick(options: str, base: Node | None, prefix: str = "") -> str:
            for name in options.split("|"):
                if base is None and _node(root, name) is not None:
                    return name
                if base is not None and name in base.children():
                    return name
            missing.append(prefix + " or ".join(options.split("|")))
            return ""

        layers = pick(self.layers, None)
        embed, norm = pick(self.embed, None), pick(self.norm, None)
        attn = mlp = ""
        if layers:
            node = root.find(layers)
            if not len(node):
                missing.append(f"{layers}.0")
            else:
                first = next(iter(node))
                attn = pick(self.attn, first, first.path + ".")
                mlp = pick(self.mlp, first, first.path + ".")
        if missing:
            return None, missing
        return Layout(layers, attn, mlp, embed, norm, self.embed_is_stream), []


LLAMA = Layout("model.layers", "self_attn", "mlp|block_sparse_moe", "model.embed_tokens", "model.norm")
GEMMA = Layout("model.layers", "self_attn", "mlp", "model.embed_tokens", "model.norm", False)
PHI = Layout("model.layers", "self_attn", "mlp", "model.embed_tokens", "model.final_layernorm")
GPT2 = Layout("transformer.h", "attn", "mlp", "transformer.wte", "transformer.ln_f", False)
# (vLLM's Transformers backend holds the base model as ``model``, whatever Hugging Face calls it)
GPT_NEOX = Layout(
    "gpt_neox.layers|model.layers",
    "attention",
    "mlp",
    "gpt_neox.embed_in|model.embed_in",
    "gpt_neox.final_layer_norm|model.final_layer_norm",
)

#: the model families with a standard view, by their top-level class (on Hugging Face and vLLM)
FAMILIES: dict[str, Layout] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": LLAMA,
    "Qwen3MoeForCausalLM": LLAMA,
    "Qwen2MoeForCausalLM": LLAMA,
    "GemmaForCausalLM": GEMMA,
    "Gemma2ForCausalLM": GEMMA,
    "Gemma3ForCausalLM": GEMMA,
    "Phi3ForCausalLM": LLAMA,
    "OlmoeForCausalLM": LLAMA,
    "MixtralForCausalLM": LLAMA,
    "PhiForCausalLM": PHI,
    "GPT2LMHeadModel": GPT2,
    "GPTNeoXForCausalLM": GPT_NEOX,
}
_LAYOUTS = (LLAMA, PHI, GPT2, GPT_NEOX)  # tried in turn for a class not in FAMILIES


def find_layout(root: Root, family: str | None = None) -> Layout:
    """The layout of ``root``'s model family (``family``, a class name of :data:`FAMILIES`, where
    the root module's class does not say it); raises :class:`StandardViewError` naming what is
    missing when no known layout fits."""
    kind = family or root.module_type
    known = FAMILIES.get(kind)
    if known is not None:
        layout, missing = known.resolve(root)
        if layout is not None:
            return layout
        raise StandardViewError(
            f"{kind}: the standard view expects {', '.join(missing)} in the module tree, which this "
            f"model does not have"
        )
    tried = []
    for candidate in _LAYOUTS:
        layout, missing = candidate.resolve(root)
        if layout is not None:
            return layout
        tried.append(missing)
    closest = min(tried, key=len)
    raise StandardViewError(
        f"{kind} has no standard view: it is not a known family ({', '.join(sorted(FAMILIES))}) and "
        f"its module tree lacks parts of one: {', '.join(closest)} (its top-level modules: "
        f"{', '.join(root.children()) or 'none'})"
    )


@dataclass(frozen=True)
class Presenters:
    """How one engine presents raw values in the standard form (one view per kind of point)."""

    tokens: ValueView  # a module's token-level output (embed, attn_out, mlp_out, final_norm)
    resid_out: ValueView  # a decoder layer's output, as the one residual stream
    resid_in: ValueView  # the first decoder layer's input (at resid_in_kind), as the stream
    logits: ValueView  # the logits location's value
    resid_in_kind: int = INPUT  # the location kind the first layer's input is read at
    #: read the first layer's input at the embedding's output where the layout allows (a compiled
    #: engine taps module outputs, not a decoder layer's arguments)
    stream_at_embed: bool = False


class StandardLocation(Location):
    """A point of the standard view: a raw location whose keys end with the engine's view (and
    any index the block adds after it). Reads and writes as any location."""

    __slots__ = ("label",)

    def __init__(self, index: int, kind: int, path: str, occ: int, keys: tuple, label: str):
        super().__init__(index, kind, path, occ, keys)
        self.label = label

    def at(self, call: int) -> StandardLocation:
        if not isinstance(call, int) or call < 0:
            raise ValueError(f"{self.describe()}.at(): call number must be an int >= 0, got {call!r}")
        return StandardLocation(self.index, self.kind, self.path, call, self.keys, self.label)

    def __getitem__(self, key: Any) -> StandardLocation:
        return StandardLocation(self.index, self.kind, self.path, self.occ, (*self.keys, key), self.label)

    def describe(self) -> str:
        name = self.label
        after = False
        for k in self.keys:
            if after:
                name += f"[{k!r}]"
            elif isinstance(k, ValueView):
                after = True
        if self.occ:
            name += f" (call {self.occ})"
        return name

    def __repr__(self) -> str:
        return f"<location {self.describe()} = {_raw_name(self)}>"


def _raw_name(loc: StandardLocation) -> str:
    kinds = ("input", "inputs", "output", "skip")
    name = f"{loc.path}.{kinds[loc.kind]}" if loc.path else kinds[loc.kind]
    for k in loc.keys:
        if isinstance(k, ValueView):
            break
        name += f"[{k!r}]"
    return name


def _point(raw: Location, view: ValueView, label: str) -> StandardLocation:
    return StandardLocation(raw.index, raw.kind, raw.path, raw.occ, (*raw.keys, view), label)


class _Named:
    """Attribute errors that list the names there are (at the block's line)."""

    __slots__ = ()
    _names: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise PathError(f"{self._label()} has no {name!r}; it has {', '.join(self._names)}" + _where())

    def _label(self) -> str:  # pragma: no cover - overridden
        return "std"


class StandardLayer(_Named):
    """``m.std.layers[i]``: the points of decoder layer ``i``."""

    __slots__ = ("number", "resid_in", "attn_out", "mlp_out", "resid_out", "module")
    _names = POINTS

    def __init__(self, number: int, module: Node, points: dict[str, StandardLocation]):
        self.number = number
        self.module = module  # the raw tree's node of this layer
        for name in POINTS:
            object.__setattr__(self, name, points[name])

    def _label(self) -> str:
        return f"std.layers[{self.number}]"

    def __repr__(self) -> str:
        return f"<std.layers[{self.number}] = {self.module.path}>"


class StandardLayers(_Named):
    """``m.std.layers``: indexable and iterable like a layer list."""

    __slots__ = ("_items",)

    def __init__(self, items: list[StandardLayer]):
        self._items = tuple(items)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self._items[i]
        if type(i) is not int:
            raise TypeError(f"std.layers[{i!r}]: layers are numbered by int")
        n = len(self._items)
        if not -n <= i < n:
            raise PathError(f"std.layers[{i}]: the model has {n} layers (0..{n - 1})" + _where())
        return self._items[i]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def _label(self) -> str:
        return "std.layers"

    def __repr__(self) -> str:
        return f"<std.layers: {len(self._items)} layers>"


class StandardView(_Named):
    """``m.std``: the model's standard points (see the module's docstring)."""

    __slots__ = ("layout", "embed", "layers", "final_norm", "logits", "head")
    _names = (*MODEL_POINTS, "unembed")

    def __init__(self, root: Root, layout: Layout, presenters: Presenters, head: Head | None = None):
        self.layout = layout
        self.head = None if head is None else head(layout)
        p = presenters
        nodes = list(root.find(layout.layers))
        layers = []
        prev_out: StandardLocation | None = None
        embed = root.find(layout.embed)
        for i, node in enumerate(nodes):
            if i == 0 and p.stream_at_embed and layout.embed_is_stream:
                resid_in = _point(embed.output, p.tokens, "std.layers[0].resid_in")
            elif i == 0:
                raw_in = node.input if p.resid_in_kind == INPUT else node.inputs
                resid_in = _point(raw_in, p.resid_in, "std.layers[0].resid_in")
            else:
                assert prev_out is not None
                resid_in = _point(_raw(prev_out), p.resid_out, f"std.layers[{i}].resid_in")
            points = {
                "resid_in": resid_in,
                "attn_out": _point(node[layout.attn].output, p.tokens, f"std.layers[{i}].attn_out"),
                "mlp_out": _point(node[layout.mlp].output, p.tokens, f"std.layers[{i}].mlp_out"),
                "resid_out": _point(node.output, p.resid_out, f"std.layers[{i}].resid_out"),
            }
            prev_out = points["resid_out"]
            layers.append(StandardLayer(i, node, points))
        first = layers[0].resid_in
        self.embed = StandardLocation(first.index, first.kind, first.path, 0, first.keys, "std.embed")
        self.layers = StandardLayers(layers)
        self.final_norm = _point(root.find(layout.norm).output, p.tokens, "std.final_norm")
        try:
            self.logits = _point(root.logits, p.logits, "std.logits")
        except PathError:
            pass  # (no logits location: __getattr__ says so)

    def __getattr__(self, name: str) -> Any:
        if name == "logits":
            raise PathError("std.logits: this engine has no logits location for this model" + _where())
        return super().__getattr__(name)

    def unembed(self, hidden: Any) -> Any:
        """The logits the model gives for residual-stream values ``hidden`` (``[..., hidden]``):
        its final norm, its head and any final transform (Gemma-2's soft-capping), called plainly
        on the value the block holds, not as visits of those modules. The logit lens: the last
        layer's ``resid_out`` unembedded is ``std.logits``."""
        if self.head is None:
            raise StandardViewError("std.unembed: this engine cannot call the model's head" + _where())
        return self.head(hidden)

    def tap_patterns(self) -> list[str]:
        """Tap patterns of the locations the view reads inside the model besides each layer's
        output and the embeddings' (a compiled engine taps them by default): each layer's
        attention and MLP, and the first layer's arguments where the stream is read there."""
        lay = self.layout
        patterns = [f"{lay.layers}.*.{lay.attn}", f"{lay.layers}.*.{lay.mlp}"]
        first = self.layers[0].resid_in
        if first.kind in (INPUT, INPUTS):
            patterns.append(f"{first.path}.{KIND_NAMES[first.kind]}")
        return patterns

    def raw_locations(self, layer: int | None, point: str) -> list[tuple[int, int]]:
        """The raw (module index, kind) pairs a point stands for (every layer for ``None``)."""
        if point in POINTS:
            items = list(self.layers) if layer is None else [self.layers[layer]]
            return [(getattr(x, point).index, getattr(x, point).kind) for x in items]
        loc = getattr(self, point)
        return [(loc.index, loc.kind)]

    def _label(self) -> str:
        return "std"

    def __repr__(self) -> str:
        return f"<standard view: {len(self.layers)} layers at {self.layout.layers}>"


def _raw(loc: StandardLocation) -> Location:
    keys = tuple(k for k in loc.keys if not isinstance(k, ValueView))
    return Location(loc.index, loc.kind, loc.path, loc.occ, keys)


#: what an engine gives for ``std.unembed``: from the model's layout, the function that decodes
#: residual-stream values into logits
Head = Callable[[Layout], Callable[[Any], Any]]


def attach(
    root: Root,
    presenters: Presenters | None,
    error: str | None = None,
    head: Head | None = None,
    family: str | None = None,
) -> StandardView | None:
    """Give ``root`` its standard view (``m.std``), built with the engine's presenters (and its
    ``head`` for ``std.unembed``); with ``presenters=None``, ``m.std`` raises ``error`` instead.
    ``family``: the model's class name where the root's is another (vLLM's Transformers backend
    wraps the Hugging Face model). Raises :class:`StandardViewError` when the model's family has
    no standard view."""
    if presenters is None:
        root.__dict__["_std"] = None
        root.__dict__["_std_error"] = error or "this engine has no standard view of its model"
        return None
    view = StandardView(root, find_layout(root, family), presenters, head)
    root.__dict__["_std"] = view
    return view


def _node(root: Root, path: str) -> Node | None:
    try:
        return root.find(path)
    except PathError:
        return None


__all__ = [
    "FAMILIES",
    "Head",
    "Layout",
    "Presenters",
    "StandardLayer",
    "StandardLocation",
    "StandardView",
    "StandardViewError",
    "attach",
    "find_layout",
]

"""Grafting the full architecture under a pipeline stage's placeholders.

A stage of a pipeline-parallel model holds placeholder modules (vLLM's ``PPMissingLayer``) where
another stage holds the real layer. :func:`graft` registers, under each placeholder, the children
that a full copy of the model (built on the meta device) has at the same path. Afterwards the
stage's ``named_modules()`` yields the same paths, in the same order, as a model that holds every
layer, so every path a block names resolves on every stage. The placeholders themselves stay: the
engine's forward never calls them, so the grafted modules are never run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

STUB_TYPES = ("PPMissingLayer",)  # placeholders for modules another stage holds


def is_stub(module: nn.Module) -> bool:
    return type(module).__name__ in STUB_TYPES


@dataclass
class Grafted:
    """What :func:`graft` did: the real type behind each placeholder path and each added path,
    the paths of modules added where the stage had none, and how many modules it registered."""

    types: dict[str, str] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    modules: int = 0


def graft(model: nn.Module, full: nn.Module) -> Grafted:
    """Give ``model`` every module path of ``full`` (the same architecture with every module
    present), in ``full``'s order.

    Under each placeholder of ``model`` the children ``full`` has at that path are registered; a
    module ``full`` has where ``model`` has none at all (vLLM builds the logits processor on the
    last stage only) is registered on its parent, whose children are then put in ``full``'s order.
    Raises ``LookupError`` when the two are not the same architecture, before changing anything."""
    out = Grafted()
    live = dict(model.named_modules(remove_duplicate=True))
    done: list[str] = []  # "path." of grafted subtrees: their modules come with them
    plan: list[tuple[nn.Module, str, nn.Module]] = []  # (live parent, child name, module to add)
    orders: dict[str, tuple[nn.Module, list[str]]] = {}  # parents whose children get reordered
    for path, real in full.named_modules(remove_duplicate=True):
        if any(path.startswith(d) for d in done):
            continue
        mine = live.get(path)
        if mine is None:
            parent_path, _, name = path.rpartition(".")
            parent = live.get(parent_path)
            if parent is None:
                raise LookupError(f"the stage's model has no parent module for {path!r}")
            plan.append((parent, name, real))
            orders[parent_path] = (parent, list(full.get_submodule(parent_path)._modules))
            out.added.append(path)
        elif is_stub(mine) and not is_stub(real):
            if mine._modules:
                raise LookupError(f"placeholder {path!r} already has children: grafted twice?")
            plan += [(mine, name, child) for name, child in real.named_children()]
        else:
            continue
        out.types[path] = type(real).__name__
        out.modules += sum(1 for _ in real.modules()) - (mine is not None)
        done.append(path + ".")
    for parent_path, (parent, _) in orders.items():
        if isinstance(parent, (nn.Sequential, nn.ModuleList)):  # their order is their forward
            raise LookupError(f"the stage's {parent_path or 'model'} lacks a module of a sequence")
    for parent, name, module in plan:
        parent.add_module(name, module)
    for parent, like in orders.values():
        _follow_order(parent, like)
    return out


def _follow_order(parent: nn.Module, like: list[str]) -> None:
    """Put ``parent``'s children in the order of the names ``like`` (others go last)."""
    names = [n for n in like if n in parent._modules]
    names += [n for n in parent._modules if n not in like]
    if names != list(parent._modules):
        children = dict(parent._modules)
        parent._modules.clear()
        parent._modules.update((n, children[n]) for n in names)

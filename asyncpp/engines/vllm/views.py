"""How a vLLM engine presents its values in the standard view (``m.std``).

vLLM runs a step's tokens as one flat batch ``[tokens, ...]``; a block already sees its request's
rows of it, which the standard view shows as ``[1, tokens, ...]`` (a view). A decoder layer of
most families returns ``(mlp_out, residual)`` and the next layer (or the final norm) adds the two:
the residual stream is their sum. To present it as one tensor that in-place edits land in, the
view moves the sum into ``residual`` and zeroes ``mlp_out``, for the reading request's rows only;
the next layer then adds zero to the stream, exactly. The logits hold each request's last
position only: ``[1, 1, vocab]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...kernel.traps import INPUTS
from ...kernel.views import ValueView
from ...locations.standard import Layout, Presenters
from ...pp.remote import ElsewhereValue, is_lazy


def _as_stream(hidden: Tensor, residual: Tensor | None) -> Tensor:
    if residual is None:  # the first layer's input, or a family with one stream tensor
        return hidden.unsqueeze(0)
    residual.add_(hidden)
    hidden.zero_()
    return residual.unsqueeze(0)


class FlatTokens(ValueView):
    """A module's token rows (a tuple's first element: a norm given a residual returns
    ``(normed, residual)``), as ``[1, tokens, ...]``."""

    __slots__ = ()

    def present(self, value: Any, block: Any) -> Any:
        if type(value) is tuple:
            value = value[0]
        return value.unsqueeze(0)


class SplitResidual(ValueView):
    """A decoder layer's output, ``(mlp_out, residual)`` or one tensor, as the residual stream."""

    __slots__ = ()

    def present(self, value: Any, block: Any) -> Any:
        if type(value) is tuple:
            return _as_stream(value[0], value[1])
        return value.unsqueeze(0)

    def remote(self, value: Any) -> Any:
        if type(value) is tuple:  # (published after the owner moved the stream: exact)
            return (value[0] + value[1]).unsqueeze(0)
        return value.unsqueeze(0)


class LayerInput(ValueView):
    """The first decoder layer's arguments ``(args, kwargs)``, as the residual stream it reads:
    ``hidden_states`` (and ``residual``, where the family passes one in)."""

    __slots__ = ()

    def present(self, value: Any, block: Any) -> Any:
        return _as_stream(*_stream_args(value))

    def remote(self, value: Any) -> Any:
        hidden, residual = _stream_args(value)
        return (hidden if residual is None else hidden + residual).unsqueeze(0)


def _stream_args(value: Any) -> tuple[Tensor, Tensor | None]:
    args, kwargs = value
    hidden = kwargs.get("hidden_states")
    residual = kwargs.get("residual")
    if hidden is None:
        # (positions, hidden_states, residual) in most families; (hidden_states,) in GPT-2's
        first = args[0]
        if first.dtype.is_floating_point or len(args) == 1:
            hidden, rest = first, args[1:]
        else:
            hidden, rest = args[1], args[2:]
        if residual is None and rest and isinstance(rest[0], Tensor):
            residual = rest[0]
    return hidden, residual


class LastPosition(ValueView):
    """A request's logits row ``[1, vocab]`` (vLLM computes the last position only), as
    ``[1, 1, vocab]``: a :class:`LastPositionLogits` view, so that asking for another position
    says why there is none."""

    __slots__ = ()
    travels = False  # (its remote form is that view, which a pulled plain tensor would not be)

    def present(self, value: Any, block: Any) -> Any:
        return Tensor._make_subclass(LastPositionLogits, value.unsqueeze(1))


class LastPositionLogits(Tensor):
    """``m.std.logits`` on vLLM: the model's own tensor (a view: edits land), whose indexing at a
    position other than the last raises an ``IndexError`` that says vLLM computes no other. Every
    operation on it gives a plain tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getitem__(self, key: Any) -> Any:
        _only_last(key)
        return Tensor.__getitem__(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _only_last(key)
        Tensor.__setitem__(self, key, value)


def _only_last(key: Any) -> None:
    if type(key) is not tuple or len(key) < 2 or any(k is Ellipsis for k in key[:2]):
        return
    pos = key[1]
    if isinstance(pos, int) and pos not in (0, -1):
        raise IndexError(
            f"std.logits[:, {pos}]: vLLM computes the logits of a request's last position only, so "
            f"std.logits is [1, 1, vocab] there (index [:, -1]); m.std.unembed(resid) decodes the "
            f"residual stream of any position"
        )


PRESENTERS = Presenters(
    tokens=FlatTokens(),
    resid_out=SplitResidual(),
    resid_in=LayerInput(),
    logits=LastPosition(),
    resid_in_kind=INPUTS,
    stream_at_embed=True,
)


def head_of(model: nn.Module) -> Callable[[Layout], Callable[[Any], Any]]:
    """``std.unembed`` on a vLLM worker: the final norm, then the model's own ``compute_logits``
    (the head, gathered across tensor-parallel ranks, cut to the vocabulary, soft-capped where the
    family does). Only the last pipeline stage holds them: on the others it gives a value that the
    last stage returns in the block's result."""

    def build(layout: Layout) -> Callable[[Any], Any]:
        from vllm.distributed.parallel_state import get_pp_group

        pp = get_pp_group()
        if not pp.is_last_rank:
            last = pp.world_size - 1
            return lambda hidden: ElsewhereValue(last, "std.unembed(...)")
        norm = model.get_submodule(layout.norm)

        def unembed(hidden: Any) -> Any:
            if is_lazy(hidden):  # an upstream stage's value: pulled here, where the head is
                hidden = hidden.force()
            shape = hidden.shape
            logits = model.compute_logits(norm(hidden.reshape(-1, shape[-1])))
            return logits.reshape(*shape[:-1], logits.shape[-1])

        return unembed

    return build


__all__ = [
    "PRESENTERS",
    "head_of",
    "FlatTokens",
    "LastPosition",
    "LastPositionLogits",
    "LayerInput",
    "SplitResidual",
]

"""How the local engine presents Hugging Face values in the standard view (``m.std``).

Hugging Face modules work on ``[rows, seq, ...]``, and the local engine left-pads the prompts of
a trace to one width. A standard point shows an invoke its own rows and its own positions: the
last ``block.tokens`` of a padded prompt forward (every position of a generated step). Modules
that return a tuple (attention: ``(out, weights)``; some mixtures of experts: ``(out,
router_logits)``) are read at their first element.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...kernel.traps import INPUT
from ...kernel.views import ValueView
from ...locations.standard import Layout, Presenters


class Tokens(ValueView):
    """A token-level value ``[rows, seq, ...]`` (a tuple's first element), cut to the invoke's
    own positions."""

    __slots__ = ()

    def present(self, value: Any, block: Any) -> Any:
        if isinstance(value, (tuple, list)):
            value = value[0]
        n = None if block is None else block.tokens
        if n is not None and value.dim() >= 2 and value.shape[1] > n:
            return value[:, value.shape[1] - n :]
        return value


PRESENTERS = Presenters(
    tokens=Tokens(), resid_out=Tokens(), resid_in=Tokens(), logits=Tokens(), resid_in_kind=INPUT
)


def head_of(model: nn.Module) -> Callable[[Layout], Callable[[Any], Any]]:
    """``std.unembed`` on a Hugging Face causal LM: its final norm, its ``lm_head`` and the
    final soft-capping of the families that have one (Gemma-2), as its forward applies them."""

    def build(layout: Layout) -> Callable[[Any], Any]:
        norm, head = model.get_submodule(layout.norm), model.get_output_embeddings()
        cap = getattr(model.config, "final_logit_softcapping", None)

        def unembed(hidden: Any) -> Any:
            logits = head(norm(hidden))
            if cap:
                logits = torch.tanh(logits / cap) * cap
            return logits

        return unembed

    return build


__all__ = ["PRESENTERS", "Tokens", "head_of"]

"""How the local engine presents Hugging Face values in the standard view (``m.std``).

Hugging Face modules work on ``[rows, seq, ...]``, and the local engine left-pads the prompts of
a trace to one width. A standard point shows an invoke its own rows and its own positions: the
last ``block.tokens`` of a padded prompt forward (every position of a generated step). Modules
that return a tuple (attention: ``(out, weights)``; some mixtures of experts: ``(out,
router_logits)``) are read at their first element.
"""

from __future__ import annotations

from typing import Any

from ...kernel.traps import INPUT
from ...kernel.views import ValueView
from ...locations.standard import Presenters


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

__all__ = ["PRESENTERS", "Tokens"]

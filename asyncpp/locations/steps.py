"""Generation steps: ``async for step in m.steps(): ...`` iterates the steps of a generate loop.

Each iteration parks the block until the model begins the next selected step (the step gate), so a
loop body that waits on nothing cannot spin, and every un-pinned ``await`` in the body refers to that
step. When generation ends the loop ends and the code after it runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from ..kernel.traps import StepGate


class Steps:
    """An async iterator over selected generation step numbers (0 is the prompt's forward)."""

    __slots__ = ("_select", "_gate")

    def __init__(self, select: int | range | Iterable[int] | None = None):
        if select is None or isinstance(select, range):
            if isinstance(select, range) and select.step <= 0:
                raise ValueError(f"steps(): a range of steps must count upwards, got {select!r}")
            self._select = select
        elif isinstance(select, int):
            self._select = [select]
        else:
            self._select = sorted(set(int(s) for s in select))
        if self._select is not None and any(s < 0 for s in self._select[:1]):
            raise ValueError("steps(): step numbers start at 0")
        self._gate = StepGate(self, 0, self._select is None)

    def first_at_or_after(self, step: int) -> int | None:
        """The first selected step number ``>= step``, or None when the selection is used up."""
        sel = self._select
        if sel is None:
            return step
        if isinstance(sel, range):
            if step <= sel.start:
                return sel.start if sel else None
            k = -(-(step - sel.start) // sel.step)
            s = sel.start + k * sel.step
            return s if s < sel.stop else None
        i = bisect.bisect_left(sel, step)
        return sel[i] if i < len(sel) else None

    def __aiter__(self) -> Steps:
        return self

    def __anext__(self) -> StepGate:
        # no coroutine per iteration: the loop awaits the gate itself, which the interleaver opens
        # with the step number (moving the gate past it) or ends with StopAsyncIteration
        gate = self._gate
        if self._select is not None and self.first_at_or_after(gate.after) is None:
            raise StopAsyncIteration
        return gate

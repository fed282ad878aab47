"""The block record: one intervention coroutine and its place in the batch, and its waits.

The native controllers (csrc/controller.cpp) read and write some of these fields by name (see
:mod:`asyncpp.native.controllers`): ``Block.coro``, ``state``, ``rows``, ``step``, ``order``, ``waiting``,
``done``, and every field of :class:`Wait`.
"""

from __future__ import annotations

from typing import Any


class Block:
    """One intervention coroutine and its place in the batch."""

    __slots__ = (
        "coro",
        "order",
        "rows",
        "step",
        "name",
        "done",
        "result",
        "error",
        "waiting",
        "writes",
        "state",
        "req_step",
        "req_rows",
        "ended",
        "seen",
        "session",
        "budget_step",
        "budget_used",
        "tokens",
    )

    def __init__(self, coro, order: int, rows: tuple[int, int] | None, name: str = "block"):
        self.coro = coro
        self.order = order  # invoke order: blocks at one location resume in this order
        self.rows = rows  # (start, stop) of its batch rows, None for the whole batch
        self.step = 0  # the generation step its un-pinned awaits refer to
        self.name = name
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.waiting: Any = None  # the trap it is parked on (for errors and introspection)
        self.writes: list = []  # Write traps it created and has not awaited yet
        self.state: Any = None  # its torch thread-local state (a BlockState of the switch), or None
        self.req_step = -1  # generation steps of its request begun so far, minus one
        self.req_rows: tuple[int, int] | None = rows  # its rows of request-level values (logits)
        self.ended = False  # its generation is over: step loops end, waits cannot be served
        self.seen: dict | None = None  # gradient runs: the values it was served, for loc.grad
        self.session: Any = None  # its open asyncpp.backward(...) session
        self.budget_step = -1  # with a time budget: the step its time is counted in, and that time
        self.budget_used = 0.0
        self.tokens: int | None = None  # its prompt's tokens, where the batch pads rows to one width

    def where(self) -> str:
        """File and line where the block is suspended."""
        frame = getattr(self.coro, "cr_frame", None)
        if frame is None:
            return "<finished>"
        return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class Wait:
    """A block parked on a module location: served at call ``occ`` of step ``step``.

    ``gather`` is the :class:`GatherState` when the wait is one item (number ``item``) of an
    ``asyncpp.gather(...)``, else None.
    """

    __slots__ = ("order", "block", "trap", "step", "occ", "gather", "item")

    def __init__(self, order: int, block: Block, trap: Any, step: int, occ: int, gather: Any, item: int):
        self.order = order  # the block's invoke order: a location's waits are kept sorted by it
        self.block = block
        self.trap = trap  # the Read (or Write) it awaits
        self.step = step
        self.occ = occ
        self.gather = gather
        self.item = item


class GatherState:
    """The values of an ``asyncpp.gather(...)`` collected so far."""

    __slots__ = ("block", "values", "remaining")

    def __init__(self, block: Block, n: int):
        self.block = block
        self.values = [None] * n
        self.remaining = n


__all__ = ["Block", "GatherState", "Wait"]

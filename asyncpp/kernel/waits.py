"""Parked waits on module locations: by wait key, in invoke order, and the modules they make hot.

A wait key is ``module_index * 4 + kind`` (see :mod:`.traps`). A module is *hot* on a stage (its
input stage, or its output) while some wait refers to it there: the per-module controllers look
the module up in ``hot_in`` / ``hot_out`` before and after each call, and only a hot call reaches
the interleaver. The native controllers hold these very containers (see :mod:`asyncpp.native.controllers`), so they are
mutated in place, never replaced.
"""

from __future__ import annotations

from collections.abc import Callable

from .block import Block, GatherState, Wait
from .traps import GATHER, OUTPUT, READ, WRITE


def _order_of(w: Wait) -> int:
    return w.order


class WaitTable:
    """The waits of one run and the reference counts that make modules hot."""

    __slots__ = ("waits", "hot_in", "hot_out", "refs_in", "refs_out")

    def __init__(self, n: int):
        self.waits: dict[int, list[Wait]] = {}  # wait key -> parked waits, in invoke order
        self.hot_in: set[int] = set()  # modules with waits on their input stage (or step starts)
        self.hot_out: set[int] = set()  # modules with waits on their output
        self.refs_in = [0] * n  # waits per module on its input stage
        self.refs_out = [0] * n  # waits per module on its output

    def park(
        self,
        block: Block,
        trap,
        key: int,
        index: int,
        step: int,
        occ: int,
        gather: GatherState | None = None,
        item: int = 0,
    ) -> None:
        """Park ``block`` on call ``occ`` of step ``step`` of the location ``key``."""
        w = Wait(block.order, block, trap, step, occ, gather, item)
        lst = self.waits.get(key)
        if lst is None:
            self.waits[key] = [w]
        else:
            lst.append(w)
            if lst[-2].order > block.order:
                lst.sort(key=_order_of)
        self.ref(index, key & 3)

    def unpark(self, block: Block, trap) -> None:
        """Remove every wait of ``block`` on ``trap`` (all items of a gather, say)."""
        kind = getattr(trap, "TRAP", None)
        if kind == READ:
            keys: tuple = (trap.key,)
        elif kind == WRITE:
            keys = (trap.target.key,)
        elif kind == GATHER:
            keys = tuple({i.key for i in trap.items if getattr(i, "TRAP", None) == READ})
        else:
            return
        waits = self.waits
        for key in keys:
            lst = waits.get(key)
            if not lst:
                continue
            kept = [w for w in lst if w.block is not block]
            removed = len(lst) - len(kept)
            if removed:
                if kept:
                    waits[key] = kept
                else:
                    del waits[key]
                self.unref(key >> 2, key & 3, removed)

    def take_due(self, key: int, lst: list[Wait], step: int, n: int) -> list[Wait]:
        """Remove and return the waits of ``lst`` (the waits of ``key``) due at call ``n`` of
        ``step``."""
        due = [w for w in lst if w.occ == n and w.step == step]
        if not due:
            return due
        if len(due) == len(lst):
            del self.waits[key]
        else:
            self.waits[key] = [w for w in lst if not (w.occ == n and w.step == step)]
        self.unref(key >> 2, key & 3, len(due))
        return due

    def stale(self, is_stale: Callable[[Wait], bool]) -> list[tuple[Block, Wait]]:
        """Each block with a stale wait (and one such wait), in invoke order."""
        hit: dict[int, tuple[Block, Wait]] = {}
        for lst in self.waits.values():
            for w in lst:
                if is_stale(w) and id(w.block) not in hit:
                    hit[id(w.block)] = (w.block, w)
        return sorted(hit.values(), key=lambda e: e[0].order)

    def ref(self, index: int, kind: int, n: int = 1) -> None:
        if kind == OUTPUT:
            refs, hot = self.refs_out, self.hot_out
        else:
            refs, hot = self.refs_in, self.hot_in
        r = refs[index]
        refs[index] = r + n
        if not r:
            hot.add(index)

    def unref(self, index: int, kind: int, n: int = 1) -> None:
        if kind == OUTPUT:
            refs, hot = self.refs_out, self.hot_out
        else:
            refs, hot = self.refs_in, self.hot_in
        r = refs[index] - n
        refs[index] = r
        if not r:
            hot.discard(index)

    def count(self) -> int:
        """How many waits are parked."""
        return sum(len(v) for v in self.waits.values())


__all__ = ["WaitTable"]

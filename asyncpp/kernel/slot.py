"""Slots: one-shot values handed between blocks (or from an engine to a block) within a run."""

from __future__ import annotations

import uuid
import weakref
from typing import Any

from .errors import AsyncppError
from .traps import SLOT


class SlotError(AsyncppError, RuntimeError):
    """A slot was set twice, or read before it had a value."""


class _Unset:
    """The value of a slot nobody has set yet (pickles as itself)."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "_UNSET"


_UNSET = _Unset()
_live: weakref.WeakValueDictionary[str, Slot] = weakref.WeakValueDictionary()


def _revive(uid: str, name: str, value: Any) -> Slot:
    """A slot arriving in another process: all copies of one slot there are one object, so the
    blocks of two invokes of a trace share it as they did in the caller."""
    slot = _live.get(uid)
    if slot is None:
        slot = Slot(name)
        slot._uid = uid
        slot._value = value
        _live[uid] = slot
    return slot


class Slot:
    """A value one block sets and other blocks await.

    ``await slot`` returns at once if the value is there, else parks the block until ``set`` is
    called; a block woken this way resumes within the same module visit, so a value produced at a
    visit (a clean activation) can be used by another block at that same visit (to patch it in).
    """

    TRAP = SLOT
    __slots__ = ("name", "_value", "_waiters", "_uid", "__weakref__")

    def __init__(self, name: str = "slot"):
        self.name = name
        self._value: Any = _UNSET
        self._waiters: list = []  # (interleaver, block, gather_state_or_None, index)
        self._uid = uuid.uuid4().hex

    def __reduce__(self) -> tuple:
        return (_revive, (self._uid, self.name, self._value))

    @property
    def is_set(self) -> bool:
        return self._value is not _UNSET

    @property
    def value(self) -> Any:
        if self._value is _UNSET:
            raise SlotError(f"slot {self.name!r} has no value yet: await it")
        return self._value

    def add_waiter(self, kernel: Any, block: Any, gather: Any = None, item: int = 0) -> None:
        """Wake ``block`` through ``kernel`` when the slot is set (``gather``: the block awaits the
        slot as item ``item`` of an ``asyncpp.gather``)."""
        self._waiters.append((kernel, block, gather, item))

    def forget(self, block: Any) -> None:
        """Stop waking ``block`` (its run ended, or it was closed)."""
        self._waiters = [w for w in self._waiters if w[1] is not block]

    def set(self, value: Any) -> None:
        """Give the slot its value and wake every block waiting on it."""
        if self._value is not _UNSET:
            raise SlotError(f"slot {self.name!r} was already set; use a new Slot per value")
        self._value = value
        waiters, self._waiters = self._waiters, []
        for kernel, block, gather, i in waiters:
            kernel.wake(block, value, gather, i)

    def __await__(self):
        if self._value is not _UNSET:
            return self._value
        return (yield self)

    def __repr__(self) -> str:
        state = "set" if self.is_set else f"unset, {len(self._waiters)} waiting"
        return f"<Slot {self.name!r} {state}>"

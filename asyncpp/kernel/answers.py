"""What a trap handler answers: a value to send back into the block, or one of these markers.

Handlers (the interleaver's own, and an engine's ``on_pull`` or ``intercept`` hook) return the
value the block's ``await`` evaluates to, a :class:`Throw` (an exception raised at that ``await``),
or :data:`PARKED` (the block waits; something wakes it later).
"""

from __future__ import annotations

PARKED = object()  # the block parked: it is resumed later (by a visit, a step, a slot, a pull)
RUN_BACKWARD = object()  # the block parked and its backward pass is to run now (kernel.grad)
MISS = object()  # an intercept hook declined to serve a location: the kernel parks the block as usual
NOTHING = object()  # "no value" where None is a value


class Throw:
    """A handler's answer that is an exception to throw into the block at its ``await``."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


__all__ = ["MISS", "NOTHING", "PARKED", "RUN_BACKWARD", "Throw"]

"""Values a block streams while the model runs: ``asyncpp.emit(value)`` in a block, and
``async for value in handle.stream()`` (or ``t.stream()``) in the caller, live, as they are made.

The engine calls the run's sink on the model's thread for every emitted value; the sink posts it
to the caller's event loop (asyncio, uvloop or trio) through the loop's thread-safe entry point, so
the caller's iterators wake as values arrive. A stream that begins inside ``async with`` starts
the run there; ``__aexit__`` then waits for that run instead of starting one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

from ..engines.bridge import current_loop, poster
from ..kernel.batching import detach
from ..kernel.errors import AsyncppError
from ..kernel.interleaver import active_interleaver


def emit(value: Any) -> None:
    """Stream ``value`` from the running block to its invoke's ``stream()`` (tensors are detached
    and copied, as a block's result is). Does not wait: the block goes on at once."""
    kernel = active_interleaver()
    block = None if kernel is None else kernel.current
    if block is None:
        raise AsyncppError("asyncpp.emit() can only be called from inside an intervention block")
    if kernel.hooks.on_emit is None:
        raise AsyncppError(
            "this engine does not stream values from blocks (streaming runs on a LocalEngine); "
            "return the values from the block instead"
        )
    kernel.hooks.on_emit(block, detach(value))


EMIT = "emit"  # a value a block emitted
TOKENS = "tokens"  # the tokens an invoke's request sampled in one step (a list of ids)


class StreamEvent(NamedTuple):
    """One event of a streamed trace (``t.events()``, ``h.events()``): ``kind`` is ``"emit"`` (a
    value the invoke's block emitted) or ``"tokens"`` (the token ids its request just sampled)."""

    invoke: Any
    kind: str
    value: Any


class Live:
    """A run started by a stream: every emitted value and sampled token, in order, and the run's
    end."""

    def __init__(self):
        self.items: list[tuple[int, str, Any]] = []  # (invoke index, kind, value), append-only
        self.done = False
        self.settled = False  # the trace has taken the outcome (at its async with's exit)
        self.outcome: Any = None
        self.error: BaseException | None = None
        self._changed: Any = None  # the event consumers wait on (a fresh one after each change)
        self._event_type: Callable[[], Any] | None = None
        self.post: Callable[..., None] | None = None  # the loop's thread-safe entry point

    def bind_loop(self) -> None:
        """Take the running loop's thread-safe entry point and event type."""
        token = current_loop()  # (one code path for asyncio, uvloop and trio, on anyio)
        self.post, self._event_type = poster(token), token.backend_class.create_event
        self._changed = self._event_type()

    # --- called on the model's thread ------------------------------------------------------------

    def sink(self, index: int, value: Any) -> None:
        try:
            self.post(self._add, index, EMIT, value)
        except RuntimeError:  # the caller's loop has closed: nobody is listening
            pass

    def token_sink(self, index: int, tokens: list[int]) -> None:
        try:
            self.post(self._add, index, TOKENS, tokens)
        except RuntimeError:
            pass

    # --- called on the caller's loop -------------------------------------------------------------

    def _add(self, index: int, kind: str, value: Any) -> None:
        self.items.append((index, kind, value))
        self._wake()

    def finish(self, outcome: Any, error: BaseException | None) -> None:
        self.done, self.outcome, self.error = True, outcome, error
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, self._event_type()
        changed.set()

    async def iterate(self, index: int | None, tokens: bool = False) -> AsyncIterator[tuple[int, str, Any]]:
        """Every item (of invoke ``index``, or all; emitted values, and with ``tokens`` the
        sampled tokens too), from the first, as they come, until the run ends."""
        pos = 0
        while True:
            while pos < len(self.items):
                item = self.items[pos]
                pos += 1
                if (index is None or item[0] == index) and (tokens or item[1] is EMIT):
                    yield item
            if self.done:
                return
            await self._changed.wait()

    async def wait(self) -> Any:
        while not self.done:
            await self._changed.wait()
        if self.error is not None:
            raise self.error
        return self.outcome


__all__ = ["EMIT", "TOKENS", "Live", "StreamEvent", "emit"]

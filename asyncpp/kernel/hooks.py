"""Run hooks: what an engine adds to the kernel's generic scheduling, handed over at creation.

The interleaver knows nothing of vLLM, tensor parallelism or pipeline stages. An engine that needs
more than plain forwards builds a :class:`RunHooks` in its own package and passes it to
``Interleaver(..., hooks=...)``; every hook defaults to off. Whether the native single-read fast
path may serve a call is derived from the hooks (:attr:`RunHooks.fast_path`,
:meth:`RunHooks.special_modules`), never from the order in which things were set up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import Any


@dataclass(slots=True)
class RunHooks:
    """The engine's hooks of one interleaver (all off by default; treat them as read-only once
    the interleaver has them: it derives the fast path from them at each run's start).

    * ``on_step(step) -> blocks``: called as each forward begins (an engine that batches requests);
      it sets each taking part block's rows (``block.rows``, ``block.req_rows``), may start new
      blocks, calls ``kernel.set_batch(...)`` and returns the blocks taking part.
    * ``on_emit(block, value)``: takes what a block passes to ``asyncpp.emit()``.
    * ``intercept(block, trap, step, occ) -> value | MISS``: decides, before a block parks on a
      location, whether it is served elsewhere (a pipeline stage that does not own it).
    * ``publish(index, kind, n, value, due)``: sees a value after the blocks at a visit some block
      waited on were served (a pipeline stage publishes it for the other stages).
    * ``on_pull(block, pull) -> value | Throw | PARKED``: ``await`` of a cross-stage value.
    * ``request_level``: modules with one row per request (logits, samples), not one per token.
    * ``adapt_out`` / ``adapt_in``: module index -> an adapter, for values the model holds in
      another form than blocks see them (a tensor-parallel rank's slice, gathered whole; a
      Transformers-backend module's batch dimension of one, dropped). At a visit some block waits
      on, ``to_blocks(held)`` gives what blocks are served and ``to_model(seen, held)`` what the
      model goes on with after them. ``held`` is the output, or for ``adapt_in`` the call's
      ``(args, kwargs)``.
    * ``copy_after``: modules whose output the model edits in place after the call (vLLM's sampler
      divides the logits by the temperature): once blocks have seen it, the model gets a copy.
    * ``refuse(index, kind) -> error | None``: asked before a block parks on a location; an error
      (raised at the block's ``await``) when this engine can never serve it (a compiled engine's
      location that is not a tap); ``refuse_at``: the modules at whose output it may refuse (the
      native fast path leaves waits on their output to the kernel).
    """

    on_step: Callable[[int], list] | None = None
    on_emit: Callable[[Any, Any], None] | None = None
    intercept: Callable[[Any, Any, int, int], Any] | None = None
    publish: Callable[[int, int, int, Any, list], None] | None = None
    on_pull: Callable[[Any, Any], Any] | None = None
    request_level: frozenset[int] = frozenset()
    adapt_out: Mapping[int, Any] | None = None  # (None: no adapters)
    adapt_in: Mapping[int, Any] | None = None
    copy_after: frozenset[int] = frozenset()
    refuse: Callable[[int, int], BaseException | None] | None = None
    refuse_at: AbstractSet[int] = frozenset()

    @property
    def fast_path(self) -> bool:
        """Whether the native fast path may serve plain reads: only when no hook must see every
        served value or decide where a location is served."""
        return self.intercept is None and self.publish is None

    def special_modules(self) -> frozenset[int]:
        """Modules whose values the kernel transforms on the way (narrowed per request, adapted,
        copied after): the fast path leaves their calls to the kernel."""
        return self.request_level | frozenset(self.adapt_out or ()) | self.copy_after

    def with_(self, **changes: Any) -> RunHooks:
        """These hooks with some replaced (an engine adds its pipeline stage's to its own)."""
        return replace(self, **changes)


NO_HOOKS = RunHooks()

__all__ = ["NO_HOOKS", "RunHooks"]

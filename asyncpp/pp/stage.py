"""One pipeline stage's side of running every block on every stage.

The worker of each rank runs every request's block. Its interleaver gets three hooks from here:

* ``intercept``: a read of a location another stage owns returns a lazy :class:`RemoteValue` at
  once (no traffic); a write to one is absorbed (the owner runs the same line and writes it);
* ``publish``: after the blocks at a visit of a location this stage owns were served, each waiting
  request's rows of the value go into the pull buffer (only locations some block waited on);
* ``on_pull``: ``await lazy`` resumes at once when the value can be pulled now (its owner is
  upstream, or it belongs to an earlier round), else the block parks and its pulls are sent to the
  owners at once. It resumes at a non-blocking serve point (:meth:`StageSession.poll`: after the
  stage's forward, before logits and samples) once every pull was answered, or at a blocking one
  outside the forward (:meth:`StageSession.serve`: before a step, at collection), which waits.

The session is also the :class:`Resolver` that forcing a lazy value asks.
"""

from __future__ import annotations

from typing import Any

from ..kernel import batching
from ..kernel.answers import MISS, PARKED, Throw
from ..kernel.block import Block
from ..kernel.interleaver import Interleaver
from ..kernel.traps import KIND_NAMES, WRITE
from ..kernel.views import ValueView
from .ownership import LOCAL, Ownership
from .remote import (
    _UNSET,
    ElsewhereValue,
    Lazy,
    LazyValue,
    RemoteValue,
    RemoteValueError,
    Resolver,
    pull_plan,
    set_resolver,
)

VISIT_CALLS = 4096  # a location's visit = round * VISIT_CALLS + call number within the round


def visit_of(round_: int, call: int) -> int:
    """The visit that addresses a value in the pull buffers: the request's round and the call."""
    return round_ * VISIT_CALLS + call


class _Parked:
    """A block parked on ``await`` of a lazy value, with the pulls sent for what it needs (each
    filling in a remote value, or a selection of one)."""

    __slots__ = ("block", "lazy", "handles")

    def __init__(self, block: Block, lazy: LazyValue, handles: list[tuple[LazyValue, Any]]):
        self.block, self.lazy, self.handles = block, lazy, handles

    def cancel(self, service: Any) -> None:
        for _, handle in self.handles:
            service.cancel(handle)


class StageSession(Resolver):
    """Hooks and serve points of one stage; ``req_of(block)`` is the block's request number."""

    def __init__(self, ownership: Ownership, stage: int, service: Any, req_of: Any):
        self.kernel: Interleaver | None = None  # set by attach()
        self.ownership = ownership
        self.owners = ownership.owners
        self._stage = stage
        self.service = service
        self.req_of = req_of
        self.parked: list[_Parked] = []
        self.outside = False  # at a serve point outside the forward: any produced value may be pulled

    def hooks(self) -> dict[str, Any]:
        """The stage's run hooks, for ``RunHooks.with_(**session.hooks())``."""
        return {"intercept": self.intercept, "publish": self.publish, "on_pull": self.on_pull}

    def attach(self, kernel: Interleaver) -> None:
        """Serve ``kernel``'s blocks (created with this session's hooks); forcing a lazy value on
        this process asks this session from now on."""
        if kernel.hooks.intercept != self.intercept:
            raise ValueError("attach(): create the interleaver with this session's hooks() first")
        self.kernel = kernel
        set_resolver(self)

    # --- interleaver hooks -----------------------------------------------------------------------

    def intercept(self, block: Block, trap: Any, step: int, occ: int) -> Any:
        try:
            return self._intercept(block, trap, occ)
        except Exception as err:  # fails the block, never the forward
            return Throw(err)

    def _intercept(self, block: Block, trap: Any, occ: int) -> Any:
        target = trap.target if trap.TRAP == WRITE else trap
        owner = self.owners[target.index]
        if owner == LOCAL or owner == self._stage:
            return MISS
        if trap.TRAP == WRITE:
            return None  # absorbed: the owning stage runs this line and makes the write
        where = f"{self.ownership.entries[target.index][0] or 'model'}.{KIND_NAMES[target.kind]}"
        round_ = max(block.req_step, 0)  # -1 while the block starts, inside its first round
        value: LazyValue = RemoteValue(
            owner, self.req_of(block), target.key, visit_of(round_, occ), round_, where
        )
        for k in target.keys:
            value = Lazy(k.remote, (value,), {}) if isinstance(k, ValueView) else value[k]
        return value

    def publish(self, index: int, kind: int, n: int, value: Any, due: list) -> None:
        if self.owners[index] != self._stage:
            return
        kernel = self.kernel
        key = index * 4 + kind
        request_level = index in kernel.hooks.request_level
        seen: set[int] = set()
        for w in due:
            block = w.block
            if id(block) in seen:
                continue
            seen.add(id(block))
            req, visit = self.req_of(block), visit_of(max(block.req_step, 0), n)
            try:
                if request_level:
                    rows = batching.narrow(value, block.req_rows, kernel.req_batch)
                else:
                    rows = batching.narrow(value, block.rows, kernel.batch_size)
                self.service.publish(req, key, visit, rows)
            except Exception as err:  # the other stages' pulls of it fail, not this forward
                self.service.fail(req, key, visit, f"stage {self._stage} could not publish it: {err}")

    def on_pull(self, block: Block, pull: Any) -> Any:
        lazy = pull.value
        plan = pull_plan(lazy)
        if all(self.available(leaf) for _, leaf, _ in plan):
            try:
                return lazy.force(plan)
            except Exception as err:
                return Throw(err)
        try:
            handles = self._request(plan)
        except Exception as err:  # the pull cannot be made at all: raised at the block's await
            return Throw(err)
        self.parked.append(_Parked(block, lazy, handles))
        return PARKED

    def _request(self, plan: list[tuple[LazyValue, RemoteValue, tuple]]) -> list[tuple[LazyValue, Any]]:
        """Send the pulls of a pull plan (:func:`~.remote.pull_plan`: what a lazy value still
        needs, each with its selection) to their owners now, all of them before any answer is
        waited for; the owners answer once they produced the values."""
        handles: list[tuple[LazyValue, Any]] = []
        try:
            for node, leaf, select in plan:
                if isinstance(leaf, ElsewhereValue):
                    raise RemoteValueError(leaf.unavailable())
                owner, req, key, visit, where = self._address(leaf)
                handles.append(
                    (node, self.service.request(owner, req, key, visit, where=where, select=select))
                )
        except Exception:
            for _, handle in handles:
                self.service.cancel(handle)
            raise
        return handles

    # --- serve points ----------------------------------------------------------------------------

    def poll(self) -> None:
        """A non-blocking serve point (after this stage's forward, before logits and samples are
        offered): resume the parked blocks whose every pull has been answered (their owners
        produced the values); the others stay parked. Resumed code runs under the forward's rules."""
        ready = [p for p in self.parked if all(h.answered() for _, h in p.handles)]
        if not ready:
            return
        done = {id(p) for p in ready}
        self.parked = [p for p in self.parked if id(p) not in done]
        self._resume(ready)

    def serve(self, blocks: list[Block] | None = None) -> None:
        """A blocking serve point outside the forward: resolve parked pulls (of these blocks, or
        all), each waiting for its owner to produce the value, and resume their blocks."""
        if not self.parked:
            return
        mine = None if blocks is None else {id(b) for b in blocks}
        keep, due = [], []
        for entry in self.parked:
            (due if mine is None or id(entry.block) in mine else keep).append(entry)
        self.parked = keep
        self.outside = True
        try:
            self._resume(due)
        finally:
            self.outside = False

    def _resume(self, entries: list[_Parked]) -> None:
        kernel = self.kernel
        service = self.service
        for entry in entries:
            block = entry.block
            if block.done:
                entry.cancel(service)
                continue
            try:
                for node, handle in entry.handles:
                    node.set_value(service.wait(handle))
                value = entry.lazy.force()
            except Exception as err:
                entry.cancel(service)
                kernel.wake(block, Throw(err))
            else:
                kernel.wake(block, value)
        kernel.serve()

    def forget(self, block: Block) -> None:
        """Drop the block's parked pulls; those still in flight are cancelled at their owners."""
        keep = []
        for entry in self.parked:
            if entry.block is block:
                entry.cancel(self.service)
            else:
                keep.append(entry)
        self.parked = keep

    # --- Resolver --------------------------------------------------------------------------------

    def stage(self) -> int:
        return self._stage

    def available(self, leaf: RemoteValue) -> bool:
        if isinstance(leaf, ElsewhereValue):
            return False
        if self.outside or leaf.owner < self._stage:
            return True
        current = self.kernel.current
        return current is not None and leaf.round < current.req_step

    def fetch(self, leaf: RemoteValue, select: tuple = ()) -> Any:
        owner, req, key, visit, where = self._address(leaf)
        return self.service.pull(owner, req, key, visit, where=where, select=select)

    def fetch_all(self, plan: list[tuple[LazyValue, RemoteValue, tuple]]) -> list[Any]:
        handles = self._request(plan)
        try:
            return [self.service.wait(handle) for _, handle in handles]
        except Exception:
            for _, handle in handles:
                self.service.cancel(handle)
            raise

    @staticmethod
    def _address(leaf: RemoteValue) -> tuple[int, int, int, int, str]:
        where = f"{leaf.where} (request {leaf.req}, round {leaf.round})"
        return leaf.owner, leaf.req, leaf.key, leaf.visit, where

    # --- results ---------------------------------------------------------------------------------

    def result(self, obj: Any) -> Any:
        """A block's result as this stage returns it: remote values it does not hold become "not on
        this rank" (their owner returns them), and so do values computed from one other stage's
        values alone (that stage computes them from its real ones); values that also involve a real
        tensor here and only upstream values are computed here (pulling them); values computed from
        a downstream value are left to the stages downstream."""
        from .merge import NOT_HERE

        if isinstance(obj, LazyValue):
            if obj._value is not _UNSET:
                return obj._value
            if not isinstance(obj, Lazy):
                return NOT_HERE
            leaves = obj.leaves()
            if not obj.has_real and len({leaf.owner for leaf in leaves}) == 1:
                return NOT_HERE
            if all(leaf.owner < self._stage for leaf in leaves):
                return obj.force()
            return NOT_HERE
        t = type(obj)
        if t is tuple:
            return tuple(self.result(o) for o in obj)
        if t is list:
            return [self.result(o) for o in obj]
        if t is dict:
            return {k: self.result(v) for k, v in obj.items()}
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return t._make(self.result(o) for o in obj)
        return obj

    def close(self) -> None:
        set_resolver(None)

"""The interleaver: drives intervention blocks from inside a model's forward pass.

One :class:`Interleaver` serves one run (one forward, or one generate loop) of one batch. Blocks are
plain coroutines stepped with ``send``/``throw``; what they yield are traps (see :mod:`.traps`).

Where things happen, for a newcomer:

* a block is **started** by :meth:`Interleaver.start` (before the forward, or when a request first
  appears), runs until its first trap, and parks;
* it is **stepped** by :meth:`Interleaver.visit`, which the engine's per-module controller calls when
  the model reaches a module some block waits on (a set lookup decides that), and by
  :meth:`Interleaver.serve` at serve points outside the forward;
* it is **finished** by :meth:`Interleaver.finish` at the end of the run: step loops end, waits that
  were never reached are thrown into their blocks at the waiting line, survivors are closed.

Seams for engines: ``intercept`` (decide, before a block parks, whether a location is served
locally), ``publish`` (see every served value before it goes back to the model) and ``switch`` (the
thread-local-state swap at every switch into and out of a block).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from . import batching, budget, grad, traps
from .errors import AsyncppError, ForeignAwaitError, InternalError, NeverReachedError, OrderError, WriteError
from .traps import (
    BACKWARD,
    GATHER,
    GRAD,
    INPUT,
    INPUTS,
    KIND_NAMES,
    OUTPUT,
    PULL,
    READ,
    SKIP,
    SLOT,
    STEP,
    WRITE,
    Read,
)

PARKED = object()  # a handler parked the block
_RUN_BACKWARD = object()  # a handler parked the block and its backward pass is to run now
MISS = object()  # an intercept declined to serve a location
END = object()  # sent to a step gate when generation has ended
_NOTHING = object()
_active = threading.local()  # the interleaver running blocks on this thread


def active_interleaver() -> Interleaver | None:
    """The interleaver whose run is executing on this thread, if any."""
    return getattr(_active, "kernel", None)


class _Throw:
    """A handler's answer that is an exception to throw into the block at its ``await``."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


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
    )
    # state: the block's torch thread-local state (a BlockState of the switch), or None

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
        self.state: Any = None  # torch thread-local state owned by the switch hook
        self.req_step = -1  # generation steps of its request begun so far, minus one
        self.req_rows: tuple[int, int] | None = rows  # its rows of request-level values (logits)
        self.ended = False  # its generation is over: step loops end, waits cannot be served
        self.seen: dict | None = None  # gradient runs: the values it was served, for loc.grad
        self.session: Any = None  # its open asyncpp.backward(...) session
        self.budget_step = -1  # with a time budget: the step its time is counted in, and that time
        self.budget_used = 0.0

    def where(self) -> str:
        """File and line where the block is suspended."""
        frame = getattr(self.coro, "cr_frame", None)
        if frame is None:
            return "<finished>"
        return f"{frame.f_code.co_filename}:{frame.f_lineno}"


# A parked wait on a module location is a tuple (cheaper than an object on the hot path):
# (invoke order, block, trap, step, call number, gather state or None, index in the gather)
def _order_of(w: tuple) -> int:
    return w[0]


class _GatherState:
    __slots__ = ("block", "values", "remaining")

    def __init__(self, block: Block, n: int):
        self.block = block
        self.values = [None] * n
        self.remaining = n


class _Visit:
    """The module visit being served: its current (possibly replaced) values."""

    __slots__ = ("index", "n", "stage", "args", "kwargs", "out", "skip", "parts")

    def __init__(self, index: int, n: int, stage: int, args=(), kwargs=None, out=None):
        self.index = index
        self.n = n
        self.stage = stage  # INPUT for the input stage (input, inputs, skip), OUTPUT after the call
        self.args = args
        self.kwargs = kwargs
        self.out = out
        self.skip = _NOTHING
        self.parts: dict | None = None  # gradient runs: kind -> grad.RowParts cut at this visit

    def get(self, kind: int) -> Any:
        if kind == OUTPUT:
            return self.out
        if kind == INPUT:
            if self.args:
                return self.args[0]
            if self.kwargs:
                return next(iter(self.kwargs.values()))
            return None
        if kind == INPUTS:
            return (self.args, self.kwargs)
        return None if self.skip is _NOTHING else self.skip

    def set(self, kind: int, value: Any, where: str) -> None:
        if kind == OUTPUT:
            self.out = value
        elif kind == INPUT:
            if self.args:
                self.args = (value, *self.args[1:])
            elif self.kwargs:
                key = next(iter(self.kwargs))
                self.kwargs = {**self.kwargs, key: value}
            else:
                raise WriteError(f"{where}: this call has no input to replace")
        elif kind == INPUTS:
            if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)):
                raise WriteError(f"{where}: inputs must be replaced by a tuple (args, kwargs)")
            self.args, self.kwargs = tuple(value[0]), dict(value[1])
        else:
            self.skip = value


class _FastVisit(_Visit):
    """The call the native fast path is serving: its output lives in the controllers' slot, so a
    write by the block being resumed there reaches the model."""

    __slots__ = ("slot",)

    def __init__(self, slot: Any):
        self.slot = slot
        self.index, self.n, self.stage = slot.visit_index, slot.visit_n, OUTPUT
        self.args, self.kwargs, self.skip = (), None, _NOTHING
        self.parts = None

    @property
    def out(self) -> Any:  # type: ignore[override]
        return self.slot.visit_out

    @out.setter
    def out(self, value: Any) -> None:
        self.slot.visit_out = value


def _same_value(a: Any, b: Any) -> bool:
    """Whether a visit's value is still the one pieces were cut from (``inputs`` is rebuilt as a
    fresh ``(args, kwargs)`` pair each time it is read)."""
    if a is b:
        return True
    return type(a) is tuple and type(b) is tuple and len(a) == len(b) == 2 and a[0] is b[0] and a[1] is b[1]


def _stage(kind: int) -> int:
    return OUTPUT if kind == OUTPUT else INPUT


class Interleaver:
    """The scheduler of one run. See the module docstring for the life of a block."""

    __slots__ = (
        "names",
        "batch_size",
        "counts",
        "seen_in",
        "waits",
        "hot_in",
        "hot_out",
        "_refs_in",
        "_refs_out",
        "ready",
        "blocks",
        "current",
        "serving",
        "step",
        "steps_begun",
        "step_index",
        "_gates",
        "position",
        "intercept",
        "publish",
        "switch",
        "_enter",
        "_leave",
        "_template",
        "slot",
        "_visit",
        "finished",
        "on_step",
        "request_level",
        "req_batch",
        "shard_out",
        "shard_in",
        "copy_after",
        "on_pull",
        "grad",
        "on_emit",
        "budget",
        "__weakref__",
    )

    def __init__(
        self,
        names: list[str],
        batch_size: int,
        *,
        step_index: int | None = None,
        switch: Any = None,
        slot: Any = None,
        tls_template: Any = None,
        grad: bool = False,
    ):
        n = len(names)
        self.names = names  # module path per module index
        self.batch_size = batch_size
        self.counts = [0] * n  # completed visits per module in the current step
        self.seen_in = [-1] * n  # visit number whose input stage was served, per hot module
        self.waits: dict[int, list[tuple]] = {}  # key index*4+kind -> parked waits, invoke order
        # modules some block waits on, by stage: the controllers' lookups before and after a call
        self.hot_in: set[int] = set()
        self.hot_out: set[int] = set()
        self._refs_in = [0] * n  # waits per module on its input stage
        self._refs_out = [0] * n  # waits per module on its output
        self.ready: deque = deque()  # (block, value, is_error) woken outside a visit's own loop
        self.blocks: list[Block] = []
        self.current: Block | None = None  # the block being resumed
        self.serving: _Visit | None = None
        self.step = 0  # current generation step
        self.steps_begun = 0
        self.step_index = step_index  # module whose visits begin steps (the root), or None
        self._gates: list[tuple[Block, Any, int]] = []  # (block, gate, target step)
        self.position: Any = "the start of the run"  # where the model is: a str or (index, kind, n)
        self.intercept: Callable | None = None  # (block, read, step, occ) -> value | MISS
        # (index, kind, n, value, due waits) -> None: the value after the blocks at a visit some
        # block waited on were served (pipeline stages publish it for the other stages)
        self.publish: Callable | None = None
        self.switch = switch  # the thread-local-state swap: BlockState(), enter(s), leave(s)
        self._enter = switch.enter if switch is not None else None
        self._leave = switch.leave if switch is not None else None
        # the state new blocks start from is copied from this one when the thread still has it
        # (engines keep one across runs: the thread's state at a run's start rarely changes)
        self._template = tls_template
        self.slot = slot  # the engine's controller slot: .bypass is set while a block's code runs
        self._visit = _Visit(-1, -1, OUTPUT)  # reused by the single-read fast path
        self.finished = False
        # engines that batch many requests (vLLM): on_step(step) is called as each forward begins
        # and returns the blocks taking part (it sets their rows, and may start new blocks);
        # request_level modules (logits, samples) have one row per request, req_batch of them
        self.on_step: Callable[[int], list[Block]] | None = None
        self.request_level: frozenset[int] = frozenset()
        self.req_batch = batch_size
        # tensor parallel engines: modules whose output / first input each rank holds a slice of;
        # gathered whole for the blocks at a visit some block waits on, split again after
        self.shard_out: dict[int, Any] = {}
        self.shard_in: dict[int, Any] = {}
        # modules whose output the model edits in place after the call (vLLM's sampler divides the
        # logits by the temperature): once blocks have seen such a value, the model gets a copy
        self.copy_after: frozenset[int] = frozenset()
        # pipeline parallel engines: ``await`` of a cross-stage value (block, pull trap) -> value,
        # _Throw, or PARKED (the stage resumes the block at a serve point, through wake + serve)
        self.on_pull: Callable[[Block, Any], Any] | None = None
        # gradient runs (local engine, grad=True): invokes' rows are cut inside the autograd graph,
        # served values are kept per block for loc.grad, and blocks may run backward passes
        self.grad = grad
        # streaming engines: on_emit(block, value) takes what a block passes to asyncpp.emit()
        self.on_emit: Callable[[Block, Any], None] | None = None
        # a StepBudget: each block's code may run so long per step (else BlockTimeoutError); the
        # outermost resumes are timed through _budget_enter/_budget_leave (natively resumed ones too)
        self.budget: Any = None
        if step_index is not None:
            self._ref(step_index, INPUT)  # the root's calls begin steps, so it is always watched

    def activate_here(self) -> None:
        """Mark this interleaver as the one running blocks on the calling thread, for good (an
        engine whose thread runs nothing else: a vLLM worker)."""
        _active.kernel = self

    @contextmanager
    def active(self):
        """Mark this interleaver as the one running blocks on the calling thread."""
        prev = getattr(_active, "kernel", None)
        _active.kernel = self
        try:
            yield self
        finally:
            _active.kernel = prev

    # ----------------------------------------------------------------------------------------
    # starting and stepping blocks

    def start(
        self,
        coro,
        order: int,
        rows: tuple[int, int] | None = None,
        name: str = "block",
        req_rows: Any = _NOTHING,
    ) -> Block:
        """Register a block coroutine and run it until its first wait. ``rows`` are its rows of
        the batch (None: all); ``req_rows`` its rows of request-level values (default: ``rows``)."""
        block = Block(coro, order, rows, name)
        if req_rows is not _NOTHING:
            block.req_rows = req_rows
        block.step = self.step
        self.blocks.append(block)
        if self.switch is not None:
            if self._template is None:
                self._template = self.switch.BlockState()
            block.state = self._template.fork()  # the thread's state as its first entry (now) finds it
        self._resume(block, None, None)
        return block

    def _resume(
        self, block: Block, value: Any, exc: BaseException | None, msg: Any = _NOTHING, entered: bool = False
    ) -> None:
        """Step ``block`` until it parks or ends. The one place a block's code runs (the native
        fast path in csrc/controller.cpp repeats it for plain reads, and hands anything else here
        as ``msg``, a trap the block has already yielded, with the block's state still ``entered``)."""
        prev = self.current
        timed = prev is None and self.budget is not None  # (the outermost resume is timed)
        if timed and not self._budget_enter(block):
            return
        self.current = block
        block.waiting = None
        state = None if entered else block.state
        if state is not None:
            self._enter(state)
        slot = None if entered else self.slot
        if slot is not None:
            outer_bypass = slot.bypass
            slot.bypass = True
        coro = block.coro
        run_backward = False
        try:
            while True:
                if msg is _NOTHING:
                    try:
                        msg = coro.send(value) if exc is None else coro.throw(exc)
                    except StopIteration as stop:
                        self._complete(block, stop.value)
                        return
                    except Exception as err:  # the block's own error: it fails alone
                        self._fail(block, err)
                        return
                    except BaseException as err:  # KeyboardInterrupt and friends end the run
                        self._fail(block, err)
                        raise
                exc = None
                trap = getattr(msg, "TRAP", None)
                if trap == READ:
                    value = self._on_read(block, msg)
                elif trap == SLOT:
                    value = self._on_slot(block, msg)
                elif trap == WRITE:
                    value = self._on_write(block, msg)
                elif trap == STEP:
                    value = self._on_step(block, msg)
                elif trap == GATHER:
                    value = self._on_gather(block, msg)
                elif trap == PULL and self.on_pull is not None:
                    value = self.on_pull(block, msg)
                elif trap == GRAD:
                    value = self._on_grad(block, msg)
                elif trap == BACKWARD:
                    value = self._on_backward(block, msg)
                else:
                    value = _Throw(_foreign(msg))
                if value is PARKED:
                    block.waiting = msg
                    return
                if value is _RUN_BACKWARD:
                    block.waiting = msg
                    run_backward = True
                    return
                msg = _NOTHING
                if type(value) is _Throw:
                    exc, value = value.exc, None
        finally:
            if timed:
                self._budget_leave(block)
            if slot is not None:
                slot.bypass = outer_bypass
            if state is not None:
                self._leave(state)
            self.current = prev
            if run_backward:  # with the forward's state back, outside the block's frame
                self._run_backward(block)

    def _budget_enter(self, block: Block) -> bool:
        """Start timing an outermost resume of ``block`` (kernel.budget is set); False when the
        block ran out of time earlier, caught the error and waited again: it is closed instead."""
        if block.budget_used == math.inf:
            self._close(block)
            return False
        self.budget.enter(block, self.step)
        return True

    def _budget_leave(self, block: Block) -> None:
        if self.budget.leave() and not block.done:
            block.budget_used = math.inf
            block.error = self.budget.error(block)  # kept when it is closed at its next resume

    def wake(self, block: Block, value: Any, gather: _GatherState | None = None, slot: int = 0) -> None:
        """Make a parked block runnable (a slot was set). It runs in the current visit's loop, or
        at the next serve point."""
        if block.done:
            return
        if gather is not None:
            gather.values[slot] = value
            gather.remaining -= 1
            if gather.remaining:
                return
            value = gather.values
        self.ready.append((block, value))

    def serve(self) -> None:
        """A serve point: resume every block made runnable since the last one."""
        ready = self.ready
        while ready:
            block, value = ready.popleft()
            if not block.done:
                self._unpark(block)
                if type(value) is _Throw:
                    self._resume(block, None, value.exc)
                else:
                    self._resume(block, value, None)

    # ----------------------------------------------------------------------------------------
    # trap handlers: each returns a value to send back, a _Throw, or PARKED

    def _visit_of(self, target: Read, step: int) -> _Visit | None:
        """The visit being served, if ``target`` (at ``step``) is one of its locations."""
        v = self.serving
        if v is None and self.slot is not None and self.slot.in_visit:
            v = _FastVisit(self.slot)
        if (
            v is not None
            and v.index == target.index
            and v.n == target.occ
            and step == self.step
            and v.stage == _stage(target.kind)
        ):
            return v
        return None

    def _on_read(self, block: Block, trap: Read, gather: _GatherState | None = None, gi: int = 0):
        step = block.step
        v = self._visit_of(trap, step)
        if v is not None:
            return self._read_value(block, v, trap)  # a location of the visit being served
        occ = trap.occ
        if self.intercept is not None:
            got = self.intercept(block, trap, step, occ)
            if got is not MISS:
                return got
        if self._passed(trap.index, trap.kind, step, occ):
            return _Throw(self._order_error(trap, step))
        self._park(block, trap, trap.key, trap.index, step, occ, gather, gi)
        return PARKED

    def _on_write(self, block: Block, write):
        try:
            block.writes.remove(write)
        except ValueError:
            pass
        target = write.target
        occ = target.occ
        step = block.step
        v = self._visit_of(target, step)
        if v is not None:
            try:
                self._apply_write(block, v, write)
            except Exception as err:
                return _Throw(err)
            return None
        if self.intercept is not None:
            got = self.intercept(block, write, step, occ)
            if got is not MISS:
                return got
        if self._passed(target.index, target.kind, step, occ):
            return _Throw(self._order_error(target, step))
        self._park(block, write, target.key, target.index, step, occ)
        return PARKED

    def _on_slot(self, block: Block, slot):
        if slot.is_set:
            return slot.value
        slot._waiters.append((self, block, None, 0))
        return PARKED

    def _on_step(self, block: Block, gate):
        if block.ended:
            return END
        current = block.req_step  # the block's request's step under way (-1: none yet)
        target = gate.steps.first_at_or_after(max(gate.after, current, 0))
        if target is None:
            return END
        if target == current:
            block.step = self.step  # that step is under way: enter it at once
            return target
        self._gates.append((block, gate, target))
        return PARKED

    def _on_gather(self, block: Block, gather):
        items = gather.items
        state = _GatherState(block, len(items))
        for i, item in enumerate(items):
            trap = getattr(item, "TRAP", None)
            if trap == READ:
                got = self._on_read(block, item, state, i)
                if got is PARKED:
                    continue
                if type(got) is _Throw:
                    self._unpark(block, gather)
                    return got
                state.values[i] = got
            elif trap == SLOT:
                if item.is_set:
                    state.values[i] = item.value
                else:
                    item._waiters.append((self, block, state, i))
                    continue
            else:
                self._unpark(block, gather)
                for other in items:
                    if getattr(other, "TRAP", None) is None and hasattr(other, "close"):
                        other.close()  # a rejected coroutine: no never-awaited warning
                return _Throw(
                    ForeignAwaitError(f"asyncpp.gather() takes locations and slots; item {i} is {item!r}")
                )
            state.remaining -= 1
        if state.remaining == 0:
            return state.values
        return PARKED

    # ----------------------------------------------------------------------------------------
    # parking

    def _park(self, block: Block, trap, key: int, index: int, step: int, occ: int, gather=None, gi: int = 0):
        w = (block.order, block, trap, step, occ, gather, gi)
        lst = self.waits.get(key)
        if lst is None:
            self.waits[key] = [w]
        else:
            lst.append(w)
            if lst[-2][0] > block.order:
                lst.sort(key=_order_of)
        self._ref(index, key & 3)

    def _unpark(self, block: Block, trap: Any = None) -> None:
        """Remove every wait of ``block`` (all items of a gather, say) from the wait lists."""
        if trap is None:
            trap = block.waiting
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
            kept = [w for w in lst if w[1] is not block]
            removed = len(lst) - len(kept)
            if removed:
                if kept:
                    waits[key] = kept
                else:
                    del waits[key]
                self._unref(key >> 2, key & 3, removed)

    def _ref(self, index: int, kind: int, n: int = 1) -> None:
        if kind == OUTPUT:
            refs, hot = self._refs_out, self.hot_out
        else:
            refs, hot = self._refs_in, self.hot_in
        r = refs[index]
        refs[index] = r + n
        if not r:
            hot.add(index)

    def _unref(self, index: int, kind: int, n: int = 1) -> None:
        if kind == OUTPUT:
            refs, hot = self._refs_out, self.hot_out
        else:
            refs, hot = self._refs_in, self.hot_in
        r = refs[index] - n
        refs[index] = r
        if not r:
            hot.discard(index)

    def _passed(self, index: int, kind: int, step: int, occ: int) -> bool:
        if step != self.step:
            return step < self.step
        count = self.counts[index]
        if occ < count:
            return True
        return occ == count and kind != OUTPUT and self.seen_in[index] == occ

    # ----------------------------------------------------------------------------------------
    # serving a module visit (called by the engine's controller when ``index in hot``)

    def visit(self, index: int, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """Run one call of module ``index``, serving its input and output waits."""
        if index == self.step_index:
            self._begin_step()
        n = self.counts[index]
        self.seen_in[index] = n
        base = index * 4
        waits = self.waits
        if base in waits or base + 1 in waits or base + 3 in waits:
            shard = self.shard_in.get(index) if self.shard_in else None
            if shard is not None and args:
                local = args[0]
                args = (shard.gather(local), *args[1:])
            v = _Visit(index, n, INPUT, args, kwargs)
            self._serve_visit(v, (INPUT, INPUTS, SKIP))
            args, kwargs, skip = v.args, v.kwargs, v.skip
            if shard is not None and args:
                args = (shard.split(args[0], local), *args[1:])
            if skip is not _NOTHING:
                return self.visit_output(index, skip)
        return self.visit_output(index, forward(*args, **kwargs))

    def visit_output(self, index: int, out: Any) -> Any:
        """Finish a call of module ``index``: count it, serve its output waits."""
        counts = self.counts
        n = counts[index]
        counts[index] = n + 1
        key = index * 4 + 2
        lst = self.waits.get(key)
        self.position = (index, OUTPUT, n)
        if lst is None:
            return out
        if len(lst) == 1 and self.serving is None and self.publish is None and not self.grad:
            # the common case: one plain read of this very call, by a block that sees the batch
            order, block, trap, step, occ, gather, _ = lst[0]
            if occ == n and step == self.step and gather is None and block.rows is None:
                if trap.TRAP == READ and not trap.keys:
                    del self.waits[key]
                    refs = self._refs_out
                    r = refs[index] - 1
                    refs[index] = r
                    if not r:
                        self.hot_out.discard(index)
                    v = self._visit
                    v.index, v.n, v.stage, v.out = index, n, OUTPUT, out
                    self.serving = v
                    try:
                        self._resume(block, out, None)
                        if self.ready:
                            self.serve()
                    finally:
                        self.serving = None
                    out, v.out = v.out, None
                    return out
        shard = self.shard_out.get(index) if self.shard_out else None
        v = _Visit(index, n, OUTPUT, out=out if shard is None else shard.gather(out))
        prev, self.serving = self.serving, v
        try:
            due = self._serve_waits(v, OUTPUT, key, lst)
            if self.ready:
                self.serve()
        finally:
            self.serving = prev
        if v.parts is not None:
            self._rebuild(v)
        if self.publish is not None and due:
            self.publish(index, OUTPUT, n, v.out, due)
        out = v.out if shard is None else shard.split(v.out, out)
        return batching.copy(out) if index in self.copy_after else out

    def _serve_visit(self, v: _Visit, kinds: tuple) -> None:
        prev, self.serving = self.serving, v
        base = v.index * 4
        served = []
        try:
            for kind in kinds:
                lst = self.waits.get(base + kind)
                if lst:
                    self.position = (v.index, kind, v.n)
                    served.append((kind, self._serve_waits(v, kind, base + kind, lst)))
            if self.ready:
                self.serve()
        finally:
            self.serving = prev
        if v.parts is not None:
            self._rebuild(v)
        if self.publish is not None:
            for kind, due in served:
                if due:
                    self.publish(v.index, kind, v.n, v.get(kind), due)

    def _serve_waits(self, v: _Visit, kind: int, key: int, lst: list) -> list:
        """Serve the waits of ``lst`` due at this visit; returns them (the publish hook's)."""
        step, n = self.step, v.n
        due = [w for w in lst if w[4] == n and w[3] == step]
        if not due:
            return due
        if len(due) == len(lst):
            del self.waits[key]
        else:
            self.waits[key] = [w for w in lst if not (w[4] == n and w[3] == step)]
        self._unref(v.index, kind, len(due))
        for _, block, trap, _, _, gather, gi in due:
            if block.done:
                continue
            if gather is not None:
                try:
                    value = self._read_value(block, v, trap)
                except Exception as err:
                    self._unpark(block)
                    self._resume(block, None, err)
                    continue
                self.wake(block, value, gather, gi)
                continue
            if trap.TRAP == WRITE:
                try:
                    self._apply_write(block, v, trap)
                except Exception as err:
                    self._resume(block, None, err)
                    continue
                self._resume(block, None, None)
            else:
                try:
                    value = self._read_value(block, v, trap)
                except Exception as err:
                    self._resume(block, None, err)
                    continue
                self._resume(block, value, None)
        return due

    def _read_value(self, block: Block, v: _Visit, trap: Read) -> Any:
        value = v.out if trap.kind == OUTPUT else v.get(trap.kind)
        if v.index in self.request_level:
            value = batching.narrow(value, block.req_rows, self.req_batch)
        elif self.grad:
            if block.rows is not None:
                value = self._parts(v, trap.kind, value).get(block.rows)
            if block.seen is None:
                block.seen = {}
            block.seen[(trap.key, self.step, v.n)] = value
        elif block.rows is not None:
            value = batching.narrow(value, block.rows, self.batch_size)
        if trap.keys:
            value = batching.get_item(value, trap.keys)
        return value

    def _apply_write(self, block: Block, v: _Visit, write) -> None:
        target = write.target
        where = target.describe()
        if target.kind == SKIP:
            if block.rows is not None:
                where = f"{self.names[target.index]}.skip"
                raise WriteError(
                    f"{where}: skipping a module is only possible from an invoke that sees the whole "
                    f"batch (invoke without input, or run this invoke in a trace of its own)"
                )
            v.skip = write.value
            return
        current = v.get(target.kind)
        if v.index in self.request_level:
            rows, batch = block.req_rows, self.req_batch
        else:
            rows, batch = block.rows, self.batch_size
        if self.grad and rows is not None:
            self._write_rows(block, v, target, write.value, current, where)
            return
        new = batching.put_at(current, target.keys, write.value, rows, batch, where)
        v.set(target.kind, new, where)
        if self.grad and not target.keys and block.seen is not None:
            block.seen[(target.key, self.step, v.n)] = new  # the value the model goes on with

    # ----------------------------------------------------------------------------------------
    # gradient runs (see .grad): rows cut inside the graph, backward passes blocks drive

    def _parts(self, v: _Visit, kind: int, value: Any) -> grad.RowParts:
        """The row pieces of ``v``'s value of ``kind``, cut afresh if the value was replaced."""
        parts = v.parts
        if parts is None:
            parts = v.parts = {}
        p = parts.get(kind)
        if p is None or not _same_value(p.base, value):
            p = parts[kind] = grad.RowParts(value, self.batch_size)
        return p

    def _write_rows(self, block: Block, v: _Visit, target: Read, new: Any, current: Any, where: str) -> None:
        """A write by an invoke that owns rows, in a gradient run: its piece is replaced (or edited
        in place, for a sub-location), and the model goes on with the pieces put back together."""
        rows = block.rows
        part = self._parts(v, target.kind, current)
        if target.keys:
            batching.put_at(part.get(rows), target.keys, new, None, self.batch_size, where)
            return
        batching.widen(current, new, rows, self.batch_size, where, build=False)  # the checks only
        part.pieces[rows] = new
        if block.seen is not None:
            block.seen[(target.key, self.step, v.n)] = new  # the value the model goes on with

    def _rebuild(self, v: _Visit) -> None:
        for kind in (INPUT, INPUTS, OUTPUT):
            p = v.parts.get(kind)
            if p is not None and p.pieces and _same_value(p.base, v.get(kind)):
                v.set(kind, p.rebuild(), "")
        v.parts = None

    def _on_backward(self, block: Block, session: grad.Backward):
        if session.op == "open":
            if not self.grad:
                return _Throw(
                    AsyncppError(
                        "asyncpp.backward() needs a trace with gradients: asyncpp.trace(engine, grad=True) "
                        "on a LocalEngine (vLLM runs the model under inference mode, without gradients)"
                    )
                )
            if block.session is not None:
                return _Throw(AsyncppError("a block can drive one asyncpp.backward(...) at a time"))
            if session.state != "new":
                return _Throw(AsyncppError("this asyncpp.backward(...) was already used; make a new one"))
            session.state, session.block = "open", block
            block.session = session
            return session
        # closing: run the pass if nothing in the body did, or wait until the running one ends
        if block.session is not session:
            return None
        if session.state == "open":
            return _RUN_BACKWARD
        if session.state == "running":
            return PARKED  # resumed by _run_backward when the pass ends
        block.session = None
        return None

    def _on_grad(self, block: Block, wait: grad.GradWait):
        if wait.replace:
            try:
                block.writes.remove(wait)
            except ValueError:
                pass
        session = block.session
        what = wait.describe()
        if session is None or session.state == "done":
            return _Throw(
                AsyncppError(
                    f"{what} can only be awaited inside `async with asyncpp.backward(loss):` in the "
                    f"block that awaited {wait.target.describe()} in the forward"
                )
            )
        target = wait.target
        seen = None if block.seen is None else block.seen.get((target.key, block.step, target.occ))
        if seen is None:
            return _Throw(
                AsyncppError(
                    f"{what}: the block did not await {target.describe()} in the forward; await the "
                    f"location first (its value is what the gradient is taken with respect to)"
                )
            )
        tensor, rest = grad.split_keys(seen, target.keys)
        if not isinstance(tensor, torch.Tensor):
            return _Throw(AsyncppError(f"{what}: the value there is a {type(tensor).__name__}, not a tensor"))
        tid = id(tensor)
        serving = session.serving
        if serving is not None and serving[0] == tid:  # the gradient being served right now
            return self._grad_now(session, wait, serving[1], rest)
        if tid in session.fired:
            return _Throw(
                OrderError(
                    f"{what} has already passed in this backward pass: await gradients in the order "
                    f"the backward reaches them, from the loss back towards the inputs"
                )
            )
        session.waiting = (tid, wait, rest)
        return _RUN_BACKWARD if session.state == "open" else PARKED

    def _grad_now(self, session: grad.Backward, wait: grad.GradWait, gradient: Any, rest: tuple):
        """Serve ``wait`` with the gradient arriving now (the value the hook will pass on)."""
        current = gradient if session.replacement is None else session.replacement
        if not wait.replace:
            return batching.get_item(current, rest) if rest else current
        where = wait.describe()
        new = wait.value
        if rest:  # a part of the gradient (loc[:, -1].grad): assigned into a copy of it
            current = current.clone()
            batching.get_item(current, rest[:-1])[rest[-1]] = new
            new = current
        elif not isinstance(new, torch.Tensor) or new.shape != gradient.shape:
            shape = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            return _Throw(
                WriteError(
                    f"{where}: the replacement has shape {shape}, the gradient {tuple(gradient.shape)}"
                )
            )
        session.replacement = new
        return None

    def _run_backward(self, block: Block) -> None:
        """Run the backward pass of ``block``'s session; hooks on the values it awaited resume it."""
        session = block.session
        session.state = "running"
        targets: dict[int, torch.Tensor] = {}
        for value in (block.seen or {}).values():
            for t in grad.tensors_of(value):
                if t.requires_grad:
                    targets[id(t)] = t
        handles = [t.register_hook(self._grad_hook(session, tid)) for tid, t in targets.items()]
        error: BaseException | None = None
        try:
            torch.autograd.backward(
                session.loss, session.gradient, retain_graph=session.retain_graph, inputs=session.inputs
            )
        except Exception as err:
            error = err
        finally:
            for h in handles:
                h.remove()
        session.state = "done"
        if error is None and session.error is not None:
            error = session.error
        if block.done:
            return
        waiting = block.waiting
        block.waiting = None
        if getattr(waiting, "TRAP", None) == GRAD:
            session.waiting = None
            if error is None:
                error = NeverReachedError(
                    f"{waiting.describe()} was never reached: the backward pass of the loss (from "
                    f"{session.line}) ended without a gradient for it (the loss does not depend on it)"
                )
        elif waiting is session:
            block.session = None
        elif error is None:
            return  # parked elsewhere (a forward location): nothing to resume here
        self._resume(block, None, error)

    def _grad_hook(self, session: grad.Backward, tid: int):
        def hook(gradient: torch.Tensor):
            session.fired.add(tid)
            w = session.waiting
            if w is None or w[0] != tid or session.block.done:
                return None
            session.waiting = None
            session.serving, session.replacement = (tid, gradient), None
            block = session.block
            try:
                value = self._grad_now(session, w[1], gradient, w[2])
                if type(value) is _Throw:
                    self._resume(block, None, value.exc)
                else:
                    self._resume(block, value, None)
            finally:
                session.serving = None
            return session.replacement

        return hook

    # ----------------------------------------------------------------------------------------
    # generation steps

    def _begin_step(self) -> None:
        if self.steps_begun:
            self.step += 1
            if self.slot is not None:
                self.slot.step = self.step
            n = len(self.counts)
            self.counts[:] = [0] * n  # in place: the controllers hold this list
            self.seen_in = [-1] * n
            self._expire(lambda w: w[3] < self.step)
        self.steps_begun += 1
        self.position = ("step", self.step)
        active = self.blocks if self.on_step is None else self.on_step(self.step)
        for block in active:
            block.req_step += 1
        gates, self._gates = self._gates, []
        due = []
        for entry in gates:
            if entry[2] == entry[0].req_step:
                due.append(entry)
            else:
                self._gates.append(entry)
        due.sort(key=lambda e: e[0].order)
        for block, _, target in due:
            if not block.done:
                block.step = self.step
                self._resume(block, target, None)
        self.serve()

    def _expire(self, stale: Callable[[tuple], bool]) -> None:
        """Throw a never-reached error into each block parked on a stale wait."""
        hit: dict[int, tuple[Block, tuple]] = {}
        for lst in self.waits.values():
            for w in lst:
                if stale(w) and id(w[1]) not in hit:
                    hit[id(w[1])] = (w[1], w)
        for block, w in sorted(hit.values(), key=lambda e: e[0].order):
            if block.done:
                continue
            self._unpark(block)
            self._resume(block, None, self._never_reached(w))

    # ----------------------------------------------------------------------------------------
    # the end of a run

    def finish(self) -> None:
        """End the run: close step loops, fail waits never reached at their lines, close the rest."""
        self.finished = True
        self.position = "the end of the run"
        self.finish_blocks(self.blocks)

    def finish_blocks(self, blocks: list[Block]) -> None:
        """End these blocks' generation (their request is over): step loops end and the code after
        them runs, waits that can no longer be served fail at their lines, the rest is closed."""
        if not self._gates and not self.ready and all(b.done for b in blocks):
            for b in blocks:
                b.ended = True
            return  # the common end of a run: every block has returned
        self.serve()
        blocks = sorted(blocks, key=lambda b: b.order)
        mine = {id(b) for b in blocks}
        for b in blocks:
            b.ended = True
        gates, self._gates = self._gates, []
        for entry in gates:
            if id(entry[0]) not in mine:
                self._gates.append(entry)
        for block, _, _ in sorted((e for e in gates if id(e[0]) in mine), key=lambda e: e[0].order):
            if not block.done:
                self._resume(block, END, None)
        self.serve()
        for _ in range(3):  # a block may catch the error and wait again; give up after a few
            if all(b.done for b in blocks):
                break
            for block in blocks:
                if block.done:
                    continue
                err = self._describe_wait(block)
                self._unpark(block)
                self._forget_slot_waits(block)
                self._resume(block, None, err)
            self.serve()
        for block in blocks:
            if not block.done:
                self._close(block)

    def forget(self, block: Block) -> None:
        """Drop a finished block from this interleaver (long-lived interleavers serve many)."""
        if not block.done:
            self._close(block)
        self.blocks = [b for b in self.blocks if b is not block]
        self._gates = [g for g in self._gates if g[0] is not block]
        block.coro = None
        block.state = None

    def close_all(self) -> None:
        """Close every unfinished block without running more of it (used when a run aborts)."""
        for block in self.blocks:
            if not block.done:
                self._close(block)

    def _close(self, block: Block) -> None:
        self._unpark(block)
        self._forget_slot_waits(block)
        err = self._describe_wait(block)
        try:
            block.coro.close()
        except BaseException as close_err:  # a finally that awaits again
            err = close_err
        block.done = True
        block.seen = block.session = None
        if block.error is None:
            block.error = err

    def _forget_slot_waits(self, block: Block) -> None:
        trap = block.waiting
        slots = []
        if getattr(trap, "TRAP", None) == SLOT:
            slots = [trap]
        elif getattr(trap, "TRAP", None) == GATHER:
            slots = [i for i in trap.items if getattr(i, "TRAP", None) == SLOT]
        for s in slots:
            s._waiters = [w for w in s._waiters if w[1] is not block]

    def _complete(self, block: Block, value: Any) -> None:
        block.done = True
        self._unpark(block)
        block.seen = block.session = None
        if block.writes:
            w = block.writes[0]
            name = w.describe() if w.TRAP == GRAD else w.target.describe()
            block.error = WriteError(
                f"{name}.set(...) at {w.line} was never awaited, so nothing was "
                f"written: write `await {name.split(' ')[0]}.set(value)`"
            )
            return
        try:
            block.result = batching.detach(value)
        except Exception as err:
            block.error = err

    def _fail(self, block: Block, err: BaseException) -> None:
        block.done = True
        self._unpark(block)
        block.seen = block.session = None
        block.error = err.with_traceback(_user_traceback(err.__traceback__))

    # ----------------------------------------------------------------------------------------
    # messages

    def _name(self, index: int, kind: int) -> str:
        path = self.names[index]
        return f"{path}.{KIND_NAMES[kind]}" if path else KIND_NAMES[kind]

    def _where(self) -> str:
        pos = self.position
        if isinstance(pos, str):
            return pos
        if isinstance(pos, Read):
            return pos.describe()
        if pos[0] == "step":
            return f"the start of step {pos[1]}"
        index, kind, n = pos
        return self._name(index, kind) + (f" (call {n})" if n else "")

    def _order_error(self, trap: Read, step: int) -> OrderError:
        what = trap.describe()
        if self.finished or (self.current is not None and self.current.ended):
            return OrderError(
                f"{what} cannot be awaited: the run has ended (generation is over), so the model "
                f"will not run again in this trace"
            )
        if step < self.step:
            return OrderError(
                f"{what} of step {step} cannot be awaited: the model is already at {self._where()} "
                f"(step {self.step})"
            )
        return OrderError(
            f"{what} has already passed in this run: the model is at {self._where()}. Await "
            f"locations in the order the model runs them, or use asyncpp.gather(...) to wait on "
            f"several at once"
        )

    def _never_reached(self, w: tuple) -> NeverReachedError:
        trap = w[2] if w[2].TRAP == READ else w[2].target
        return NeverReachedError(
            f"{trap.describe()} was never reached in step {w[1].req_step}: the model ran that step to the "
            f"end without calling it (or not that many times)"
        )

    def _describe_wait(self, block: Block) -> NeverReachedError:
        trap = block.waiting
        kind = getattr(trap, "TRAP", None)
        if kind == READ or kind == WRITE:
            t = trap if kind == READ else trap.target
            msg = f"{t.describe()} was never reached: the run ended while the block waited on it"
            if block.req_step > 0:
                msg += f" (step {block.req_step})"
        elif kind == SLOT:
            msg = f"slot {trap.name!r} was never set: the run ended while the block waited on it"
        elif kind == GATHER:
            names = ", ".join(i.describe() if hasattr(i, "describe") else repr(i) for i in trap.items)
            msg = f"asyncpp.gather({names}) was not complete when the run ended"
        else:
            msg = "the run ended before the block finished"
        return NeverReachedError(msg)


_KERNEL_FILES = (__file__, traps.__file__, grad.__file__, budget.__file__)


def _user_traceback(tb):
    """Drop the interleaver's frames before the block and the trap frames after its ``await``,
    so the traceback starts and ends in the user's code."""
    while tb is not None and tb.tb_frame.f_code.co_filename in _KERNEL_FILES:
        tb = tb.tb_next
    last_user = None
    cur = tb
    while cur is not None:
        if cur.tb_frame.f_code.co_filename in _KERNEL_FILES:
            if last_user is not None and all(
                t.tb_frame.f_code.co_filename in _KERNEL_FILES for t in _walk(cur)
            ):
                last_user.tb_next = None
                break
        else:
            last_user = cur
        cur = cur.tb_next
    return tb


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _foreign(msg: Any) -> ForeignAwaitError:
    if msg is None:
        what = "a bare yield (such as asyncio.sleep() or anyio.sleep())"
    else:
        what = f"{type(msg).__module__}.{type(msg).__qualname__}"
    return ForeignAwaitError(
        f"an intervention block awaited {what}, which asyncpp cannot serve: blocks run inside the "
        f"model's forward pass, not on an event loop, so they can only await asyncpp locations, "
        f"steps, slots and asyncpp.gather(...). Do event-loop work before or after the trace."
    )


__all__ = ["Block", "END", "Interleaver", "InternalError", "MISS", "PARKED"]

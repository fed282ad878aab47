"""The interleaver: drives intervention blocks from inside a model's forward pass.

One :class:`Interleaver` serves one run (one forward, or one generate loop) of one batch. Blocks are
plain coroutines stepped with ``send``/``throw``; what they yield are traps (see :mod:`.traps`).

The life of a block:

* it is **started** by :meth:`Interleaver.start` (before the forward, or when a request first
  appears), runs until its first trap, and parks;
* it is **stepped** by :meth:`Interleaver.visit`, which the engine's per-module controller calls when
  the model reaches a module some block waits on (a set lookup decides that), and by
  :meth:`Interleaver.serve` at serve points outside the forward;
* it is **finished** by :meth:`Interleaver.finish` at the end of the run: step loops end, waits that
  were never reached are thrown into their blocks at the waiting line, survivors are closed.

Around it: the block record (:mod:`.block`), parked waits (:mod:`.waits`), serving a visit's values
(:mod:`.visits`), gradient runs (:mod:`.grad`), the error messages (:mod:`.messages`), and what an
engine adds (:class:`.hooks.RunHooks`, handed over at creation).
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from . import batching, grad, messages, visits
from .answers import MISS, NOTHING, PARKED, RUN_BACKWARD, Throw
from .block import Block, GatherState, Wait
from .errors import ForeignAwaitError, InternalError, WriteError
from .hooks import NO_HOOKS, RunHooks
from .traps import BACKWARD, GATHER, GRAD, INPUT, INPUTS, OUTPUT, PULL, READ, SKIP, SLOT, STEP, WRITE, Read
from .visits import NativeVisit, Visit, apply_write, read_value, stage_of
from .waits import WaitTable

_active = threading.local()  # the interleaver running blocks on this thread


def active_interleaver() -> Interleaver | None:
    """The interleaver whose run is executing on this thread, if any."""
    return getattr(_active, "kernel", None)


class Interleaver:
    """The scheduler of one run. See the module docstring for the life of a block."""

    __slots__ = (
        "names",
        "batch_size",
        "req_batch",
        "counts",
        "seen_in",
        "table",
        "ready",
        "blocks",
        "current",
        "serving",
        "step",
        "steps_begun",
        "step_index",
        "gates",
        "position",
        "hooks",
        "switch",
        "link",
        "grad",
        "budget",
        "finished",
        "_enter",
        "_leave",
        "_template",
        "_plain",
        "_special",
        "_visit",
        "__weakref__",
    )

    def __init__(
        self,
        names: list[str],
        batch_size: int,
        *,
        step_index: int | None = None,
        hooks: RunHooks = NO_HOOKS,
        switch: Any = None,
        link: Any = None,
        tls_template: Any = None,
        grad: bool = False,
    ):
        n = len(names)
        self.names = names  # module path per module index
        self.batch_size = batch_size  # rows of the batch (tokens, on vLLM)
        self.req_batch = batch_size  # rows of request-level values (logits, samples)
        self.counts = [0] * n  # completed visits per module in the current step
        self.seen_in = [-1] * n  # visit number whose input stage was served, per hot module
        self.table = WaitTable(n)
        self.ready: deque = deque()  # (block, value) woken outside a visit's own loop
        self.blocks: list[Block] = []
        self.current: Block | None = None  # the block being resumed
        self.serving: Visit | None = None
        self.step = 0  # current generation step
        self.steps_begun = 0
        self.step_index = step_index  # module whose visits begin steps (the root), or None
        self.gates: list[tuple[Block, Any, int]] = []  # step loops waiting: (block, gate, target step)
        self.position: Any = "the start of the run"  # where the model is: a str or (index, kind, n)
        self.hooks = hooks
        self.switch = switch  # the thread-local-state swap: BlockState(), enter(s), leave(s)
        self._enter = switch.enter if switch is not None else None
        self._leave = switch.leave if switch is not None else None
        # the state new blocks start from is copied from this one when the thread still has it
        # (engines keep one across runs: the thread's state at a run's start rarely changes)
        self._template = tls_template
        self.link = link  # the controllers' RunLink: .bypass is set while a block's code runs
        # gradient runs (local engine): invokes' rows are cut inside the autograd graph, served
        # values are kept per block for loc.grad, and blocks may run backward passes
        self.grad = grad
        # a StepBudget: each block's code may run so long per step (else BlockTimeoutError); the
        # outermost resumes are timed through _budget_enter/_budget_leave (natively resumed ones too)
        self.budget: Any = None
        self.finished = False
        self._plain = hooks.publish is None and not grad  # a single plain read may skip the visit
        self._special = hooks.special_modules()  # ... unless the hooks transform the module's values
        self._visit = Visit(-1, -1, OUTPUT)  # reused by the single-read path
        if step_index is not None:
            self.table.ref(step_index, INPUT)  # the root's calls begin steps, so it is always watched

    # ----------------------------------------------------------------------------------------
    # what engines and controllers use

    @property
    def fast_path(self) -> bool:
        """Whether the native controllers may serve plain reads themselves (derived from the hooks
        and the run's kind, never from the order things were set up in)."""
        return self.hooks.fast_path and not self.grad

    def link_fields(self) -> dict[str, Any]:
        """The fields of this run the per-module controllers read, by name: what
        ``RunLink.attach(fields)`` takes (the contract is documented in native/controllers.py)."""
        t = self.table
        return {
            "kernel": self,
            "hot_in": t.hot_in,
            "hot_out": t.hot_out,
            "counts": self.counts,
            "waits": t.waits,
            "refs_out": t.refs_out,
            "ready": self.ready,
            "visit": self.visit,
            "visit_output": self.visit_output,
            "resume": self._resume,
            "complete": self._complete,
            "fail": self._fail,
            "serve": self.serve,
            "budget_enter": self._budget_enter,
            "budget_leave": self._budget_leave,
            "special": self._special,
            "fast": self.fast_path,
            "step": self.step,
            "guarded": self.hooks.refuse_at,
        }

    def set_batch(self, batch_size: int, req_batch: int) -> None:
        """The rows of the forward that begins (an engine that batches requests, from on_step)."""
        self.batch_size, self.req_batch = batch_size, req_batch

    def stats(self) -> dict[str, int]:
        """What the run holds now (leak checks)."""
        return {
            "blocks": len(self.blocks),
            "waits": self.table.count(),
            "gates": len(self.gates),
            "hot_in": len(self.table.hot_in),
            "hot_out": len(self.table.hot_out),
        }

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
        req_rows: Any = NOTHING,
        tokens: int | None = None,
    ) -> Block:
        """Register a block coroutine and run it until its first wait. ``rows`` are its rows of
        the batch (None: all); ``req_rows`` its rows of request-level values (default: ``rows``);
        ``tokens`` the length of its prompt where rows are left-padded to the batch's width."""
        block = Block(coro, order, rows, name)
        if req_rows is not NOTHING:
            block.req_rows = req_rows
        block.tokens = tokens
        block.step = self.step
        self.blocks.append(block)
        if self.switch is not None:
            if self._template is None:
                self._template = self.switch.BlockState()
            block.state = self._template.fork()  # the thread's state as its first entry (now) finds it
        self._resume(block, None, None)
        return block

    def _resume(
        self, block: Block, value: Any, exc: BaseException | None, msg: Any = NOTHING, entered: bool = False
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
        link = None if entered else self.link
        if link is not None:
            outer_bypass = link.bypass
            link.bypass = True
        coro = block.coro
        handlers = _HANDLERS
        run_backward = False
        try:
            while True:
                if msg is NOTHING:
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
                handler = handlers.get(getattr(msg, "TRAP", None))
                value = Throw(messages.foreign(msg)) if handler is None else handler(self, block, msg)
                if value is PARKED:
                    block.waiting = msg
                    return
                if value is RUN_BACKWARD:
                    block.waiting = msg
                    run_backward = True
                    return
                msg = NOTHING
                if type(value) is Throw:
                    exc, value = value.exc, None
        finally:
            if timed:
                self._budget_leave(block)
            if link is not None:
                link.bypass = outer_bypass
            if state is not None:
                self._leave(state)
            self.current = prev
            if run_backward:  # with the forward's state back, outside the block's frame
                grad.run_backward(self, block)

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

    def wake(self, block: Block, value: Any, gather: GatherState | None = None, item: int = 0) -> None:
        """Make a parked block runnable (a slot was set, a pull answered). It runs in the current
        visit's loop, or at the next serve point."""
        if block.done:
            return
        if gather is not None:
            gather.values[item] = value
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
                self.table.unpark(block, block.waiting)
                if type(value) is Throw:
                    self._resume(block, None, value.exc)
                else:
                    self._resume(block, value, None)

    # ----------------------------------------------------------------------------------------
    # trap handlers (dispatched through _HANDLERS): each returns a value, a Throw, or PARKED

    def _visit_of(self, target: Read, step: int) -> Visit | None:
        """The visit being served, if ``target`` (at ``step``) is one of its locations."""
        v = self.serving
        if v is None and self.link is not None and self.link.in_visit:
            v = NativeVisit(self.link)
        if (
            v is not None
            and v.index == target.index
            and v.n == target.occ
            and step == self.step
            and v.stage == stage_of(target.kind)
        ):
            return v
        return None

    def _wait_for(
        self,
        block: Block,
        trap: Any,
        target: Read,
        step: int,
        gather: GatherState | None = None,
        item: int = 0,
    ):
        """Park ``trap`` (a read, or a write) on ``target``'s location, unless the engine can never
        serve it (``refuse``), serves it elsewhere (``intercept``) or the model has passed it."""
        hooks, occ = self.hooks, target.occ
        if hooks.refuse is not None:
            err = hooks.refuse(target.index, target.kind)
            if err is not None:
                return Throw(err)
        if hooks.intercept is not None:
            got = hooks.intercept(block, trap, step, occ)
            if got is not MISS:
                return got
        if self._passed(target.index, target.kind, step, occ):
            return Throw(messages.order_error(self, target, step))
        self.table.park(block, trap, target.key, target.index, step, occ, gather, item)
        return PARKED

    def _on_read(self, block: Block, trap: Read, gather: GatherState | None = None, item: int = 0):
        step = block.step
        v = self._visit_of(trap, step)
        if v is not None:
            return read_value(self, block, v, trap)  # a location of the visit being served
        return self._wait_for(block, trap, trap, step, gather, item)

    def _on_write(self, block: Block, write):
        try:
            block.writes.remove(write)
        except ValueError:
            pass
        target = write.target
        step = block.step
        v = self._visit_of(target, step)
        if v is not None:
            try:
                apply_write(self, block, v, write)
            except Exception as err:
                return Throw(err)
            return None
        return self._wait_for(block, write, target, step)

    def _on_slot(self, block: Block, slot):
        if slot.is_set:
            return slot.value
        slot.add_waiter(self, block)
        return PARKED

    def _on_step(self, block: Block, gate):
        if block.ended:
            return Throw(StopAsyncIteration())
        current = block.req_step  # the block's request's step under way (-1: none yet)
        target = gate.steps.first_at_or_after(max(gate.after, current, 0))
        if target is None:
            return Throw(StopAsyncIteration())
        if target == current:
            block.step = self.step  # that step is under way: enter it at once
            gate.after = target + 1
            return target
        self.gates.append((block, gate, target))
        return PARKED

    def _on_gather(self, block: Block, gather):
        items = gather.items
        state = GatherState(block, len(items))
        for i, item in enumerate(items):
            trap = getattr(item, "TRAP", None)
            if trap == READ:
                got = self._on_read(block, item, state, i)
                if got is PARKED:
                    continue
                if type(got) is Throw:
                    self.table.unpark(block, gather)
                    return got
                state.values[i] = got
            elif trap == SLOT:
                if item.is_set:
                    state.values[i] = item.value
                else:
                    item.add_waiter(self, block, state, i)
                    continue
            else:
                self.table.unpark(block, gather)
                for other in items:
                    if getattr(other, "TRAP", None) is None and hasattr(other, "close"):
                        other.close()  # a rejected coroutine: no never-awaited warning
                return Throw(
                    ForeignAwaitError(f"asyncpp.gather() takes locations and slots; item {i} is {item!r}")
                )
            state.remaining -= 1
        if state.remaining == 0:
            return state.values
        return PARKED

    def _on_pull(self, block: Block, pull):
        on_pull = self.hooks.on_pull
        return Throw(messages.foreign(pull)) if on_pull is None else on_pull(block, pull)

    def _passed(self, index: int, kind: int, step: int, occ: int) -> bool:
        if step != self.step:
            return step < self.step
        count = self.counts[index]
        if occ < count:
            return True
        return occ == count and kind != OUTPUT and self.seen_in[index] == occ

    # ----------------------------------------------------------------------------------------
    # serving a module visit (called by the engine's controller when the module is hot)

    def visit(self, index: int, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """Run one call of module ``index``, serving its input and output waits."""
        if index == self.step_index:
            self._begin_step()
        n = self.counts[index]
        self.seen_in[index] = n
        base = index * 4
        waits = self.table.waits
        if base in waits or base + 1 in waits or base + 3 in waits:
            adapt_in = self.hooks.adapt_in
            adapter = adapt_in.get(index) if adapt_in else None
            if adapter is not None:
                held = (args, kwargs)
                args, kwargs = adapter.to_blocks(held)
            v = Visit(index, n, INPUT, args, kwargs)
            self._serve_visit(v, (INPUT, INPUTS, SKIP))
            args, kwargs, skip = v.args, v.kwargs, v.skip
            if adapter is not None:
                args, kwargs = adapter.to_model((args, kwargs), held)
            if skip is not NOTHING:
                return self.visit_output(index, skip)
        return self.visit_output(index, forward(*args, **kwargs))

    def visit_input(self, index: int, value: Any) -> Any:
        """Serve the ``input`` waits of the call of module ``index`` about to run, whose first
        argument is ``value`` (a compiled engine's input tap, where the call itself runs in the
        graph); returns the value the call goes on with."""
        args, kwargs = self._visit_args(index, (value,), {}, (INPUT,))
        return args[0]

    def visit_inputs(self, index: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Serve the ``input`` and ``inputs`` waits of the call of module ``index`` about to run
        with ``args`` and ``kwargs`` (a compiled engine's inputs tap); returns the arguments the
        call goes on with (same structure: every block on it writes its own rows)."""
        return self._visit_args(index, args, kwargs, (INPUT, INPUTS))

    def _visit_args(self, index: int, args: tuple, kwargs: dict, kinds: tuple) -> tuple[tuple, dict]:
        n = self.counts[index]
        self.seen_in[index] = n
        waits = self.table.waits
        if all(index * 4 + kind not in waits for kind in kinds):
            return args, kwargs
        adapt_in = self.hooks.adapt_in
        adapter = adapt_in.get(index) if adapt_in else None
        if adapter is not None:
            held = (args, kwargs)
            args, kwargs = adapter.to_blocks(held)
        v = Visit(index, n, INPUT, args, kwargs)
        self._serve_visit(v, kinds)
        if adapter is not None:
            return adapter.to_model((v.args, v.kwargs), held)
        return v.args, v.kwargs

    def visit_output(self, index: int, out: Any) -> Any:
        """Finish a call of module ``index``: count it, serve its output waits."""
        counts = self.counts
        n = counts[index]
        counts[index] = n + 1
        key = index * 4 + 2
        table = self.table
        lst = table.waits.get(key)
        self.position = (index, OUTPUT, n)
        if lst is None:
            return out
        if len(lst) == 1 and self.serving is None and self._plain and index not in self._special:
            # the common case: one plain read of this very call, by a block that sees the batch
            w = lst[0]
            if w.occ == n and w.step == self.step and w.gather is None and w.block.rows is None:
                trap = w.trap
                if trap.TRAP == READ and not trap.keys:
                    del table.waits[key]
                    refs = table.refs_out  # (table.unref, inline: the hot path of a plain read)
                    r = refs[index] - 1
                    refs[index] = r
                    if not r:
                        table.hot_out.discard(index)
                    v = self._visit
                    v.index, v.n, v.stage, v.out = index, n, OUTPUT, out
                    self.serving = v
                    try:
                        self._resume(w.block, out, None)
                        if self.ready:
                            self.serve()
                    finally:
                        self.serving = None
                    out, v.out = v.out, None
                    return out
        hooks = self.hooks
        adapter = hooks.adapt_out.get(index) if hooks.adapt_out else None
        v = Visit(index, n, OUTPUT, out=out if adapter is None else adapter.to_blocks(out))
        prev, self.serving = self.serving, v
        try:
            due = self._serve_waits(v, OUTPUT, key, lst)
            if self.ready:
                self.serve()
        finally:
            self.serving = prev
        if v.parts is not None:
            visits.rebuild(v)
        if hooks.publish is not None and due:
            hooks.publish(index, OUTPUT, n, v.out, due)
        out = v.out if adapter is None else adapter.to_model(v.out, out)
        return batching.copy(out) if index in hooks.copy_after else out

    def _serve_visit(self, v: Visit, kinds: tuple) -> None:
        prev, self.serving = self.serving, v
        base = v.index * 4
        served = []
        try:
            for kind in kinds:
                lst = self.table.waits.get(base + kind)
                if lst:
                    self.position = (v.index, kind, v.n)
                    served.append((kind, self._serve_waits(v, kind, base + kind, lst)))
            if self.ready:
                self.serve()
        finally:
            self.serving = prev
        if v.parts is not None:
            visits.rebuild(v)
        publish = self.hooks.publish
        if publish is not None:
            for kind, due in served:
                if due:
                    publish(v.index, kind, v.n, v.get(kind), due)

    def _serve_waits(self, v: Visit, kind: int, key: int, lst: list[Wait]) -> list[Wait]:
        """Serve the waits of ``lst`` due at this visit; returns them (the publish hook's)."""
        due = self.table.take_due(key, lst, self.step, v.n)
        for w in due:
            block, trap = w.block, w.trap
            if block.done:
                continue
            if w.gather is not None:
                try:
                    value = read_value(self, block, v, trap)
                except Exception as err:
                    self.table.unpark(block, block.waiting)
                    self._resume(block, None, err)
                    continue
                self.wake(block, value, w.gather, w.item)
                continue
            if trap.TRAP == WRITE:
                try:
                    apply_write(self, block, v, trap)
                except Exception as err:
                    self._resume(block, None, err)
                    continue
                self._resume(block, None, None)
            else:
                try:
                    value = read_value(self, block, v, trap)
                except Exception as err:
                    self._resume(block, None, err)
                    continue
                self._resume(block, value, None)
        return due

    # ----------------------------------------------------------------------------------------
    # generation steps

    def _begin_step(self) -> None:
        if self.steps_begun:
            self.step += 1
            if self.link is not None:
                self.link.step = self.step
            n = len(self.counts)
            self.counts[:] = [0] * n  # in place: the controllers hold this list
            self.seen_in = [-1] * n
            if self.table.waits:
                self._expire(lambda w: w.step < self.step)
        self.steps_begun += 1
        self.position = ("step", self.step)
        on_step = self.hooks.on_step
        active = self.blocks if on_step is None else on_step(self.step)
        for block in active:
            block.req_step += 1
        gates, self.gates = self.gates, []
        due = []
        for entry in gates:
            if entry[2] == entry[0].req_step:
                due.append(entry)
            else:
                self.gates.append(entry)
        due.sort(key=lambda e: e[0].order)
        link = self.link
        native = link is not None and link.fast and self.current is None  # (as the fast path would)
        for block, gate, target in due:
            if not block.done:
                block.step = self.step
                gate.after = target + 1
                if native:
                    link.resume(block, target)
                else:
                    self._resume(block, target, None)
        self.serve()

    def _expire(self, is_stale: Callable[[Wait], bool]) -> None:
        """Throw a never-reached error into each block parked on a stale wait."""
        for block, w in self.table.stale(is_stale):
            if block.done:
                continue
            self.table.unpark(block, block.waiting)
            self._resume(block, None, messages.never_reached(w))

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
        if not self.gates and not self.ready and all(b.done for b in blocks):
            for b in blocks:
                b.ended = True
            return  # the common end of a run: every block has returned
        self.serve()
        blocks = sorted(blocks, key=lambda b: b.order)
        mine = {id(b) for b in blocks}
        for b in blocks:
            b.ended = True
        gates, self.gates = self.gates, []
        for entry in gates:
            if id(entry[0]) not in mine:
                self.gates.append(entry)
        for block, _, _ in sorted((e for e in gates if id(e[0]) in mine), key=lambda e: e[0].order):
            if not block.done:
                self._resume(block, None, StopAsyncIteration())  # the step loop ends
        self.serve()
        for _ in range(3):  # a block may catch the error and wait again; give up after a few
            if all(b.done for b in blocks):
                break
            for block in blocks:
                if block.done:
                    continue
                err = messages.unfinished_wait(block)
                self._unwait(block)
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
        self.gates = [g for g in self.gates if g[0] is not block]
        block.coro = None
        block.state = None

    def close_all(self) -> None:
        """Close every unfinished block without running more of it (used when a run aborts)."""
        for block in self.blocks:
            if not block.done:
                self._close(block)

    def _unwait(self, block: Block) -> None:
        """Take ``block`` off whatever it waits on: module locations and slots."""
        trap = block.waiting
        self.table.unpark(block, trap)
        kind = getattr(trap, "TRAP", None)
        if kind == SLOT:
            trap.forget(block)
        elif kind == GATHER:
            for item in trap.items:
                if getattr(item, "TRAP", None) == SLOT:
                    item.forget(block)

    def _close(self, block: Block) -> None:
        self._unwait(block)
        err = messages.unfinished_wait(block)
        try:
            block.coro.close()
        except BaseException as close_err:  # a finally that awaits again
            err = close_err
        block.done = True
        block.seen = block.session = None
        if block.error is None:
            block.error = err

    def _complete(self, block: Block, value: Any) -> None:
        block.done = True
        self.table.unpark(block, block.waiting)
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
        self.table.unpark(block, block.waiting)
        block.seen = block.session = None
        block.error = err.with_traceback(messages.user_traceback(err.__traceback__, _PACKAGE))


# the trap handlers, by trap kind: handler(interleaver, block, trap) -> value | Throw | PARKED
_HANDLERS: dict[int, Callable[[Interleaver, Block, Any], Any]] = {
    READ: Interleaver._on_read,
    SLOT: Interleaver._on_slot,
    WRITE: Interleaver._on_write,
    STEP: Interleaver._on_step,
    GATHER: Interleaver._on_gather,
    PULL: Interleaver._on_pull,
    GRAD: grad.on_grad,
    BACKWARD: grad.on_backward,
}

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # asyncpp's own files

__all__ = ["Block", "Interleaver", "InternalError", "MISS", "PARKED", "RunHooks", "Throw"]

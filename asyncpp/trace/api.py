"""The trace API: ``async with asyncpp.trace(engine) as t: t.invoke(prompt, block)``.

A trace collects invokes; leaving the ``with`` block runs them as one batched run on the engine and
fills each invoke's handle. ``async with`` awaits the run off the caller's event loop; plain ``with``
runs it on the calling thread. An exception from a block is raised at the ``with`` exit, with the
block's own traceback; every handle still carries its own outcome.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

from torch import nn

from ..engines.base import Deferred, Engine, InvokeSpec, RunOutcome, RunSpec, no_block
from ..kernel.errors import AsyncppError
from ..kernel.interleaver import active_interleaver
from ..locations.validate import check_block_paths
from .stream import EMIT, TOKENS, Live, StreamEvent

_PENDING = object()
_CO_COROUTINE = inspect.CO_COROUTINE


def _is_async(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    if code is not None and type(fn).__name__ == "function":
        return bool(code.co_flags & _CO_COROUTINE)
    return inspect.iscoroutinefunction(fn)


class Invoke:
    """The handle of one invoke: its block's result, once the trace has run."""

    __slots__ = ("index", "name", "_result", "_error", "_output", "tokens", "emitted", "_trace")

    def __init__(self, index: int, name: str, trace: Trace | None = None):
        self.index = index
        self.name = name
        self._trace = trace
        self.emitted: list = []  # what the block streamed with asyncpp.emit(), once the trace has run
        self._result: Any = _PENDING
        self._error: BaseException | None = None
        self._output: Any = None
        self.tokens: Any = None  # the tokens generated for this invoke's rows (generate runs)

    @property
    def output(self) -> Any:
        """This invoke's rows of the model's output (forward runs), or None."""
        out = self._output
        if isinstance(out, Deferred):
            out = self._output = out.resolve()
        return out

    @property
    def result(self) -> Any:
        """The block's return value (tensors detached and copied out of the model's buffers)."""
        if self._error is not None:
            raise self._error
        if self._result is _PENDING:
            raise AsyncppError(f"invoke #{self.index} ({self.name}) has no result yet: the trace has not run")
        return self._result

    @property
    def exception(self) -> BaseException | None:
        """The error the block raised, or None."""
        return self._error

    @property
    def done(self) -> bool:
        return self._error is not None or self._result is not _PENDING

    def stream(self) -> AsyncIterator[Any]:
        """The values this invoke's block emits (``asyncpp.emit``), as they are made: ``async for v
        in h.stream():`` inside ``async with`` starts the run; after the run, the values it made."""
        return self._trace._stream(self.index)

    def events(self) -> AsyncIterator[StreamEvent]:
        """This invoke's stream with its tokens: a :class:`StreamEvent` for every value its block
        emits (kind ``"emit"``) and, on engines that stream tokens (vLLM, a remote engine), for
        the token ids its request samples at each step (kind ``"tokens"``), in the order they
        happen; on other engines (a LocalEngine) each sequence's tokens come as one event at the
        end. Like :meth:`stream`: inside ``async with`` it starts the run; after it, it gives
        the emitted values, then each generated sequence's tokens as one event."""
        return self._trace._events(self.index)

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else ("done" if self.done else "pending")
        return f"<Invoke #{self.index} {self.name} {state}>"


class Trace:
    """One batched run of intervention blocks on an engine. Create with :func:`trace` or
    :func:`generate`."""

    def __init__(self, engine: Engine, spec: RunSpec):
        self.engine = engine
        self._target: Any = engine
        self._spec = spec
        self._handles: list[Invoke] = []
        self._ran = False
        self._live: Live | None = None  # the run a stream started (async entry only)
        self._abandon: Callable[[], Any] | None = None  # gives that run up, if its engine can
        self.output: Any = None  # the model's whole output, after the run

    def invoke(
        self, input: Any = None, block: Callable | None = None, /, *args: Any, **kwargs: Any
    ) -> Invoke:
        """Add an invoke: ``block(m, *args, **kwargs)`` runs on ``input``'s rows of the batch.

        ``t.invoke(block, *args)`` (no input) gives a block that sees the whole batch;
        ``t.invoke(input)`` (no block) runs the input with no intervention (its handle has its
        output and tokens; its result is None).
        """
        if self._ran:
            raise AsyncppError("this trace has already run; start a new one")
        if isinstance(block, str) and getattr(self.engine, "named_blocks", False):
            # a block the server's operator registered, named: its arguments are data
            handle = Invoke(len(self._handles), block, self)
            self._handles.append(handle)
            self._spec.invokes.append(InvokeSpec(input, block, args, kwargs, block))
            return handle
        if _is_async(input):  # t.invoke(block, *args): no input, the block sees the whole batch
            if block is not None:
                args = (block, *args)
            input, block = None, input
        elif block is None and input is not None and not args and not kwargs:
            block = no_block  # t.invoke(prompt): the prompt runs (and generates) with no block
        if isinstance(block, str):
            raise TypeError(
                f"invoke() got the block name {block!r}: blocks are named only on an asyncpp server "
                f"(asyncpp.RemoteEngine); here, pass the `async def` block itself"
            )
        if block is None or not _is_async(block):
            what = getattr(block, "__name__", repr(block))
            raise TypeError(
                f"invoke() needs an `async def` block taking the model as its first argument; got {what}"
            )
        if self.engine.tree is not None:  # (a remote engine's blocks resolve on its server)
            check_block_paths(block, self.engine.tree, self.engine.wait_refusal())
        name = getattr(block, "__qualname__", None)
        if name is None:  # a functools.partial (of a function or a bound method): name what it wraps
            name = f"partial({getattr(getattr(block, 'func', None), '__qualname__', 'block')})"
        handle = Invoke(len(self._handles), name, self)
        self._handles.append(handle)
        self._spec.invokes.append(InvokeSpec(input, block, args, kwargs, name))
        return handle

    @property
    def invokes(self) -> list[Invoke]:
        return list(self._handles)

    def stream(self) -> AsyncIterator[tuple[Invoke, Any]]:
        """``(handle, value)`` for every value any block emits, as they are made (see
        :meth:`Invoke.stream`)."""
        return self._stream(None)

    def events(self) -> AsyncIterator[StreamEvent]:
        """Every invoke's :meth:`Invoke.events`, interleaved in the order they happen."""
        return self._events(None)

    async def _stream(self, index: int | None) -> AsyncIterator[Any]:
        live = self._live
        if live is None:
            if self._ran:  # the run is over (or runs elsewhere): what it streamed, in order
                for h in self._handles if index is None else [self._handles[index]]:
                    for v in h.emitted:
                        yield v if index is not None else (h, v)
                return
            live = self._start_live()
        async for i, _, v in live.iterate(index):
            yield v if index is not None else (self._handles[i], v)

    async def _events(self, index: int | None) -> AsyncIterator[StreamEvent]:
        live = self._live
        if live is None:
            if self._ran:  # after the run: its emitted values, then its tokens in one event
                for h in self._handles if index is None else [self._handles[index]]:
                    for v in h.emitted:
                        yield StreamEvent(h, EMIT, v)
                    for row in [] if h.tokens is None else h.tokens.reshape(-1, h.tokens.shape[-1]):
                        yield StreamEvent(h, TOKENS, [int(x) for x in row.tolist()])  # per sequence
                return
            live = self._start_live()
        async for i, kind, v in live.iterate(index, tokens=True):
            yield StreamEvent(self._handles[i], kind, v)
        if not self.engine.streams_tokens and live.outcome is not None:  # its tokens, at the end
            for i in range(len(self._handles)) if index is None else [index]:
                tokens = live.outcome.invokes[i].tokens
                for row in [] if tokens is None else tokens.reshape(-1, tokens.shape[-1]):
                    yield StreamEvent(self._handles[i], TOKENS, [int(x) for x in row.tolist()])

    def start(self) -> None:
        """Start the run now, inside ``async with``, without waiting for it: its streams
        (:meth:`stream`, :meth:`events`) follow it as they are iterated, and the ``async with``
        exit waits for its outcome. (Iterating a stream first starts the run the same way.)"""
        if self._live is not None:
            return
        if self._ran:
            raise AsyncppError("this trace has already run; start a new one")
        self._start_live()

    def _start_live(self) -> Live:
        if not self.engine.supports_streaming:
            raise AsyncppError(
                f"a {type(self.engine).__name__} does not stream values from blocks yet: use a "
                f"LocalEngine, or return the values from the block"
            )
        if not self._spec.invokes:
            raise AsyncppError("the trace has no invokes to stream from: call t.invoke(...) first")
        live = Live()
        live.bind_loop()
        self._spec.sink = live.sink
        if self.engine.streams_tokens:
            self._spec.token_sink = live.token_sink
        self._ran = True
        self._live = live

        def settle(ok: bool, value: Any) -> None:
            live.finish(value if ok else None, None if ok else value)

        abandon = self.engine.submit(self._spec, live.post, settle)
        self._abandon = abandon if callable(abandon) else None
        return live

    # --- sync entry --------------------------------------------------------------------------

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or self._ran:
            return
        self._ran = True
        if not self._spec.invokes:
            return
        self._settle(self.engine.run(self._spec))

    # --- async entry -------------------------------------------------------------------------

    async def __aenter__(self) -> Trace:
        kernel = active_interleaver()
        if kernel is not None and kernel.current is not None:
            raise AsyncppError(
                "`async with asyncpp.trace(...)` cannot be used inside an intervention block: blocks "
                "run inside the model's forward pass, on the model's thread, where no event loop runs. "
                "Start the second trace after this one (from your own code), add its invokes to this "
                "trace, or, for another model, use a plain `with asyncpp.trace(other_model)` in the block"
            )
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        live = self._live
        if live is not None and not live.settled:
            if exc_type is not None:  # its outcome is dropped; the run goes on, unless the engine
                if self._abandon is not None:  # can give it up (vLLM aborts its requests)
                    self._abandon()
                return
            live.settled = True
            try:
                outcome = await live.wait()
            except BaseException:  # cancelled while waiting (or the run failed: then a no-op)
                if self._abandon is not None:
                    self._abandon()
                raise
            self._settle(outcome)
            return
        if exc_type is not None or self._ran:
            return
        self._ran = True
        if not self._spec.invokes:
            return
        self._settle(await self.engine.run_async(self._spec))

    def _settle(self, outcome: RunOutcome) -> None:
        self.output = outcome.output
        first = None
        for handle, o in zip(self._handles, outcome.invokes):
            handle._result, handle._error = o.result, o.error
            handle._output, handle.tokens = o.output, o.tokens
            handle.emitted = o.emitted
            if o.error is not None and first is None:
                first = (handle, o.error)
        if outcome.error is not None:
            raise outcome.error
        if first is not None:
            handle, err = first
            if not getattr(err, "_asyncpp_noted", False):
                err.add_note(f"(raised in invoke #{handle.index}, block {handle.name})")
                err._asyncpp_noted = True  # type: ignore[attr-defined]
            raise err


def _engine_for(target: Engine | nn.Module) -> Engine:
    if isinstance(target, nn.Module):  # (checked first: Engine is an ABC, a slower isinstance)
        from ..engines.local.engine import LocalEngine

        return LocalEngine.for_model(target)
    if isinstance(target, Engine):
        return target
    raise TypeError(f"trace() needs an asyncpp engine or a torch.nn.Module, got {type(target).__name__}")


def _check_grad(engine: Engine, grad: bool) -> None:
    if grad and not engine.supports_grad:
        raise AsyncppError(
            f"gradients are not available on a {type(engine).__name__}: it runs the model under "
            f"torch.inference_mode(), which records no autograd graph. Take gradients on a "
            f"LocalEngine (asyncpp.trace(local_engine, grad=True))"
        )


def trace(target: Engine | nn.Module, *, grad: bool = False, **model_kwargs: Any) -> Trace:
    """A trace of one forward pass on ``target`` (an engine or a ``torch.nn.Module``).

    :param grad: run the forward with autograd enabled (default: ``torch.no_grad()``); blocks may
        then take gradients of what they awaited and drive backward passes (``asyncpp.backward``).
    :param model_kwargs: extra keyword arguments for the model call.
    """
    engine = _engine_for(target)
    _check_grad(engine, grad)
    spec = RunSpec([], grad=grad, model_kwargs=model_kwargs)
    engine.check_options(spec)
    t = Trace(engine, spec)
    t._target = target  # a module's shared engine holds it weakly: the trace keeps it alive
    return t


def generate(
    target: Engine | nn.Module, *, max_new_tokens: int, grad: bool = False, **generate_kwargs: Any
) -> Trace:
    """A trace of a generation loop (greedy unless ``generate_kwargs`` say otherwise).

    Blocks iterate its steps with ``async for step in m.steps(): ...``; step 0 is the prompt.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    spec = RunSpec([], generate=True, max_new_tokens=max_new_tokens, grad=grad, model_kwargs=generate_kwargs)
    engine = _engine_for(target)
    _check_grad(engine, grad)
    engine.check_options(spec)
    t = Trace(engine, spec)
    t._target = target
    return t

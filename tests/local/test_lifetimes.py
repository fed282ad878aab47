"""Engines, models and model threads are released when the last reference goes, without close().

Every test drops its references, collects, joins the model threads it saw start (with a timeout:
a thread ends shortly after its engine is freed) and checks weak references to the model, one of
its submodules (the engine's controllers hold those) and the engine.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import anyio
import pytest
import torch
from torch import nn

import asyncpp
from asyncpp.engines.local.engine import LocalEngine

PREFIX = "asyncpp-model-"
BACKENDS = [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})]
JOIN_S = 10.0


def _model_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(PREFIX)}


def _small() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


async def read_first(m):
    return await m[0].output


async def raise_after_first(m):
    await m[0].output
    raise ValueError("the block's own error")


async def llama_last(m):
    return (await m.logits)[:, -1]


async def llama_raise(m):
    await m.model.layers[0].output
    raise ValueError("the block's own error")


def _refs(model: nn.Module, engine: LocalEngine) -> list[weakref.ref]:
    first = next(model.children())
    return [weakref.ref(model), weakref.ref(first), weakref.ref(engine)]


def _assert_released(refs: list[weakref.ref], threads: set[threading.Thread]) -> None:
    """Collect, give the model threads a moment to end, and check that nothing is left."""
    gc.collect()
    for t in threads:
        t.join(JOIN_S)
    gc.collect()
    assert [t.name for t in threads if t.is_alive()] == []
    assert [r() for r in refs] == [None] * len(refs)


async def _trace(target, block, input):
    async with asyncpp.trace(target) as t:
        h = t.invoke(input, block)
    return h


def _run_once(make_target, block, input, *, raises: bool) -> tuple[list[weakref.ref], set[threading.Thread]]:
    """One async trace on a fresh model; returns weak references and the model threads it started."""
    before = _model_threads()
    model, target = make_target()
    engine = target if isinstance(target, LocalEngine) else LocalEngine.for_model(model)
    refs = _refs(model, engine)

    async def main(target):
        if raises:
            with pytest.raises(ValueError, match="the block's own error"):
                await _trace(target, block, input)
        else:
            h = await _trace(target, block, input)
            assert isinstance(h.result, torch.Tensor)

    asyncio.run(main(target))
    started = _model_threads() - before
    assert len(started) == 1  # the async trace ran on a model thread of its own
    del model, target, engine
    return refs, started


def _user_engine():
    model = _small()
    return model, asyncpp.LocalEngine(model)


def _bare_module():
    model = _small()
    return model, model


@pytest.mark.parametrize("raises", [False, True], ids=["ok", "block-raised"])
@pytest.mark.parametrize("make", [_user_engine, _bare_module], ids=["LocalEngine", "bare-module"])
def test_an_async_trace_leaves_nothing_alive(make, raises):
    block = raise_after_first if raises else read_first
    refs, started = _run_once(make, block, torch.randn(2, 8), raises=raises)
    _assert_released(refs, started)


def test_tiny_llama_engine_and_its_thread_are_released(tiny):
    from asyncpp.models import load_tiny

    _, tok = tiny
    for block, raises in [(llama_last, False), (llama_raise, True)]:

        def make():
            model, _ = load_tiny()
            return model, asyncpp.LocalEngine(model, tok)

        refs, started = _run_once(make, block, "Hello", raises=raises)
        _assert_released(refs, started)


def test_released_while_the_caller_goes_on():
    """No await needed after the trace: the outcome is not left in the event loop's hands."""
    before = _model_threads()

    async def main():
        model = _small()
        engine = asyncpp.LocalEngine(model)
        refs = _refs(model, engine)
        try:
            async with asyncpp.trace(engine) as t:
                t.invoke(torch.randn(2, 8), raise_after_first)
        except ValueError:
            pass
        started = _model_threads() - before
        del model, engine, t
        _assert_released(refs, started)  # still inside the task, before it suspends again

    asyncio.run(main())


def test_an_error_held_by_the_caller_keeps_the_engine_only_while_held():
    before = _model_threads()
    model = _small()
    engine = asyncpp.LocalEngine(model)
    refs = _refs(model, engine)

    async def main(engine):
        async with asyncpp.trace(engine) as t:
            h = t.invoke(None, read_first)  # no input at all: the model thread raises InputError
        return h

    with pytest.raises(asyncpp.InputError) as info:
        asyncio.run(main(engine))
    started = _model_threads() - before
    del model, engine
    gc.collect()
    assert refs[2]() is not None  # the error's traceback holds the run's frames (the engine)
    info = None  # noqa: F841  (drop the error)
    _assert_released(refs, started)


@pytest.mark.parametrize("backend", BACKENDS, ids=["asyncio", "uvloop", "trio"])
def test_a_cancelled_trace_leaves_nothing_alive(backend):
    before = _model_threads()
    model = _small()
    engine = asyncpp.LocalEngine(model)
    refs = _refs(model, engine)
    gate = threading.Event()

    async def slow(m):
        gate.wait(JOIN_S)  # holds the model thread until the awaiting task is cancelled
        return await m[0].output

    async def main(engine):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_trace, engine, slow, torch.randn(1, 8))
            await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        assert tg.cancel_scope.cancelled_caught
        gate.set()

    anyio.run(main, engine, backend=backend[0], backend_options=backend[1])
    started = _model_threads() - before
    assert len(started) == 1
    del model, engine
    _assert_released(refs, started)


def test_trio_traces_leave_nothing_alive():
    trio = pytest.importorskip("trio")
    before = _model_threads()
    refs: list[weakref.ref] = []
    started: set[threading.Thread] = set()

    async def main():
        for raises in (False, True):
            model = _small()
            engine = asyncpp.LocalEngine(model)
            refs.extend(_refs(model, engine))
            refs.extend(_refs(model, LocalEngine.for_model(model)))
            for target in (engine, model):
                try:
                    await _trace(target, raise_after_first if raises else read_first, torch.randn(1, 8))
                except ValueError:
                    assert raises
                started.update(_model_threads() - before)
            del model, engine, target

    trio.run(main)
    assert len(started) == 4  # a user engine and a module's shared engine, twice
    _assert_released(refs, started)


def test_many_models_in_a_row_do_not_accumulate_threads():
    before = _model_threads()
    refs: list[weakref.ref] = []
    seen: set[threading.Thread] = set()

    async def main():
        for i in range(12):
            model = _small()
            engine = asyncpp.LocalEngine(model) if i % 2 else LocalEngine.for_model(model)
            refs.extend(_refs(model, engine))
            target = engine if i % 2 else model
            try:
                await _trace(target, raise_after_first if i % 3 == 0 else read_first, torch.randn(1, 8))
            except ValueError:
                assert i % 3 == 0
            seen.update(_model_threads() - before)
            del model, engine, target
            gc.collect()
            # at most the last model's thread may still be on its way out
            for t in seen:
                t.join(JOIN_S)
            assert len(_model_threads() - before) == 0

    asyncio.run(main())
    assert len(seen) == 12
    _assert_released(refs, seen)


def test_close_from_inside_a_block_of_an_async_trace_does_not_hang():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    engine = asyncpp.LocalEngine(model)

    async def block(m):
        out = await m[0].output
        engine.close()  # on the engine's own model thread: must not wait for itself
        return out

    async def main():
        async with asyncpp.trace(engine) as t:
            h = t.invoke(torch.ones(1, 4), block)
        return h.result

    out = asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert out.shape == (1, 4)
    # the engine still works: a later async run starts a new model thread
    assert asyncio.run(asyncio.wait_for(main(), timeout=30)).shape == (1, 4)
    engine.close()

"""The bridge to the caller's event loop (asyncpp/engines/bridge.py) under asyncio, uvloop and trio:
one code path on anyio, the same outcome everywhere, cancellation and finished loops handled."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import anyio
import pytest
import torch
from helpers import Gate

import asyncpp
from asyncpp.engines.bridge import ModelThread, await_future, current_loop, poster, run_on_thread

BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]
WAIT_S = 10.0


def run(main, backend, *args):
    name, options = backend
    return anyio.run(main, *args, backend=name, backend_options=options)


async def read_lin(m):
    return await m.lin.output


async def until(flag: threading.Event) -> None:
    deadline = time.monotonic() + WAIT_S
    while not flag.is_set():
        assert time.monotonic() < deadline
        await anyio.sleep(0.001)


# --- the same trace on every loop ----------------------------------------------------------------


async def layer_and_next_token(m):
    h = await m.model.layers[1].output
    return h[0].norm().item(), (await m.logits)[:, -1].argmax(-1).item()


def test_the_same_trace_gives_the_same_outcome_on_every_loop(engine):
    prompts = ["Hello", "The quick brown fox", "0123456789"]
    with asyncpp.trace(engine) as t:
        expected = [t.invoke(p, layer_and_next_token) for p in prompts]
    expected = [h.result for h in expected]

    async def main():
        results: dict[int, tuple] = {}

        async def one(i, p):
            async with asyncpp.trace(engine) as t:
                h = t.invoke(p, layer_and_next_token)
            results[i] = h.result

        async with anyio.create_task_group() as tg:
            for i, p in enumerate(prompts * 2):
                tg.start_soon(one, i, p)
        return [results[i] for i in range(len(results))]

    for backend in [p.values[0] for p in BACKENDS]:
        got = run(main, backend)
        for (norm, token), (want_norm, want_token) in zip(got, expected * 2, strict=True):
            assert token == want_token
            assert norm == pytest.approx(want_norm, rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_error_reaches_the_caller_on_every_loop(backend, mlp):
    async def fails(m):
        await m[0].output
        raise KeyError("from the block")

    async def main():
        with pytest.raises(KeyError, match="from the block"):
            async with asyncpp.trace(mlp) as t:
                t.invoke(torch.randn(2, 8), fails)
        async with asyncpp.trace(mlp) as t:  # and the engine goes on
            h = t.invoke(torch.ones(2, 8), read_first)
        return h.result

    assert torch.allclose(run(main, backend), mlp[0](torch.ones(2, 8)))


async def read_first(m):
    return await m[0].output


# --- cancellation and finished loops -------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelling_the_awaiting_task_leaves_the_engine_usable(backend):
    torch.manual_seed(0)
    model = Gate()
    engine = asyncpp.LocalEngine(model)
    x = torch.randn(2, 4)

    async def main():
        async def traced():
            async with asyncpp.trace(engine) as t:
                t.invoke(x, read_lin)
            raise AssertionError("the cancelled trace went on")

        async with anyio.create_task_group() as tg:
            tg.start_soon(traced)
            await until(model.entered)
            tg.cancel_scope.cancel()
        assert tg.cancel_scope.cancelled_caught
        model.opened.set()  # the forward that was running finishes on the model thread
        async with asyncpp.trace(engine) as t:
            h = t.invoke(x, read_lin)
        return h.result

    assert torch.allclose(run(main, backend), model.lin(x))
    assert all("forward" not in mod.__dict__ for mod in model.modules())
    engine.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_that_ends_after_its_loop_is_dropped(backend):
    """The loop finished before the run did: the model thread's post fails, and it goes on."""
    torch.manual_seed(0)
    model = Gate()
    engine = asyncpp.LocalEngine(model)
    x = torch.randn(2, 4)

    async def abandon():
        async def traced():
            async with asyncpp.trace(engine) as t:
                t.invoke(x, read_lin)

        async with anyio.create_task_group() as tg:
            tg.start_soon(traced)
            await until(model.entered)
            tg.cancel_scope.cancel()

    async def again():
        async with asyncpp.trace(engine) as t:
            h = t.invoke(x, read_lin)
        return h.result

    run(abandon, backend)  # returns (and its loop is gone) while the forward still waits
    model.opened.set()
    assert torch.allclose(run(again, backend), model.lin(x))
    engine.close()


def test_no_event_loop_is_a_clear_error():
    thread = ModelThread("asyncpp-test-no-loop")
    coro = run_on_thread(thread, lambda: 1)
    with pytest.raises(RuntimeError, match="need a running asyncio, uvloop or trio event loop"):
        coro.send(None)
    coro = await_future(concurrent.futures.Future())
    with pytest.raises(RuntimeError, match="need a running asyncio, uvloop or trio event loop"):
        coro.send(None)
    thread.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_model_thread_does_not_wait_for_the_loop(backend):
    """Posting an outcome does not block the model thread until the loop has run the callback:
    the next job runs while the loop's own thread is still busy."""

    async def main():
        thread = ModelThread("asyncpp-test-post")
        post = poster(current_loop())
        got: list = []
        second = threading.Event()
        thread.submit(lambda: "first", post, lambda ok, value: got.append((ok, value)))
        thread.submit(second.set, lambda deliver, job: deliver(job), lambda ok, value: None)
        assert second.wait(WAIT_S)  # blocks the loop: the first post must not have waited for it
        assert got == []
        await until_true(lambda: got)
        thread.stop()
        return got

    assert run(main, backend) == [(True, "first")]


async def until_true(check) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline
        await anyio.sleep(0.001)


# --- await_future ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_await_future_on_every_loop(backend):
    async def main():
        done = concurrent.futures.Future()
        done.set_result("already")
        later = concurrent.futures.Future()
        threading.Timer(0.02, later.set_result, ("later",)).start()
        failing = concurrent.futures.Future()
        threading.Timer(0.02, failing.set_exception, (ValueError("failed"),)).start()
        got = [await await_future(done), await await_future(later)]
        with pytest.raises(ValueError, match="failed"):
            await await_future(failing)
        return got

    assert run(main, backend) == ["already", "later"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelling_await_future_cancels_the_future(backend):
    async def main():
        fut = concurrent.futures.Future()
        with anyio.move_on_after(0.05) as scope:
            await await_future(fut)
        assert scope.cancelled_caught
        return fut

    assert run(main, backend).cancelled()

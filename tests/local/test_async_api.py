"""The async entry: the caller's loop stays free, traces run concurrently, any event loop works."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest
import torch
from helpers import Gate

import asyncpp


async def read_block(m):
    return await m.lin.output


@pytest.mark.asyncio
async def test_loop_runs_other_tasks_while_the_forward_runs():
    torch.manual_seed(0)
    model = Gate()
    x = torch.randn(2, 4)

    async def opener():
        while not model.entered.is_set():
            await asyncio.sleep(0.001)
        model.opened.set()  # only possible if this loop keeps running during the forward

    async def traced():
        async with asyncpp.trace(model) as t:
            h = t.invoke(x, read_block)
        return h

    h, _ = await asyncio.gather(traced(), opener())
    assert torch.allclose(h.result, model.lin(x))
    assert threading.current_thread() is threading.main_thread()


@pytest.mark.asyncio
async def test_many_concurrent_traces_on_one_model(engine):
    prompts = ["Hello", "a", "The quick brown fox", "xyz", "Hello there", "b c d", "0123456789", "?!"]

    async def layer_norms(m, layer):
        return (await m.model.layers[layer].output)[:, -1].norm(dim=-1), (await m.logits)[:, -1]

    async def steer(m, vec):
        out = await m.model.layers[1].output
        out[:, -1] += vec
        return (await m.logits)[:, -1].argmax(-1)

    vec = torch.randn(128) * 3
    jobs = [(p, layer_norms, i % 4) if i % 2 else (p, steer, vec) for i, p in enumerate(prompts)]

    def alone(job):
        with asyncpp.trace(engine) as t:
            return t.invoke(*job)

    expected = [alone(j).result for j in jobs]

    async def one(job):
        async with asyncpp.trace(engine) as t:
            h = t.invoke(*job)
        return h.result

    got = await asyncio.gather(*(one(j) for j in jobs))
    for e, g in zip(expected, got):
        if isinstance(e, tuple):
            torch.testing.assert_close(g[0], e[0])
            torch.testing.assert_close(g[1], e[1])
        else:
            assert torch.equal(g, e)


@pytest.mark.asyncio
async def test_async_generation(engine):
    async def tokens(m):
        return [int((await m.logits)[0, -1].argmax()) async for _ in m.steps()]

    async with asyncpp.generate(engine, max_new_tokens=4) as t:
        h = t.invoke("Hello", tokens)
    assert h.result == h.tokens[0].tolist()


@pytest.mark.asyncio
async def test_block_error_surfaces_at_async_exit(mlp):
    async def failing(m):
        await m[0].output
        raise ValueError("from the block")

    with pytest.raises(ValueError, match="from the block"):
        async with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(1, 8), failing)

    async with asyncpp.trace(mlp) as t:
        h = t.invoke(torch.randn(1, 8), read_block_mlp)
    assert h.result.shape == (1, 8)


async def read_block_mlp(m):
    return await m[3].output


@pytest.mark.asyncio
async def test_cancelled_caller_leaves_the_engine_usable():
    torch.manual_seed(0)
    model = Gate()
    x = torch.randn(2, 4)

    async def traced():
        async with asyncpp.trace(model) as t:
            t.invoke(x, read_block)

    task = asyncio.ensure_future(traced())
    while not model.entered.is_set():
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    model.opened.set()  # the forward that was running finishes on the model thread
    async with asyncpp.trace(model) as t:
        h = t.invoke(x, read_block)
    assert torch.allclose(h.result, model.lin(x))
    assert all("forward" not in mod.__dict__ for mod in model.modules())


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_every_event_loop(anyio_backend, mlp):
    x = torch.randn(3, 8)

    async def one(i):
        async with asyncpp.trace(mlp) as t:
            h = t.invoke(x * i, read_block_mlp)
        results[i] = h.result

    results: dict[int, torch.Tensor] = {}
    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
    for i in range(4):
        assert torch.allclose(results[i], mlp(x * i))


@pytest.mark.asyncio
async def test_two_engines_on_one_model_take_turns(tiny):
    model, tok = tiny
    e1, e2 = asyncpp.LocalEngine(model, tok), asyncpp.LocalEngine(model, tok)

    async def block(m):
        await m.model.layers[1].output
        return (await m.logits)[:, -1].argmax(-1).item()

    prompt = tok("Hello world, " * 5)["input_ids"]

    async def one(e):
        async with asyncpp.trace(e) as t:
            h = t.invoke(prompt, block)
        return h.result

    with asyncpp.trace(e1) as t:
        expected = t.invoke(prompt, block)
    results = await asyncio.gather(*(one(e) for e in (e1, e2, e1, e2, model)))
    assert results == [expected.result] * 5
    e1.close()
    e2.close()

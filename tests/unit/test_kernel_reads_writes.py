"""Reads, occurrences, writes and skips on real torch modules, against plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from helpers import run

import asyncpp


def test_read_outputs_match_plain_forward(mlp):
    x = torch.randn(3, 8)

    async def block(m):
        a = await m[1].output
        b = await m[3][0].output
        return a, b

    (h,) = run(mlp, (x, block))
    a, b = h.result
    assert torch.allclose(a, mlp[:2](x))
    assert torch.allclose(b, mlp[3][0](mlp[:3](x)))


def test_input_and_inputs(tuplenet):
    x = torch.randn(2, 8)

    async def block(m):
        first = await m.pair.input
        args, kwargs = await m.pair.inputs
        return first, args, kwargs

    (h,) = run(tuplenet, (x, block))
    first, args, kwargs = h.result
    assert torch.equal(first, x)
    assert torch.equal(args[0], x)
    assert kwargs == {"scale": 2.0}


def test_module_called_twice_has_two_occurrences(twice):
    x = torch.randn(2, 8)

    async def block(m):
        first = await m.inner.output
        second_in = await m.inner.input.at(1)
        second = await m.inner.output.at(1)
        return first, second_in, second

    (h,) = run(twice, (x, block))
    first, second_in, second = h.result
    inner = twice.inner
    assert torch.allclose(first, inner(x))
    assert torch.allclose(second_in, torch.relu(inner(x)))
    assert torch.allclose(second, inner(torch.relu(inner(x))))


def test_second_call_alone_and_reversed_order_error(twice):
    x = torch.randn(2, 8)

    async def only_second(m):
        return await m.inner.output.at(1)

    (h,) = run(twice, (x, only_second))
    assert torch.allclose(h.result, twice.inner(torch.relu(twice.inner(x))))

    async def reversed_order(m):
        await m.inner.output.at(1)
        await m.inner.output.at(0)

    with pytest.raises(asyncpp.OrderError, match=r"inner.output has already passed.*inner.output \(call 1\)"):
        run(twice, (x, reversed_order))


def test_in_place_edit_lands_in_model(mlp):
    x = torch.randn(3, 8)

    async def block(m):
        out = await m[1].output
        out[:] = 0
        return await m.output

    (h,) = run(mlp, (x, block))
    assert torch.allclose(h.result, mlp[2:](torch.zeros(3, 8)))


def test_replace_output_after_reading_and_without_reading(mlp):
    x = torch.randn(3, 8)
    repl = torch.randn(3, 8)
    expected = mlp[2:](repl)

    async def after_read(m):
        out = await m[1].output
        await m[1].output.set(repl + 0 * out)
        return await m.output

    async def blind(m):
        await m[1].output.set(repl)
        return await m.output

    for block in (after_read, blind):
        (h,) = run(mlp, (x, block))
        assert torch.allclose(h.result, expected), block.__name__


def test_replace_input(mlp):
    x = torch.randn(3, 8)
    repl = torch.randn(3, 8)

    async def block(m):
        await m[2].input.set(repl)
        return await m.output

    (h,) = run(mlp, (x, block))
    assert torch.allclose(h.result, mlp[2:](repl))


def test_replace_one_element_of_tuple_output(tuplenet):
    x = torch.randn(2, 8)

    async def read_then_set(m):
        h, aux = await m.pair.output
        await m.pair.output[0].set(torch.zeros_like(h))
        return await m.output

    async def blind(m):
        await m.pair.output[0].set(torch.zeros(2, 8))
        return await m.output

    _, aux = tuplenet.pair(x, scale=2.0)
    expected = tuplenet.head(torch.zeros(2, 8)) + aux[:, None]
    for block in (read_then_set, blind):
        (h,) = run(tuplenet, (x, block))
        assert torch.allclose(h.result, expected), block.__name__


def test_skip_module(mlp):
    x = torch.randn(3, 8)
    calls = []
    hook = mlp[2][0].register_forward_pre_hook(lambda mod, args: calls.append(1))
    try:

        async def block(m):
            await m[2].skip(torch.ones(3, 8))
            return await m.output

        (h,) = run(mlp, (x, block))
    finally:
        hook.remove()
    assert calls == []  # the skipped module (and its children) never ran
    assert torch.allclose(h.result, mlp[3](torch.ones(3, 8)))


def test_skip_identity_from_input(mlp):
    x = torch.randn(3, 8)

    async def block(m):
        inp = await m[1].input
        await m[1].skip(inp)
        return await m.output

    (h,) = run(mlp, (x, block))
    assert torch.allclose(h.result, mlp[3](mlp[2](mlp[0](x))))


def test_results_are_detached_copies(mlp):
    x = torch.randn(3, 8)

    async def reader(m):
        return await m[1].output  # finishes at layer 1

    async def later_editor(m):
        out = await m[1].output
        await m[2].output
        out[:] = 7.0  # edits layer 1's buffer after the reader has finished
        return None

    with asyncpp.trace(mlp) as t:
        a = t.invoke(reader)
        t.invoke(later_editor)
        t.invoke(x, reader)
    assert torch.allclose(a.result, mlp[:2](x))
    assert not a.result.requires_grad


def test_grad_trace_gives_gradients(mlp):
    x = torch.randn(3, 8)

    async def block(m):
        h = await m[1].output
        h.retain_grad()
        out = await m.output
        out.sum().backward()
        return h.grad

    (h,) = run(mlp, (x, block), grad=True)
    hx = mlp[:2](x).detach().requires_grad_()
    mlp[2:](hx).sum().backward()
    assert torch.allclose(h.result, hx.grad)


def test_whole_batch_write_of_wrong_shape_is_a_write_error(mlp):
    async def bad(m):
        await m[1].output.set(torch.zeros(3))

    with pytest.raises(asyncpp.WriteError, match=r"1\.output: the replacement has shape \(3,\).*\(2, 8\)"):
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(2, 8), bad)


def test_block_calling_the_models_own_modules_is_not_part_of_the_run(tiny, engine):
    model, _ = tiny

    async def lens(m):
        h = await m.model.layers[0].output
        normed = model.model.norm(h[:, -1])  # the block runs model modules itself
        return model.lm_head(normed)

    async def logits(m):
        return await m.logits

    with asyncpp.trace(engine) as t:
        a = t.invoke(lens)
        b = t.invoke("Hello", logits)
    assert a.result.shape == (1, 259)
    assert b.result.shape == (1, 5, 259)  # the model's own lm_head call, not the block's
    with torch.no_grad():
        assert torch.allclose(b.result, model(torch.tensor([[39, 68, 75, 75, 78]])).logits, atol=1e-6)


def test_a_plain_trace_is_step_zero(mlp):
    async def block(m):
        return [s async for s in m.steps()]

    with asyncpp.trace(mlp) as t:
        h = t.invoke(torch.randn(1, 8), block)
    assert h.result == [0]

"""Several invokes in one trace: one batched forward, each block on its own rows."""

from __future__ import annotations

import pytest
import torch

import asyncpp


def test_each_block_sees_only_its_rows(mlp):
    xa, xb = torch.randn(2, 8), torch.randn(3, 8)
    batch_sizes = []
    hook = mlp[0].register_forward_hook(lambda mod, a, o: batch_sizes.append(o.shape[0]))

    async def read(m):
        return await m[2].output

    try:
        with asyncpp.trace(mlp) as t:
            a = t.invoke(xa, read)
            b = t.invoke(xb, read)
    finally:
        hook.remove()
    assert batch_sizes == [5]  # one batched forward
    assert torch.allclose(a.result, mlp[:3](xa), atol=1e-6)
    assert torch.allclose(b.result, mlp[:3](xb), atol=1e-6)
    assert torch.allclose(a.output, mlp(xa), atol=1e-6)
    assert b.output.shape == (3, 8)


def test_edits_stay_in_their_rows(mlp):
    xa, xb = torch.randn(2, 8), torch.randn(3, 8)

    async def zero(m):
        out = await m[1].output
        out[:] = 0  # in place, on this invoke's rows only
        return await m.output

    async def replace(m):
        await m[1].output.set(torch.ones(3, 8))
        return await m.output

    async def plain(m):
        return await m.output

    with asyncpp.trace(mlp) as t:
        a = t.invoke(xa, zero)
        b = t.invoke(xb, plain)
    assert torch.allclose(a.result, mlp[2:](torch.zeros(2, 8)), atol=1e-6)
    assert torch.allclose(b.result, mlp(xb), atol=1e-6)

    with asyncpp.trace(mlp) as t:
        a = t.invoke(xa, plain)
        b = t.invoke(xb, replace)
    assert torch.allclose(a.result, mlp(xa), atol=1e-6)
    assert torch.allclose(b.result, mlp[2:](torch.ones(3, 8)), atol=1e-6)


def test_invoke_without_input_sees_whole_batch(mlp):
    xa, xb = torch.randn(2, 8), torch.randn(3, 8)

    async def rows(m):
        return (await m[0].output).shape[0]

    with asyncpp.trace(mlp) as t:
        a = t.invoke(xa, rows)
        b = t.invoke(xb, rows)
        whole = t.invoke(rows)
    assert (a.result, b.result, whole.result) == (2, 3, 5)


def test_write_of_wrong_shape_is_a_clear_error(mlp):
    xa, xb = torch.randn(2, 8), torch.randn(3, 8)

    async def bad(m):
        await m[1].output.set(torch.ones(5, 8))

    with pytest.raises(asyncpp.WriteError, match=r"1\.output: the replacement has shape \(5, 8\).*rows 0:2"):
        with asyncpp.trace(mlp) as t:
            t.invoke(xa, bad)
            t.invoke(xb, bad)


def test_trace_without_any_input_is_rejected(mlp):
    async def block(m):
        return None

    with pytest.raises(asyncpp.AsyncppError, match="no input"):
        with asyncpp.trace(mlp) as t:
            t.invoke(block)


def test_inputs_that_cannot_batch(mlp):
    async def block(m):
        return None

    with pytest.raises(asyncpp.AsyncppError, match="cannot be batched"):
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(2, 8), block)
            t.invoke(torch.randn(2, 5), block)


def test_many_blocks_at_one_call_see_each_others_edits_in_invoke_order(mlp):
    """Three blocks wait on the same call: each reads the value as the blocks before it left it
    (a replacement of rows 0:2, an in-place edit of rows 2:5), and the model gets the last."""
    xa, xb = torch.randn(2, 8), torch.randn(3, 8)

    async def double(m):
        out = await m[1].output
        await m[1].output.set(out * 2)
        return await m[3].output

    async def bump(m):
        out = await m[1].output
        out += 1
        return await m[3].output

    async def whole(m):
        seen = (await m[1].output).clone()
        return seen, await m[3].output

    with asyncpp.trace(mlp) as t:
        a = t.invoke(xa, double)
        b = t.invoke(xb, bump)
        w = t.invoke(whole)
    h = mlp[:2](torch.cat([xa, xb]))
    expected = torch.cat([h[:2] * 2, h[2:] + 1])
    seen, last = w.result
    assert torch.allclose(seen, expected, atol=1e-6)
    assert torch.allclose(last, mlp[2:4](expected), atol=1e-6)
    assert torch.allclose(a.result, mlp[2:4](expected[:2]), atol=1e-6)
    assert torch.allclose(b.result, mlp[2:4](expected[2:]), atol=1e-6)
    assert torch.allclose(a.output, mlp[2:](expected)[:2], atol=1e-6)

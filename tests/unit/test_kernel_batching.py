"""Several invokes in one trace: one batched forward, each block on its own rows."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import asyncpp
import asyncpp.native
from asyncpp.kernel import batching


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


def _python_narrow(value, rows, batch):
    """The Python twin of the native narrowing (batching.narrow without the native hand-off)."""
    saved, batching._native_narrow = batching._native_narrow, None
    try:
        return batching.narrow(value, rows, batch)
    finally:
        batching._native_narrow = saved


@pytest.mark.parametrize("mode", ["inference", "grad"])
def test_native_row_narrowing_agrees_with_the_python_twin(mode):
    native = asyncpp.native.load()
    if native is None:
        pytest.skip("the native extension is off")
    ctx = torch.inference_mode() if mode == "inference" else torch.enable_grad()
    with ctx:
        base = torch.randn(6, 5, 4, requires_grad=mode == "grad")
        h = base * 2 if mode == "grad" else base
        odd = h[:, 1]  # not contiguous: strides (20, 1)
        value = (h, None, torch.ones(3), [odd, 7])
        for rows in [(1, 3), (0, 6), (4, 4), (5, 6)]:
            got = native.narrow_rows(value, rows[0], rows[1], 6)
            want = _python_narrow(value, rows, 6)
            assert type(got) is tuple and type(got[3]) is list
            for g, w in [(got[0], want[0]), (got[2], want[2]), (got[3][0], want[3][0])]:
                assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype
                assert g.storage_offset() == w.storage_offset()
                assert g.is_inference() == w.is_inference() == (mode == "inference")
                assert torch.equal(g, w)
            assert got[1] is None and got[2] is value[2] and got[3][1] == 7
        view = native.narrow_rows(h, 2, 4, 6)
    if mode == "inference":
        with torch.inference_mode():
            view += 1  # an edit of the rows lands in the batch
        assert (
            torch.equal(h[2:4], view) and view.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
        )
    else:
        view.sum().backward()  # the rows stay in the autograd graph
        assert base.grad[2:4].eq(2).all() and base.grad[:2].eq(0).all()


def test_native_row_narrowing_narrows_every_container_the_python_twin_does():
    native = asyncpp.native.load()
    if native is None:
        pytest.skip("the native extension is off")
    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Box:
        t: torch.Tensor
        n: int

    h = torch.randn(6, 3)
    # (args, kwargs) of a module called by keyword, as `.inputs` presents it, and other containers
    value = ((h,), {"hidden_states": h, "scale": 2.0, "nested": [h, {"x": h}]}, Pair(h, None), Box(h, 4), "s")
    got = native.narrow_rows(value, 2, 5, 6)
    want = _python_narrow(value, (2, 5), 6)
    assert type(got[1]) is dict and type(got[2]) is Pair and type(got[3]) is Box
    pairs = [
        (got[0][0], want[0][0]),
        (got[1]["hidden_states"], want[1]["hidden_states"]),
        (got[1]["nested"][0], want[1]["nested"][0]),
        (got[1]["nested"][1]["x"], want[1]["nested"][1]["x"]),
        (got[2].a, want[2].a),
        (got[3].t, want[3].t),
    ]
    for g, w in pairs:
        assert g.shape == (3, 3) and torch.equal(g, w) and torch.equal(g, h[2:5])
    assert got[1]["scale"] == 2.0 and got[2].b is None and got[3].n == 4 and got[4] == "s"


def test_a_module_called_by_keyword_shows_each_invoke_its_own_rows_of_its_inputs():
    class Inner(torch.nn.Module):
        def forward(self, x, scale=None):
            return x * scale

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x=x, scale=torch.full_like(x, 2.0))

    model = Outer()
    xa, xb = torch.randn(2, 4), torch.randn(3, 4)

    async def read_and_zero(m):
        args, kwargs = await m.inner.inputs
        kept = {k: v.clone() for k, v in kwargs.items()}
        kwargs["x"].zero_()  # its own rows only
        return args, kept

    async def read(m):
        return await m.inner.input

    with asyncpp.trace(model) as t:
        a = t.invoke(xa, read_and_zero)
        b = t.invoke(xb, read)
    args, kept = a.result
    assert args == () and list(kept) == ["x", "scale"]
    assert torch.equal(kept["x"], xa) and torch.equal(kept["scale"], torch.full_like(xa, 2.0))
    assert torch.equal(b.result, xb)
    assert torch.equal(a.output, torch.zeros_like(xa)) and torch.equal(b.output, xb * 2)

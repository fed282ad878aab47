"""Errors are raised at the user's line, name the locations, and leave nothing behind."""

from __future__ import annotations

import asyncio
import traceback

import pytest
import torch

import asyncpp


def _no_controllers(model) -> bool:
    return all("forward" not in m.__dict__ for m in model.modules())


def _frames(err: BaseException) -> list[tuple[str, str]]:
    return [(f.name, f.line) for f in traceback.extract_tb(err.__traceback__)]


def test_order_error_at_users_line_names_both_locations(mlp):
    x = torch.randn(2, 8)

    async def block(m):
        await m[3].output
        await m[1].output  # already passed

    with pytest.raises(asyncpp.OrderError) as info:
        with asyncpp.trace(mlp) as t:
            t.invoke(x, block)
    assert "1.output has already passed" in str(info.value)
    assert "the model is at 3.output" in str(info.value)
    name, line = _frames(info.value)[-1]
    assert name == "block" and "await m[1].output" in line
    assert _no_controllers(mlp)


def test_a_refused_write_ends_its_traceback_at_the_users_line(mlp):
    x = torch.randn(2, 8)

    async def block(m):
        h = await m[0].output
        await m[2].output.set(h[:1])  # one row of two

    with pytest.raises(asyncpp.WriteError, match=r"2.output: the replacement has shape \(1, 8\)") as info:
        with asyncpp.trace(mlp) as t:
            t.invoke(x, block)
    name, line = _frames(info.value)[-1]
    assert name == "block" and "set(h[:1])" in line
    assert _no_controllers(mlp)


def test_never_reached_names_the_location_and_runs_finally(twice):
    x = torch.randn(2, 8)
    log = []

    async def block(m):
        try:
            await m.inner.output.at(2)  # inner runs only twice
        finally:
            log.append("finally")

    with pytest.raises(asyncpp.NeverReachedError, match=r"inner.output \(call 2\) was never reached") as info:
        with asyncpp.trace(twice) as t:
            t.invoke(x, block)
    assert log == ["finally"]
    name, line = _frames(info.value)[-1]
    assert name == "block" and "at(2)" in line


@pytest.mark.parametrize("kind", ["sleep", "future"])
def test_foreign_awaitable_is_a_clear_error(mlp, kind):
    x = torch.randn(2, 8)
    loop = asyncio.new_event_loop()

    async def block(m):
        await m[0].output
        if kind == "sleep":
            await asyncio.sleep(0)
        else:
            await loop.create_future()

    try:
        with pytest.raises(asyncpp.ForeignAwaitError, match="can only await asyncpp locations") as info:
            with asyncpp.trace(mlp) as t:
                t.invoke(x, block)
    finally:
        loop.close()
    assert any(name == "block" for name, _ in _frames(info.value))


@pytest.mark.parametrize(
    "use",
    [
        lambda loc: loc.shape,
        lambda loc: loc + 1,
        lambda loc: torch.relu(loc),
        lambda loc: bool(loc),
        lambda loc: loc.sum(),
        lambda loc: list(loc),
    ],
    ids=["attribute", "arithmetic", "torch-function", "bool", "method", "iter"],
)
def test_forgotten_await_fails_loudly(mlp, use):
    x = torch.randn(2, 8)

    async def block(m):
        return use(m[1].output)

    with pytest.raises(asyncpp.MissingAwaitError, match=r"1\.output is a location, not a value"):
        with asyncpp.trace(mlp) as t:
            t.invoke(x, block)


def test_returning_a_location_is_a_missing_await(mlp):
    async def block(m):
        return {"h": m[1].output}

    with pytest.raises(asyncpp.MissingAwaitError, match="add `await`"):
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(2, 8), block)


def test_unawaited_set_is_an_error(mlp):
    async def block(m):
        m[1].output.set(torch.zeros(2, 8))  # missing await: nothing would be written

    with pytest.raises(asyncpp.WriteError, match="was never awaited"):
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(2, 8), block)


def test_block_exception_surfaces_with_users_traceback_and_model_recovers(mlp):
    x = torch.randn(2, 8)
    log = []

    async def failing(m):
        out = await m[1].output
        raise KeyError(f"boom {out.shape[0]}")

    async def bystander(m):
        try:
            return await m[3].output
        finally:
            log.append("bystander done")

    with pytest.raises(KeyError, match="boom 2") as info:
        with asyncpp.trace(mlp) as t:
            t.invoke(x, failing)
            other = t.invoke(x, bystander)
    frames = _frames(info.value)
    assert frames[-1][0] == "failing" and "raise KeyError" in frames[-1][1]
    assert not any("interleaver" in f.filename for f in traceback.extract_tb(info.value.__traceback__))
    assert torch.allclose(other.result, mlp(x), atol=1e-6)  # the other block finished
    assert log == ["bystander done"]
    assert _no_controllers(mlp)

    async def ok(m):
        return await m[3].output

    with asyncpp.trace(mlp) as t:
        h = t.invoke(x, ok)
    assert torch.allclose(h.result, mlp(x))


def test_model_error_closes_blocks_and_removes_controllers(mlp):
    log = []

    async def block(m):
        try:
            await m[3].output
        finally:
            log.append("closed")

    with pytest.raises(RuntimeError):
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(2, 5), block)  # wrong width: the model itself fails
    assert log == ["closed"]
    assert _no_controllers(mlp)


def test_unknown_path_fails_at_invoke_with_nearest_names(tiny):
    model, _ = tiny

    async def block(m):
        return await m.model.layers[0].mpl.output

    with pytest.raises(
        asyncpp.PathError, match=r"no module 'model.layers.0.mpl'; did you mean 'mlp'"
    ) as info:
        with asyncpp.trace(model) as t:
            t.invoke(torch.tensor([1, 2, 3]), block)
    assert "in block" in str(info.value) and "test_kernel_errors.py" in str(info.value)

    async def dynamic(m, i):
        return await m.model.layers[i].self_attention.output

    with pytest.raises(asyncpp.PathError, match="self_attention"):
        with asyncpp.trace(model) as t:
            t.invoke(torch.tensor([1, 2, 3]), dynamic, 0)

    async def by_getattr(m, name):
        return await getattr(m.model, name).output

    with pytest.raises(asyncpp.PathError, match=r"no module 'model.layer'; did you mean 'layers'"):
        with asyncpp.trace(model) as t:
            t.invoke(torch.tensor([1, 2, 3]), by_getattr, "layer")


def test_block_must_be_async(mlp):
    def not_async(m):
        return None

    with pytest.raises(TypeError, match="async def"):
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(1, 8), not_async)


def test_trace_on_the_same_model_from_inside_a_block_is_refused(mlp):
    async def inner(m):
        return await m[0].output

    async def outer(m):
        await m[0].output
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(1, 8), inner)

    with pytest.raises(asyncpp.AsyncppError, match="would wait for itself"):
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(1, 8), outer)


def test_trace_on_a_temporary_module():
    async def block(m):
        return await m.output

    with asyncpp.trace(torch.nn.Linear(4, 4)) as t:
        h = t.invoke(torch.randn(1, 4), block)
    assert h.result.shape == (1, 4)


def test_a_block_name_on_a_local_engine_says_where_names_work(mlp):
    with pytest.raises(TypeError, match="blocks are named only on an asyncpp server"):
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.zeros(1, 8), "steer")

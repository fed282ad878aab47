"""Waiting on several locations at once, and blocks handing values to each other in one visit."""

from __future__ import annotations

import pytest
import torch

import asyncpp


def test_gather_in_any_order(mlp):
    x = torch.randn(2, 8)

    async def block(m):
        late, early = await asyncpp.gather(m[3].output, m[0].output)
        return late, early

    with asyncpp.trace(mlp) as t:
        h = t.invoke(x, block)
    late, early = h.result
    assert torch.allclose(late, mlp(x))
    assert torch.allclose(early, mlp[0](x))


def test_gather_with_a_passed_location_is_an_order_error(mlp):
    x = torch.randn(2, 8)

    async def block(m):
        await m[2].output
        await asyncpp.gather(m[3].output, m[1].output)

    with pytest.raises(asyncpp.OrderError, match=r"1\.output has already passed"):
        with asyncpp.trace(mlp) as t:
            t.invoke(x, block)


@pytest.mark.parametrize("clean_first", [True, False])
def test_patching_between_invokes_within_one_visit(mlp, clean_first):
    clean_x, corrupt_x = torch.randn(1, 8), torch.randn(1, 8)

    async def clean(m, slot):
        out = await m[1].output
        slot.set(out.clone())
        return await m.output

    async def corrupt(m, slot):
        out = await m[1].output
        out[:] = await slot  # resolved within this visit of layer 1, whatever the invoke order
        return await m.output

    slot = asyncpp.Slot("clean layer 1")
    with asyncpp.trace(mlp) as t:
        if clean_first:
            c = t.invoke(clean_x, clean, slot)
            p = t.invoke(corrupt_x, corrupt, slot)
        else:
            p = t.invoke(corrupt_x, corrupt, slot)
            c = t.invoke(clean_x, clean, slot)
    assert torch.allclose(p.result, c.result)
    assert torch.allclose(c.result, mlp(clean_x))


def test_resume_order_at_one_location_is_invoke_order(mlp):
    x = torch.randn(1, 8)
    events = []

    def make(name, first):
        async def block(m):
            await m[first].output
            events.append((name, "first"))
            await m[2].output
            events.append((name, "shared"))

        return block

    with asyncpp.trace(mlp) as t:
        t.invoke(x, make("a", 1))
        t.invoke(make("b", 0))
        t.invoke(make("c", 1))
    assert events == [
        ("b", "first"),
        ("a", "first"),
        ("c", "first"),
        ("a", "shared"),
        ("b", "shared"),
        ("c", "shared"),
    ]


def test_slot_never_set_is_reported(mlp):
    x = torch.randn(1, 8)

    async def waits(m, slot):
        await m[0].output
        return await slot

    with pytest.raises(asyncpp.NeverReachedError, match="slot 'never' was never set"):
        with asyncpp.trace(mlp) as t:
            t.invoke(x, waits, asyncpp.Slot("never"))


def test_slot_set_twice_is_an_error(mlp):
    async def twice(m, slot):
        await m[0].output
        slot.set(1)
        slot.set(2)

    with pytest.raises(asyncpp.SlotError, match="already set"):
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.randn(1, 8), twice, asyncpp.Slot())


def test_block_woken_by_a_slot_runs_within_the_same_visit(mlp):
    # `setter` is the only (whole-batch) reader of layer 1, the case the native fast path serves;
    # the slot it sets wakes `waiter`, which must still run inside that visit of layer 1.
    x = torch.randn(2, 8)

    async def waiter(m, slot):
        value = await slot
        after = await m[2].output  # still ahead: the model is inside layer 1's visit
        return value, after

    async def setter(m, slot):
        h = await m[1].output
        slot.set(h.clone())
        again = await m[1].output  # the visit being served: its value at once
        return torch.equal(again, h)

    slot = asyncpp.Slot("h1")
    with asyncpp.trace(mlp) as t:
        w = t.invoke(x, waiter, slot)
        s = t.invoke(setter, slot)
    value, after = w.result
    assert s.result is True
    assert torch.allclose(value, mlp[:2](x))
    assert torch.allclose(after, mlp[:3](x))

"""Gradients in local traces with grad=True, checked against plain PyTorch autograd on the tiny Llama:
per-invoke rows inside the graph, backward passes a block drives, gradients read and replaced."""

from __future__ import annotations

import pytest
import torch

import asyncpp

PROMPTS = ["The quick brown fox", "Hello", "abc"]
TOKEN = 42


def ids(tok, text):
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def reference(model, tok, text, layers, *, scale_at=None, scale=1.0):
    """Plain PyTorch: gradients of the last position's TOKEN logit with respect to the outputs of
    ``layers``; ``scale_at`` multiplies the gradient flowing through that layer's output."""
    outs, handles = {}, []

    def keep(i):
        def hook(mod, args, out):
            if i == scale_at:
                out.register_hook(lambda g: g * scale)
            outs[i] = out

        return hook

    for i in set(layers) | ({scale_at} - {None}):
        handles.append(model.model.layers[i].register_forward_hook(keep(i)))
    try:
        with torch.enable_grad():
            logits = model(ids(tok, text)).logits
            loss = logits[0, -1, TOKEN]
            grads = torch.autograd.grad(loss, [outs[i] for i in layers])
    finally:
        for h in handles:
            h.remove()
    return [g.detach() for g in grads]


async def grad_of_layer(m, layer):
    h = await m.model.layers[layer].output
    logits = await m.logits
    loss = logits[:, -1, TOKEN].sum()
    (g,) = torch.autograd.grad(loss, h, retain_graph=True)
    return g


def test_each_invokes_gradient_equals_plain_autograd_for_its_prompt(tiny, engine):
    model, tok = tiny
    with asyncpp.trace(engine, grad=True) as t:
        handles = [t.invoke(p, grad_of_layer, 1) for p in PROMPTS]
    for p, h in zip(PROMPTS, handles):
        (ref,) = reference(model, tok, p, [1])
        n = ref.shape[1]
        torch.testing.assert_close(h.result[:, -n:], ref, rtol=1e-5, atol=1e-6)
        assert ref.abs().max() > 0  # a gradient that is really there
        assert h.result[:, :-n].abs().max() == 0 if h.result.shape[1] > n else True  # padding


def test_backward_pass_driven_by_the_block_serves_gradients_in_backward_order(tiny, engine):
    model, tok = tiny

    async def block(m):
        await m.model.layers[1].output
        await m.model.layers[3].output
        loss = (await m.logits)[:, -1, TOKEN].sum()
        order = []
        async with asyncpp.backward(loss):
            g3 = await m.model.layers[3].output.grad
            order.append(3)
            g1 = await m.model.layers[1].output.grad
            order.append(1)
        return g3, g1, order

    with asyncpp.trace(engine, grad=True) as t:
        handles = [t.invoke(p, block) for p in PROMPTS]
    for p, h in zip(PROMPTS, handles):
        g3, g1, order = h.result
        ref3, ref1 = reference(model, tok, p, [3, 1])
        n = ref1.shape[1]
        assert order == [3, 1]
        torch.testing.assert_close(g3[:, -n:], ref3, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g1[:, -n:], ref1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [0.0, 2.0])
def test_gradient_replaced_at_one_layer_changes_what_flows_on(tiny, engine, scale):
    model, tok = tiny

    async def block(m, scale):
        await m.model.layers[1].output
        await m.model.layers[2].output
        loss = (await m.logits)[:, -1, TOKEN].sum()
        async with asyncpp.backward(loss):
            g2 = await m.model.layers[2].output.grad
            await m.model.layers[2].output.grad.set(g2 * scale)
            g1 = await m.model.layers[1].output.grad
        return g1

    with asyncpp.trace(engine, grad=True) as t:
        handles = [t.invoke(p, block, scale) for p in PROMPTS[:2]]
    for p, h in zip(PROMPTS[:2], handles):
        (ref,) = reference(model, tok, p, [1], scale_at=2, scale=scale)
        (plain,) = reference(model, tok, p, [1])
        n = ref.shape[1]
        torch.testing.assert_close(h.result[:, -n:], ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ref, plain * scale, rtol=1e-4, atol=1e-6)


def test_standard_points_have_gradients_of_the_invokes_own_tokens(tiny, engine):
    """``m.std`` points read and replace gradients like raw locations, shown as the point's value
    is: this invoke's tokens only (no left padding), the same numbers."""
    model, tok = tiny

    async def block(m):
        await m.std.layers[1].resid_out
        h2 = await m.std.layers[2].resid_out
        loss = (await m.std.logits)[:, -1, TOKEN].sum()
        async with asyncpp.backward(loss):
            g2 = await m.std.layers[2].resid_out.grad
            assert g2.shape == h2.shape
            await m.std.layers[2].resid_out.grad.set(g2 * 0.5)
            g1 = await m.std.layers[1].resid_out.grad
        return g1

    with asyncpp.trace(engine, grad=True) as t:
        handles = [t.invoke(p, block) for p in PROMPTS[:2]]
    assert handles[0].result.shape[1] != handles[1].result.shape[1]  # each its own length
    for p, h in zip(PROMPTS[:2], handles):
        (ref,) = reference(model, tok, p, [1], scale_at=2, scale=0.5)
        assert h.result.shape == ref.shape
        torch.testing.assert_close(h.result, ref, rtol=1e-5, atol=1e-6)


def test_gradient_with_respect_to_an_edited_and_a_replaced_value(tiny, engine):
    """Edits and replacements are on the graph: the gradient flows through what the model used."""
    model, tok = tiny
    vec = torch.randn(128)

    async def steer(m, vec):
        out = await m.model.layers[1].output
        out[:, -1] += vec
        loss = (await m.logits)[:, -1, TOKEN].sum()
        (g,) = torch.autograd.grad(loss, out, retain_graph=True)
        return g

    async def replace(m, vec):
        out = await m.model.layers[1].output
        new = out.detach().clone().requires_grad_(True)
        await m.model.layers[1].output.set(new)
        loss = (await m.logits)[:, -1, TOKEN].sum()
        (g,) = torch.autograd.grad(loss, new, retain_graph=True)
        return g

    with asyncpp.trace(engine, grad=True) as t:
        a = t.invoke(PROMPTS[0], steer, vec)
        b = t.invoke(PROMPTS[1], replace, vec)
    (ref_b,) = reference(model, tok, PROMPTS[1], [1])
    n = ref_b.shape[1]
    torch.testing.assert_close(b.result[:, -n:], ref_b, rtol=1e-5, atol=1e-6)
    with asyncpp.trace(engine, grad=True) as t:
        alone = t.invoke(PROMPTS[0], steer, vec)
    torch.testing.assert_close(a.result, alone.result, rtol=1e-5, atol=1e-6)


def test_gradients_awaited_out_of_backward_order_are_an_order_error(engine):
    async def block(m):
        await m.model.layers[1].output
        await m.model.layers[3].output
        loss = (await m.logits)[:, -1, TOKEN].sum()
        async with asyncpp.backward(loss):
            await m.model.layers[1].output.grad
            await m.model.layers[3].output.grad  # reached before layer 1's in the backward

    with pytest.raises(asyncpp.OrderError, match=r"model.layers.3.output.grad has already passed") as info:
        with asyncpp.trace(engine, grad=True) as t:
            t.invoke(PROMPTS[0], block)
            t.invoke(PROMPTS[1], block)
    assert info.traceback[-1].lineno + 1 == block.__code__.co_firstlineno + 6  # the second await


def test_gradient_the_loss_does_not_depend_on_is_never_reached(engine):
    async def block(m):
        h1 = await m.model.layers[1].output
        await m.model.layers[3].output
        loss = h1.sum()
        async with asyncpp.backward(loss):
            return await m.model.layers[3].output.grad

    with pytest.raises(asyncpp.NeverReachedError, match=r"model.layers.3.output.grad was never reached"):
        with asyncpp.trace(engine, grad=True) as t:
            t.invoke(PROMPTS[0], block)
            t.invoke(PROMPTS[1], block)


def test_misuses_of_gradients_are_clear_errors(engine):
    async def outside(m):
        await m.model.layers[1].output
        return await m.model.layers[1].output.grad

    async def not_awaited(m):
        loss = (await m.logits).sum()
        async with asyncpp.backward(loss):
            return await m.model.layers[1].output.grad

    async def wrong_shape(m):
        await m.model.layers[1].output
        loss = (await m.logits).sum()
        async with asyncpp.backward(loss):
            await m.model.layers[1].output.grad.set(torch.zeros(3))

    async def forgot(m):
        await m.model.layers[1].output
        loss = (await m.logits).sum()
        async with asyncpp.backward(loss):
            return m.model.layers[1].output.grad * 2

    cases = [
        (outside, asyncpp.AsyncppError, "inside `async with asyncpp.backward"),
        (not_awaited, asyncpp.AsyncppError, "did not await model.layers.1.output in the forward"),
        (wrong_shape, asyncpp.WriteError, "the replacement has shape"),
        (forgot, asyncpp.MissingAwaitError, "model.layers.1.output.grad is a location"),
    ]
    for block, err, msg in cases:
        with pytest.raises(err, match=msg):
            with asyncpp.trace(engine, grad=True) as t:
                t.invoke(PROMPTS[0], block)
                t.invoke(PROMPTS[1], block)


def test_backward_needs_a_trace_with_gradients(engine):
    async def block(m):
        await m.model.layers[1].output
        async with asyncpp.backward((await m.logits).sum()):
            pass

    with pytest.raises(asyncpp.AsyncppError, match=r"grad=True"):
        with asyncpp.trace(engine) as t:
            t.invoke(PROMPTS[0], block)


def test_gradient_trace_on_a_bare_module_whole_batch(mlp):
    x = torch.randn(3, 8)

    async def block(m):
        h = await m[1].output
        out = await m.output
        async with asyncpp.backward(out.sum()):
            g = await m[1].output.grad
        return h, g

    with asyncpp.trace(mlp, grad=True) as t:
        h = t.invoke(x, block)
    hidden = mlp[:2](x)
    hidden.retain_grad()
    mlp[2:](hidden).sum().backward()
    torch.testing.assert_close(h.result[1], hidden.grad)
    mlp.zero_grad()


def test_part_of_a_gradient_read_and_replaced_through_keys(tiny, engine):
    """loc[:, -1].grad is that part of the gradient; setting it leaves the rest as it was."""

    async def block(m):
        await m.model.layers[1].output
        await m.model.layers[2].output
        loss = (await m.logits)[:, -1, TOKEN].sum()
        async with asyncpp.backward(loss):
            whole = (await m.model.layers[2].output.grad).clone()
            last = await m.model.layers[2].output[:, -1].grad
            await m.model.layers[2].output[:, -1].grad.set(torch.zeros_like(last))
            g1 = await m.model.layers[1].output.grad
        return whole, last, g1

    with asyncpp.trace(engine, grad=True) as t:
        a = t.invoke(PROMPTS[0], block)
        t.invoke(PROMPTS[1], block)
    whole, last, g1 = a.result
    torch.testing.assert_close(last, whole[:, -1])
    assert last.abs().max() > 0
    # reference: the same gradient with the last position's part zeroed at layer 2
    model, tok = tiny
    outs = {}

    def keep(i):
        def hook(mod, args, out):
            if i == 2:

                def zero_last(g):
                    g = g.clone()
                    g[:, -1] = 0
                    return g

                out.register_hook(zero_last)
            outs[i] = out

        return hook

    handles = [model.model.layers[i].register_forward_hook(keep(i)) for i in (1, 2)]
    try:
        with torch.enable_grad():
            logits = model(ids(tok, PROMPTS[0])).logits
            (ref,) = torch.autograd.grad(logits[0, -1, TOKEN], outs[1])
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(g1, ref, rtol=1e-5, atol=1e-6)

"""Beam search and several sequences per prompt on the local engine: an invoke's rows are its beams
(or its sequences), its blocks see and edit only those, and its handle holds all of its sequences."""

from __future__ import annotations

import torch

import asyncpp

A = "The quick brown fox"
B = "Hello"


def ids(tok, text):
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def plain(model, tok, text, **kw):
    x = ids(tok, text)
    with torch.no_grad():
        out = model.generate(x, do_sample=False, pad_token_id=256, **kw)
    return out[:, x.shape[1] :]


async def rows_seen(m):
    return [(await m.logits).shape[0] async for _ in m.steps()]


async def steer(m, vec):
    async for _ in m.steps():
        out = await m.model.layers[1].output
        out[:, -1] += vec


def test_beam_search_rows_are_the_invokes_beams(tiny, engine):
    model, tok = tiny
    kw = {"num_beams": 3, "max_new_tokens": 5}
    with asyncpp.generate(engine, **kw) as t:
        a = t.invoke(A, rows_seen)
        b = t.invoke(B, rows_seen)
    assert a.result == [3] * len(a.result) and b.result == [3] * len(b.result)
    assert a.tokens.tolist() == plain(model, tok, A, **kw).tolist()
    assert b.tokens.tolist() == plain(model, tok, B, **kw).tolist()


def test_steering_one_invokes_beams_leaves_the_other_alone(tiny, engine):
    model, tok = tiny
    torch.manual_seed(3)
    vec = torch.randn(128) * 8
    kw = {"num_beams": 3, "max_new_tokens": 5}

    async def idle(m):
        async for _ in m.steps():
            await m.model.layers[1].output

    with asyncpp.generate(engine, **kw) as t:
        steered = t.invoke(A, steer, vec)
        other = t.invoke(B, idle)
    assert other.tokens.tolist() == plain(model, tok, B, **kw).tolist()
    assert steered.tokens.tolist() != plain(model, tok, A, **kw).tolist()  # the steering took effect
    with asyncpp.generate(engine, **kw) as t:
        alone = t.invoke(A, steer, vec)
    assert steered.tokens.tolist() == alone.tokens.tolist()


def test_several_sequences_per_prompt_go_to_their_own_invoke(tiny, engine):
    model, tok = tiny
    kw = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 4}
    with asyncpp.generate(engine, **kw) as t:
        a = t.invoke(A, rows_seen)
        b = t.invoke(B, rows_seen)
    assert a.tokens.shape[0] == 2 and b.tokens.shape[0] == 2
    assert a.tokens.tolist() == plain(model, tok, A, **kw).tolist()
    assert b.tokens.tolist() == plain(model, tok, B, **kw).tolist()
    assert t.output.shape[0] == 4


def test_sampled_sequences_per_prompt_are_the_invokes_rows(engine):
    kw = {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": 3, "top_k": 0}

    async def last_rows(m):
        return (await m.logits).shape[0]

    with asyncpp.generate(engine, **kw) as t:
        a = t.invoke(A, last_rows)
        b = t.invoke([[1, 2], [3, 4]], last_rows)  # two prompts: six sequences
    assert a.result == 3 and b.result == 6
    assert a.tokens.shape == (3, 3) and b.tokens.shape == (6, 3)
    torch.testing.assert_close(torch.cat([a.tokens, b.tokens]), t.output[:, -3:])


async def layer_values_per_step(m):
    out = []
    async for step in m.steps():
        h = await m.model.layers[1].output
        out.append((step, h.shape[0], float(h[:, -1].sum())))
    return out


def test_step_loops_park_natively_with_the_same_values(tiny, engine, monkeypatch):
    """A step loop over every step that reads a layer: the native controllers resume it at each
    step and park its next iteration themselves (the kernel's gate handler runs only for each
    loop's first iteration); the Python twin runs it every step. Same values either way (CI runs
    this module with both)."""
    from asyncpp.kernel import interleaver
    from asyncpp.kernel.traps import STEP
    from asyncpp.native.controllers import python_controllers

    model, tok = tiny
    calls = []
    handler = interleaver._HANDLERS[STEP]

    def counting(kernel, block, gate):
        calls.append(gate.after)
        return handler(kernel, block, gate)

    monkeypatch.setitem(interleaver._HANDLERS, STEP, counting)
    with asyncpp.generate(engine, max_new_tokens=6) as t:
        a = t.invoke(A, layer_values_per_step)
        b = t.invoke(B, layer_values_per_step)
    with asyncpp.generate(engine, max_new_tokens=6) as t:
        alone = t.invoke(A, layer_values_per_step)
    for h in (a, b, alone):
        assert [s for s, _, _ in h.result] == list(range(6))
        assert all(rows == 1 for _, rows, _ in h.result)
    assert [round(v, 4) for _, _, v in a.result] == [round(v, 4) for _, _, v in alone.result]
    assert a.tokens.tolist() == plain(model, tok, A, max_new_tokens=6).tolist()
    if python_controllers():
        assert len(calls) >= 3 * 6  # every iteration, and the loops' ends
    else:
        assert sorted(calls) == [0, 0, 0]  # each loop's first iteration only


async def step_selections(m):
    """Each kind of selection, a loop broken off and taken up again, and loops after the end."""
    seen = {}
    seen["range"] = [s async for s in m.steps(range(1, 6, 2))]  # ends after 5: no wait for 6
    seen["list"] = [s async for s in m.steps([6, 7])]
    every = m.steps()
    async for s in every:
        if s == 9:
            break
    seen["broken"] = s
    seen["resumed"] = [s async for s in every]  # on from the step after the last it gave
    seen["again"] = [s async for s in every]  # that loop has ended
    seen["fresh"] = [s async for s in m.steps()]  # so has generation
    async for s in m.steps():
        seen["late"] = s  # never runs
    seen["int"] = [s async for s in m.steps(3)]  # long passed
    return seen


def test_step_selections_and_the_ends_of_step_loops(engine):
    """``m.steps()`` with a range, a list and an int yields the selected steps; a loop broken off
    and iterated again goes on after the last step it gave; once generation has ended every loop ends at
    once and the code after it runs."""
    with asyncpp.generate(engine, max_new_tokens=12) as t:
        h = t.invoke(A, step_selections)
    assert h.result == {
        "range": [1, 3, 5],
        "list": [6, 7],
        "broken": 9,
        "resumed": [10, 11],
        "again": [],
        "fresh": [],
        "int": [],
    }

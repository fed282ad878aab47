"""The local engine on the embedded tiny Llama, checked against plain Hugging Face runs."""

from __future__ import annotations

import pytest
import torch
from helpers import steer_hook

import asyncpp

PROMPTS = ["Hello", "The quick brown fox", "ab"]


def ids(tok, text):
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def test_hidden_states_and_logits_match_hf(tiny, engine):
    model, tok = tiny
    x = ids(tok, "The quick brown fox")
    with torch.no_grad():
        ref = model(x, output_hidden_states=True)

    async def block(m):
        hs = [await layer.output for layer in m.model.layers]
        normed = await m.model.norm.output
        return hs, normed, await m.logits

    with asyncpp.trace(engine) as t:
        h = t.invoke("The quick brown fox", block)
    hs, normed, logits = h.result
    n = len(hs)
    for i in range(n - 1):
        torch.testing.assert_close(hs[i], ref.hidden_states[i + 1], rtol=0, atol=1e-6)
    torch.testing.assert_close(normed, ref.hidden_states[n], rtol=0, atol=1e-6)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(h.output.logits, ref.logits, rtol=0, atol=1e-6)


def test_batched_prompts_of_different_lengths_equal_alone(engine):
    async def last_hidden(m):
        return (await m.model.layers[2].output)[:, -1], (await m.logits)[:, -1]

    alone = []
    for p in PROMPTS:
        with asyncpp.trace(engine) as t:
            alone.append(t.invoke(p, last_hidden))
    with asyncpp.trace(engine) as t:
        together = [t.invoke(p, last_hidden) for p in PROMPTS]
    for a, b in zip(alone, together):
        torch.testing.assert_close(a.result[0], b.result[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.result[1], b.result[1], rtol=1e-5, atol=1e-5)


def test_steering_matches_a_plain_hook(tiny, engine):
    model, tok = tiny
    vec = torch.randn(128)
    x = ids(tok, "Hello")

    async def steer(m, vec):
        out = await m.model.layers[1].output
        out[:, -1] += vec
        return await m.logits

    with asyncpp.trace(engine) as t:
        h = t.invoke("Hello", steer, vec)
    handle = model.model.layers[1].register_forward_hook(steer_hook(vec))
    try:
        with torch.no_grad():
            ref = model(x).logits
    finally:
        handle.remove()
    torch.testing.assert_close(h.result, ref, rtol=0, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(model(x).logits, ref, atol=1e-3)


def test_zero_mlp_matches_plain_hook(tiny, engine):
    model, tok = tiny
    x = ids(tok, "Hello")

    async def ablate(m):
        await m.model.layers[2].mlp.output.set(torch.zeros(1, x.shape[1], 128))
        return await m.logits

    with asyncpp.trace(engine) as t:
        h = t.invoke("Hello", ablate)
    handle = model.model.layers[2].mlp.register_forward_hook(lambda mod, a, o: torch.zeros_like(o))
    try:
        with torch.no_grad():
            ref = model(x).logits
    finally:
        handle.remove()
    torch.testing.assert_close(h.result, ref, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# generation


def test_generation_steering_every_step_matches_hook(tiny, engine):
    model, tok = tiny
    torch.manual_seed(1)
    vec = torch.randn(128) * 4
    x = ids(tok, "Hello")

    async def steer_all(m, vec):
        steps = []
        async for step in m.steps():
            out = await m.model.layers[1].output
            out[:, -1] += vec
            steps.append(step)
        return steps

    with asyncpp.generate(engine, max_new_tokens=6) as t:
        h = t.invoke("Hello", steer_all, vec)
    assert h.result == [0, 1, 2, 3, 4, 5]
    handle = model.model.layers[1].register_forward_hook(steer_hook(vec))
    try:
        with torch.no_grad():
            ref = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=256)
    finally:
        handle.remove()
    assert h.tokens.tolist() == ref[:, x.shape[1] :].tolist()
    with torch.no_grad():
        plain = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=256)
    assert plain.tolist() != ref.tolist()  # the steering changed the tokens


def test_step_selection_and_code_after_loop(engine):
    async def pick(m, select):
        seen, argmaxes = [], []
        async for step in m.steps(select):
            seen.append(step)
            argmaxes.append(int((await m.logits)[0, -1].argmax()))
        after = "after the loop"
        return seen, argmaxes, after

    async def all_tokens(m):
        return [int((await m.logits)[0, -1].argmax()) async for _ in m.steps()]

    with asyncpp.generate(engine, max_new_tokens=6) as t:
        r = t.invoke("Hello", pick, range(1, 6, 2))
        lst = t.invoke("Hello", pick, [0, 4, 99])
        full = t.invoke("Hello", all_tokens)
    assert r.result[0] == [1, 3, 5] and r.result[2] == "after the loop"
    assert lst.result[0] == [0, 4]  # step 99 never comes: the loop ends with generation
    assert r.result[1] == [full.result[i] for i in (1, 3, 5)]
    assert lst.result[1] == [full.result[i] for i in (0, 4)]
    assert full.result == r.tokens[0].tolist()


def test_loop_ends_when_generation_stops_early(tiny, engine):
    model, tok = tiny
    x = ids(tok, "Hello")
    with torch.no_grad():
        plain = model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=256)
    new = plain[0, x.shape[1] :].tolist()
    # the first token that was not generated before it: making it the end token stops there
    k = next(i for i in range(1, len(new)) if new[i] not in new[:i])
    stop_token = new[k]

    async def count(m):
        n = 0
        async for _ in m.steps():
            n += 1
        return n, "done"

    with asyncpp.generate(engine, max_new_tokens=8, eos_token_id=stop_token) as t:
        h = t.invoke("Hello", count)
    assert h.result == (k + 1, "done")
    assert h.tokens[0].tolist() == new[: k + 1]


def test_idle_loop_body_does_not_spin(engine):
    async def idle(m):
        n = 0
        async for _ in m.steps():
            n += 1
        return n

    with asyncpp.generate(engine, max_new_tokens=5) as t:
        h = t.invoke("Hi", idle)
    assert h.result == 5


def test_wait_that_misses_its_step_fails_at_next_step(engine):
    async def block(m):
        async for step in m.steps():
            if step == 1:
                await m.model.layers[0].output.at(3)  # called once per step: never

    with pytest.raises(
        asyncpp.NeverReachedError, match=r"model.layers.0.output \(call 3\) was never reached in step 1"
    ):
        with asyncpp.generate(engine, max_new_tokens=4) as t:
            t.invoke("Hi", block)


def test_generation_batches_prompts_and_blocks_see_their_rows(engine):
    async def last_logits(m):
        return [(await m.logits)[:, -1].argmax(-1).tolist() async for _ in m.steps()]

    alone = {}
    for p in PROMPTS:
        with asyncpp.generate(engine, max_new_tokens=4) as t:
            alone[p] = t.invoke(p, last_logits)
    with asyncpp.generate(engine, max_new_tokens=4) as t:
        together = {p: t.invoke(p, last_logits) for p in PROMPTS}
    for p in PROMPTS:
        assert together[p].result == alone[p].result
        assert together[p].tokens.tolist() == alone[p].tokens.tolist()

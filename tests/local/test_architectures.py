"""The local engine on tiny random models of fourteen Hugging Face architectures: every invoke's numbers
equal its solo run whatever it is batched with, and ``m.logits`` is what the model returns."""

from __future__ import annotations

import pytest
import torch

import asyncpp
from asyncpp.models.architectures import ARCHITECTURES

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]
EOS = 258


def _layers(m):
    return m.find(m.std.layout.layers)


async def logits_and_hidden(m):
    layers = _layers(m)
    return (await layers[1].output)[..., -1, :], await m.logits


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_batched_forward_equals_each_prompt_alone(engines, arch):
    eng = engines[arch]
    alone = []
    for p in PROMPTS:
        with asyncpp.trace(eng) as t:
            alone.append(t.invoke(p, logits_and_hidden))
    with asyncpp.trace(eng) as t:
        together = [t.invoke(p, logits_and_hidden) for p in PROMPTS]
    for p, a, b in zip(PROMPTS, alone, together):
        hidden_a, logits_a = a.result
        hidden_b, logits_b = b.result
        torch.testing.assert_close(hidden_b, hidden_a, rtol=1e-5, atol=1e-5)
        # the batched row is left-padded: its last len(p) positions are the prompt's
        torch.testing.assert_close(logits_b[:, -len(p) :], logits_a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.output.logits[:, -len(p) :], logits_a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_batched_generation_equals_each_prompt_alone(engines, arch):
    eng = engines[arch]

    async def top(m):
        return [(await m.logits)[:, -1].argmax(-1).tolist() async for _ in m.steps()]

    alone = []
    for p in PROMPTS:
        with asyncpp.generate(eng, max_new_tokens=5) as t:
            alone.append(t.invoke(p, top))
    with asyncpp.generate(eng, max_new_tokens=5) as t:
        together = [t.invoke(p, top) for p in PROMPTS]
    for a, b in zip(alone, together):
        assert _until_eos(b.tokens[0].tolist()) == a.tokens[0].tolist()
        n = len(a.result)
        assert b.result[:n] == a.result


def test_gpt2_padded_row_matches_plain_hugging_face(engines):
    """The shorter prompt's logits do not move when it shares a trace with a longer one (learned
    absolute positions count from its first real token), against the model run on it alone."""
    eng = engines["gpt2"]
    model = eng.model
    short = PROMPTS[1]
    with torch.no_grad():
        ref = model(torch.tensor([short])).logits
    with asyncpp.trace(eng) as t:
        t.invoke(PROMPTS[0], logits_and_hidden)
        h = t.invoke(short, logits_and_hidden)
    torch.testing.assert_close(h.result[1][:, -len(short) :], ref, rtol=1e-5, atol=1e-5)


def test_logits_are_the_models_returned_logits_after_softcapping(engines):
    eng = engines["gemma2"]
    model = eng.model
    assert model.config.final_logit_softcapping
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        ref = model(x).logits

    async def both(m):
        raw = await m.lm_head.output
        return raw.clone(), await m.logits

    with asyncpp.trace(eng) as t:
        h = t.invoke(PROMPTS[0], both)
    raw, logits = h.result
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-6)
    cap = model.config.final_logit_softcapping
    torch.testing.assert_close(torch.tanh(raw / cap) * cap, ref, rtol=0, atol=1e-6)
    assert not torch.allclose(raw, ref, atol=1e-3)  # the raw projection is not the logits


def test_logits_edit_changes_what_generate_samples(engines):
    """An edit of m.logits is an edit of what generate picks from (after soft-capping)."""
    eng = engines["gemma2"]
    target = 100

    async def force(m):
        async for _ in m.steps():
            logits = await m.logits
            logits[:, -1, target] += 1000.0

    with asyncpp.generate(eng, max_new_tokens=3) as t:
        h = t.invoke(PROMPTS[0], force)
    assert h.tokens[0].tolist() == [target] * 3


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_batched_gradients_equal_each_prompt_alone(engines, arch):
    """In a grad=True trace, each invoke's gradient of its own loss with respect to its rows of a
    layer's output equals the gradient of the same prompt run alone."""
    eng = engines[arch]

    async def grad_of_first_layer(m):
        layers = _layers(m)
        await layers[0].output
        loss = (await m.logits)[:, -1, 42].sum()
        async with asyncpp.backward(loss):
            return await layers[0].output.grad

    with asyncpp.trace(eng, grad=True) as t:
        together = [t.invoke(p, grad_of_first_layer) for p in PROMPTS]
    for p, b in zip(PROMPTS, together):
        with asyncpp.trace(eng, grad=True) as t:
            a = t.invoke(p, grad_of_first_layer)
        assert a.result.abs().max() > 0
        torch.testing.assert_close(b.result[:, -len(p) :], a.result, rtol=1e-4, atol=1e-6)
    eng.model.zero_grad(set_to_none=True)

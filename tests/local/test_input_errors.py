"""Bad input is refused with a clear error before the model runs (and before any block starts)."""

from __future__ import annotations

import anyio
import pytest
import torch

import asyncpp
from asyncpp.models.architectures import build_tiny


@pytest.fixture(scope="module")
def gpt2():
    eng = asyncpp.LocalEngine(build_tiny("gpt2"))  # 128 learned positions, 259 ids
    yield eng
    eng.close()


def _run(eng, prompt, generate=False):
    started = []

    async def block(m):
        started.append(True)
        return await m.logits

    trace = asyncpp.generate(eng, max_new_tokens=10) if generate else asyncpp.trace(eng)
    with pytest.raises(asyncpp.InputError) as info:
        with trace as t:
            t.invoke([1, 2, 3], block)
            t.invoke(prompt, block)
    assert started == []  # refused before any block started
    return str(info.value)


def test_empty_token_list(engine):
    msg = _run(engine, [])
    assert "invoke #1 (" in msg and "empty" in msg


def test_token_id_outside_the_vocabulary(engine):
    msg = _run(engine, [5, 259, 6])
    assert "invoke #1" in msg and "259" in msg and "vocabulary of 259" in msg
    assert "-1" in _run(engine, torch.tensor([[4, -1]]))


def test_prompt_longer_than_the_models_positions(gpt2, engine):
    msg = _run(gpt2, [7] * 129)
    assert "invoke #1" in msg and "129 tokens" in msg and "128 positions" in msg
    assert "513 tokens" in _run(engine, [7] * 513)


def test_generation_must_fit_the_models_positions(gpt2):
    msg = _run(gpt2, [7] * 120, generate=True)
    assert "120 tokens and 10 are to be generated" in msg and "128 positions" in msg


def test_prompt_that_fits_exactly_runs(gpt2):
    async def block(m):
        return (await m.logits).shape

    with asyncpp.trace(gpt2) as t:
        h = t.invoke([7] * 128, block)
    assert h.result == torch.Size([1, 128, 259])


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_async_trace_inside_a_block_is_refused(engine, backend):
    inner = torch.nn.Linear(4, 4)

    async def block(m):
        async with asyncpp.trace(inner) as t:
            t.invoke(torch.zeros(1, 4), lambda_block)
        return "unreachable"

    async def lambda_block(m):
        return await m.output

    async def main():
        async with asyncpp.trace(engine) as t:
            h = t.invoke("Hi", block)
        return h

    with pytest.raises(asyncpp.AsyncppError, match="cannot be used inside an intervention block") as info:
        if backend == "uvloop":
            anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
        else:
            anyio.run(main, backend=backend)
    assert "plain `with asyncpp.trace(other_model)`" in str(info.value)


def test_sync_trace_on_another_model_inside_a_block_still_works(engine):
    inner = torch.nn.Linear(4, 4)

    async def read(m):
        return await m.output

    async def block(m):
        await m.model.layers[0].output
        with asyncpp.trace(inner) as t:
            h = t.invoke(torch.ones(1, 4), read)
        return h.result

    with asyncpp.trace(engine) as t:
        h = t.invoke("Hi", block)
    with torch.no_grad():
        torch.testing.assert_close(h.result, inner(torch.ones(1, 4)))

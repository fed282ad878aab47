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


def _tensors(value):
    """The tensors of a module's value (nested tuples, lists, dicts), cloned, in order."""
    if isinstance(value, torch.Tensor):
        return [value.clone()]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in _tensors(value[k])]
    return []


async def _module_paths(m):
    paths = []

    def walk(node):
        if node.module_type not in ("ModuleList", "ModuleDict"):  # (containers are never called)
            paths.append(node.path)
        for child in node:
            walk(child)

    walk(m)
    return [p for p in paths if p and not p.startswith(("logits_processor", "sampler"))]


async def _read(m, path, kind):
    try:
        return _tensors(await getattr(m.find(path), kind))
    except asyncpp.NeverReachedError:
        return "never called"  # (a module the forward does not call: the same at every size)


async def _logits(m):
    return (await m.logits).clone()


async def _edit(m, path, kind, item):
    """Halve and shift one tensor of a module's value in place (an argument, or an element of the
    output; shifted too, as a norm does not see a scale)."""
    value = await getattr(m.find(path), kind)
    (value[0][item] if kind == "inputs" else value[item] if item is not None else value).mul_(0.5).add_(0.25)
    return (await m.logits).clone()


# where each family's values are each rank's heads or columns (the attention layer's query, key and
# value, the rotary embedding's (Llama: one module, which every layer calls), the activation's
# input), or each rank's part of a sum
EDITS = {
    "llama": [
        ("model.layers.1.self_attn.attn", "inputs", 0),
        ("model.layers.1.self_attn.attn", "inputs", 2),
        ("model.layers.0.self_attn.rotary_emb", "inputs", 2),
        ("model.layers.0.self_attn.rotary_emb", "output", 0),
        ("model.layers.1.mlp.act_fn", "input", None),
    ],
    "gpt_neox": [
        ("model.layers.1.attention.attn", "inputs", 1),
        ("model.layers.0.mlp.act", "input", None),
        ("model.layers.0.mlp.act", "output", None),
    ],
    # the norms of each query and key head, [tokens, heads, head size]
    "qwen3": [
        ("model.layers.1.self_attn.q_norm", "output", None),
        ("model.layers.0.self_attn.k_norm", "input", None),
    ],
    # each rank's part of a sum the model takes later: the shared expert (its down projection
    # leaves the reduction to the MoE block) and the routed experts' computation
    "qwen2_moe": [
        ("model.layers.1.mlp.shared_expert", "output", None),
        ("model.layers.0.mlp.shared_expert.down_proj", "output", 0),
        ("model.layers.0.mlp.experts.routed_experts.quant_method", "output", None),
    ],
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("arch", list(EDITS))
def test_every_module_value_under_tp_is_the_single_worker_value(arch):
    """Every module's arguments and output, read at TP=2, equal the same engine's at TP=1 (shape
    and value), and in-place edits of the values split across the ranks change the logits as at
    TP=1. GPT-NeoX runs on vLLM's Transformers backend (Hugging Face modules on vLLM's linears)."""
    from asyncpp.models import tiny_checkpoint

    path = tiny_checkpoint(arch)
    seen = []
    for tp in (1, 2):
        with asyncpp.VllmEngine(path, dtype="float32", mode="eager", tensor_parallel_size=tp) as engine:
            with asyncpp.trace(engine) as t:
                listed = t.invoke(TEXT, _module_paths)
            paths = listed.result
            values = {}
            for kind in ("inputs", "output"):
                with asyncpp.trace(engine) as t:
                    handles = {p: t.invoke(TEXT, _read, p, kind) for p in paths}
                values.update({(p, kind): h.result for p, h in handles.items()})
            with asyncpp.trace(engine) as t:
                base = t.invoke(TEXT, _logits)
                edits = [t.invoke(TEXT, _edit, *e) for e in EDITS[arch]]
            seen.append((values, [h.result for h in edits], base.result))
    (one, edits_one, _), (two, edits_two, _) = seen
    assert one.keys() == two.keys() and len(one) > 40
    assert sum(isinstance(v, str) for v in one.values()) < len(one) // 4
    for key, tensors in one.items():
        if isinstance(tensors, str) or isinstance(two[key], str):
            assert two[key] == tensors, key
            continue
        assert [t.shape for t in two[key]] == [t.shape for t in tensors], key
        for a, b in zip(tensors, two[key]):
            torch.testing.assert_close(b, a, rtol=0, atol=ATOL, msg=str(key))
    _, _, base = seen[1]
    for point, a, b in zip(EDITS[arch], edits_one, edits_two):
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL, msg=str(point))
        assert (b - base).abs().max() > 1e-3, point  # the edit reached the model

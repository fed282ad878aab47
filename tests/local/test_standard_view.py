"""The standard view (``m.std``) on the local engine, on every tiny Hugging Face architecture: its
points are the raw values they stand for, cut to each invoke's own tokens, and writes to them land
where the model reads."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn

import asyncpp
from asyncpp.locations.standard import StandardViewError
from asyncpp.models.architectures import ARCHITECTURES

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]  # the second is left-padded in a shared trace
POINTS = ("resid_in", "attn_out", "mlp_out", "resid_out")


def _first(x):
    return x[0] if isinstance(x, tuple) else x


async def std_and_raw(m):
    """Every standard point, and the raw value each stands for (cloned as they come)."""
    lay = m.std.layout
    std, raw = {}, {}
    layers = m.find(lay.layers)
    std["embed"] = (await m.std.embed).clone()
    raw["embed"] = None
    for i, (point, node) in enumerate(zip(m.std.layers, layers)):
        std[f"resid_in{i}"] = (await point.resid_in).clone()
        if i == 0:
            raw["resid_in0"] = (await node.input).clone()
        std[f"attn_out{i}"] = (await point.attn_out).clone()
        raw[f"attn_out{i}"] = _first(await node[lay.attn].output).clone()
        std[f"mlp_out{i}"] = (await point.mlp_out).clone()
        raw[f"mlp_out{i}"] = _first(await node[lay.mlp].output).clone()
        std[f"resid_out{i}"] = (await point.resid_out).clone()
        raw[f"resid_out{i}"] = _first(await node.output).clone()
    std["final_norm"] = (await m.std.final_norm).clone()
    raw["final_norm"] = _first(await m.find(lay.norm).output).clone()
    std["logits"] = (await m.std.logits).clone()
    raw["logits"] = (await m.logits).clone()
    return std, raw


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_points_are_the_raw_values_at_the_invokes_tokens(engines, arch):
    eng = engines[arch]
    with asyncpp.trace(eng) as t:
        handles = [t.invoke(p, std_and_raw) for p in PROMPTS]
    hidden = eng.model.config.hidden_size if arch != "gpt2" else eng.model.config.n_embd
    for h, p in zip(handles, PROMPTS):
        std, raw = h.result
        n = len(p)
        for k, v in std.items():
            width = eng.model.config.vocab_size if k == "logits" else hidden
            assert v.shape == (1, n, width), (k, v.shape)
        for k, r in raw.items():
            if r is None:
                continue
            torch.testing.assert_close(std[k], r[:, -n:], rtol=0, atol=0, msg=k)  # the last n: left-padded
        torch.testing.assert_close(std["embed"], std["resid_in0"], rtol=0, atol=0)
        for i in range(1, eng.model.config.num_hidden_layers if arch != "gpt2" else 2):
            torch.testing.assert_close(std[f"resid_in{i}"], std[f"resid_out{i - 1}"], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "mixtral", "qwen2_moe"])
def test_writes_land_where_the_model_reads(engines, arch):
    """Steering in place, a replacement with .set() and an MLP ablation change the logits exactly
    as the same edit made with a raw forward hook does; and each changes them."""
    eng = engines[arch]
    model = eng.model
    lay = eng.tree.std.layout
    hidden = model.config.hidden_size if arch != "gpt2" else model.config.n_embd
    vec = torch.linspace(-3.0, 3.0, hidden)
    p = PROMPTS[1]

    async def steer(m):
        (await m.std.layers[0].resid_out)[:, -1] += vec
        return (await m.std.logits).clone()

    async def replace(m):
        x = (await m.std.layers[0].resid_out).clone()
        x[:, -1] += vec
        await m.std.layers[0].resid_out.set(x)
        return (await m.std.logits).clone()

    async def ablate(m):
        await m.std.layers[1].mlp_out.set(torch.zeros(1, len(p), hidden))
        return (await m.std.logits).clone()

    async def plain(m):
        return (await m.std.logits).clone()

    with asyncpp.trace(eng) as t:  # batched with a longer prompt: rows and padding in play
        other = t.invoke(PROMPTS[0], plain)
        hs = [t.invoke(p, b) for b in (plain, steer, replace, ablate)]
    base, steered, replaced, ablated = (h.result for h in hs)
    torch.testing.assert_close(steered, replaced, rtol=0, atol=1e-6)

    layers = model.get_submodule(lay.layers)

    def ref(module, edit):
        def hook(mod, args, out):
            t = out[0] if isinstance(out, tuple) else out
            edit(t)

        handle = module.register_forward_hook(hook)
        try:
            with torch.no_grad():
                return model(torch.tensor([p])).logits
        finally:
            handle.remove()

    def add(t):
        t[:, -1] += vec

    torch.testing.assert_close(steered, ref(layers[0], add), rtol=0, atol=1e-5)
    torch.testing.assert_close(
        ablated, ref(layers[1].get_submodule(lay.mlp), lambda t: t.zero_()), rtol=0, atol=1e-5
    )
    for edited in (steered, ablated):
        assert (edited - base).abs().max() > 1e-3  # the edit had an effect
    with torch.no_grad():
        torch.testing.assert_close(other.result, model(torch.tensor([PROMPTS[0]])).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_unembed_is_the_logit_lens(engines, arch):
    """``std.unembed`` of the last layer's stream is the model's logits (Gemma-2's soft-capping
    included), at every position; it runs the head plainly, so the run's own logits are untouched."""

    async def lens(m):
        per_layer = [m.std.unembed(await layer.resid_out) for layer in m.std.layers]
        return per_layer, (await m.std.logits).clone()

    async def only_logits(m):
        return (await m.std.logits).clone()

    with asyncpp.trace(engines[arch]) as t:
        h = t.invoke(PROMPTS[1], lens)
        plain = t.invoke(PROMPTS[1], only_logits)
    per_layer, logits = h.result
    assert per_layer[-1].shape == logits.shape == (1, 3, 259)
    torch.testing.assert_close(per_layer[-1], logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(plain.result, logits, rtol=0, atol=1e-5)
    assert (per_layer[0] - per_layer[-1]).abs().max() > 1e-3


def test_generation_steps_have_one_position(engines):
    eng = engines["llama"]

    async def shapes(m):
        out = []
        async for _ in m.steps():
            out.append((tuple((await m.std.layers[1].resid_out).shape), tuple((await m.std.logits).shape)))
        return out

    with asyncpp.generate(eng, max_new_tokens=3) as t:
        a = t.invoke(PROMPTS[0], shapes)
        b = t.invoke(PROMPTS[1], shapes)
    assert a.result[1:] == b.result[1:] == [((1, 1, 64), (1, 1, 259))] * 2
    assert b.result[0][0] == (1, 3, 64)


def test_mistakes_name_the_point_and_the_line(engines):
    eng = engines["llama"]

    async def wrong_name(m):
        await m.std.layers[0].resid_post

    async def wrong_layer(m):
        await m.std.layers[7].resid_out

    async def wrong_order(m):
        await m.std.layers[1].resid_out
        await m.std.layers[0].attn_out

    for block, match in (
        (wrong_name, r"std.layers\[0\] has no 'resid_post'; it has resid_in, attn_out"),
        (wrong_layer, r"std.layers\[7\]: the model has 2 layers"),
        (wrong_order, r"std.layers\[0\].attn_out has already passed"),
    ):
        with pytest.raises(asyncpp.AsyncppError, match=match) as info:
            with asyncpp.trace(eng) as t:
                t.invoke(PROMPTS[0], block)
        if block is not wrong_order:
            assert "test_standard_view.py" in str(info.value)


class _NotAFamily(nn.Module):
    """A causal-LM-shaped module whose tree has none of the known layouts."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": 10})()
        self.blocks = nn.ModuleList([nn.Embedding(10, 4)])
        self.lm_head = nn.Linear(4, 10)

    def generate(self, *a, **k):  # pragma: no cover - never called
        raise NotImplementedError

    def forward(self, input_ids, attention_mask=None):
        return self.lm_head(self.blocks[0](input_ids))


def test_unsupported_architecture_fails_at_engine_creation():
    with pytest.raises(StandardViewError, match=r"_NotAFamily has no standard view.*lacks.*model.layers"):
        asyncpp.LocalEngine(_NotAFamily())
    eng = asyncpp.LocalEngine(_NotAFamily(), standard_view=False)
    try:

        async def block(m):
            return m.std

        with pytest.raises(asyncpp.PathError, match="standard_view=False"):
            with asyncpp.trace(eng) as t:
                t.invoke([1, 2, 3], block)
    finally:
        eng.close()


def test_a_plain_module_has_no_standard_view(mlp):
    async def block(m):
        return await m.std.embed

    with pytest.raises(asyncpp.PathError, match="is not a causal language model"):
        with asyncpp.trace(mlp) as t:
            t.invoke(torch.ones(2, 8), block)


def test_points_and_indexed_reads_are_served_by_the_controllers(engines, monkeypatch):
    """A standard point (a location with a view key) and an indexed raw read are served where the
    module's call returns: by the native controllers' fast path without the kernel's
    ``visit_output``, and by the kernel with the Python twin. Same values, and a key that does not
    fit fails the reading block alone, at its line, either way (CI runs this module with both)."""
    from asyncpp.kernel.interleaver import Interleaver
    from asyncpp.native.controllers import python_controllers

    eng = engines["llama"]
    layers = [eng.model.model.layers[i] for i in range(2)]
    visited = []
    visit_output = Interleaver.visit_output

    def counting(self, index, out):
        visited.append(index)
        return visit_output(self, index, out)

    monkeypatch.setattr(Interleaver, "visit_output", counting)

    async def reads(m):
        got = [(await point.resid_out).clone() for point in m.std.layers]
        got.append((await m.model.layers[1].output[0]).clone())
        return got

    async def misfit(m):
        await m.std.layers[0].resid_out[0, 99]

    with asyncpp.trace(eng) as t:
        a = t.invoke(PROMPTS[0], reads)
        b = t.invoke(PROMPTS[1], reads)
    index_of = {id(module): i for i, module in enumerate(eng.model.modules())}
    layer_visits = [i for i in visited if i in {index_of[id(layer)] for layer in layers}]
    if python_controllers():
        assert layer_visits  # the twin has no fast path: the kernel serves every hot call
    else:
        assert layer_visits == []
    with asyncpp.trace(eng) as t:
        raw = [t.invoke(p, _raw_layer_outputs) for p in PROMPTS]
    for h, r, p in zip((a, b), raw, PROMPTS):
        n = len(p)
        for got, want in zip(h.result[:2], r.result):
            torch.testing.assert_close(got, want[:, -n:], rtol=0, atol=0)
        torch.testing.assert_close(h.result[2], r.result[1][0], rtol=0, atol=0)
    with pytest.raises(IndexError, match="out of bounds") as info:
        with asyncpp.trace(eng) as t:
            t.invoke(PROMPTS[0], misfit)
            other = t.invoke(PROMPTS[1], reads)
    assert "test_standard_view.py" in "".join(traceback.format_tb(info.tb))
    for got, want in zip(other.result, b.result):  # the other invoke read on, as before
        torch.testing.assert_close(got, want, rtol=0, atol=0)


async def _raw_layer_outputs(m):
    return [_first(await layer.output).clone() for layer in m.model.layers]


def _backend_tree(*layer_children: str):
    """The module tree of a model vLLM runs through its Transformers backend: vLLM's wrapper class
    at the root, Hugging Face's base model under ``model``."""
    from asyncpp.locations.tree import tree_from_paths

    entries = [("", "TransformersForCausalLM"), ("model", "Model"), ("model.embed_tokens", "E")]
    entries += [("model.layers", "ModuleList"), ("model.layers.0", "Layer")]
    entries += [(f"model.layers.0.{c}", "M") for c in layer_children]
    entries += [("model.norm", "N"), ("lm_head", "H")]
    return tree_from_paths(entries, {})


def test_a_wrapped_model_gets_its_familys_layout_by_name():
    """Where the root's class is a wrapper's (vLLM's Transformers backend), the engine names the
    family from the checkpoint: its own layout is used (Gemma's reads the stream at the first
    layer's input, where a guess from the tree would take Llama's), and an error names it."""
    from asyncpp.locations.standard import GEMMA, LLAMA, find_layout

    tree = _backend_tree("self_attn", "mlp")
    # (no family given: the first layout the tree fits, with its alternatives chosen)
    assert find_layout(tree).embed_is_stream and find_layout(tree) == LLAMA.resolve(tree)[0]
    assert find_layout(tree, "Gemma2ForCausalLM") == GEMMA and not GEMMA.embed_is_stream
    with pytest.raises(StandardViewError, match=r"^Starcoder2ForCausalLM has no standard view"):
        find_layout(_backend_tree("attention", "feed_forward"), "Starcoder2ForCausalLM")
    with pytest.raises(StandardViewError, match=r"^PhiForCausalLM: the standard view expects"):
        find_layout(tree, "PhiForCausalLM")  # (Phi's final norm is final_layernorm)

"""The tap set of a compiled vLLM engine, planned from a module tree (no engine needed), and the
tap operator itself in a model compiled by torch.compile (inductor), as vLLM compiles its model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncpp.engines.vllm import taps
from asyncpp.kernel.errors import TapError
from asyncpp.kernel.traps import INPUT, INPUTS, OUTPUT, SKIP

PATHS = [
    "",
    "model",
    "model.embed_tokens",
    "model.layers",
    "model.layers.0",
    "model.layers.0.self_attn",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp",
    "model.layers.1",
    "model.layers.1.self_attn",
    "model.layers.1.self_attn.o_proj",
    "model.layers.1.mlp",
    "model.norm",
    "logits_processor",
    "sampler",
]
TYPES = (
    ["LlamaForCausalLM", "LlamaModel", "Embedding", "ModuleList"]
    + ["Layer", "Attention", "Linear", "MLP"] * 2
    + ["RMSNorm", "LogitsProcessor", "Sampler"]
)


def plan(*patterns: str) -> taps.TapPlan:
    return taps.TapPlan(PATHS, TYPES, ["model"], patterns)


def test_default_taps_are_the_compiled_models_children_and_each_decoder_layer():
    p = plan()
    assert p.tap_paths == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    assert p.describe() == "model.embed_tokens, model.layers.{0..1}, model.norm"
    assert p.inside == frozenset(range(1, 13))  # everything under model, not the sampler


def test_patterns_add_output_and_input_taps():
    p = plan("model.layers.*.mlp", "**.o_proj.input")
    assert "model.layers.0.mlp" in p.tap_paths and "model.layers.1.mlp" in p.tap_paths
    assert "model.layers.1.self_attn.o_proj.input" in p.tap_paths
    assert p.error() is None
    o_proj = PATHS.index("model.layers.1.self_attn.o_proj")
    assert p.refuse(o_proj, INPUT) is None
    assert isinstance(p.refuse(o_proj, OUTPUT), TapError)  # tapped at its input only


def test_a_pattern_naming_no_compiled_module_is_an_error():
    p = plan("model.layers.*.mpl")
    msg = p.error()
    assert "'model.layers.*.mpl'" in msg and "matches no module" in msg and "model.embed_tokens" in msg


def test_refusals_name_the_location_the_taps_and_the_option():
    p = plan()
    mlp = PATHS.index("model.layers.0.mlp")
    msg = str(p.refuse(mlp, OUTPUT))
    assert msg.startswith("model.layers.0.mlp.output is not a tap")
    assert "model.layers.{0..1}" in msg and "taps=['model.layers.0.mlp']" in msg and "mode='eager'" in msg
    assert "taps=['model.layers.0.mlp.input']" in str(p.refuse(mlp, INPUT))
    layer = PATHS.index("model.layers.0")
    assert p.refuse(layer, OUTPUT) is None
    for kind in (INPUTS, SKIP):
        assert "mode='eager'" in str(p.refuse(layer, kind))
    assert "m.output" in str(p.refuse(PATHS.index("model"), OUTPUT))
    for outside in ("", "logits_processor", "sampler"):
        assert p.refuse(PATHS.index(outside), INPUTS) is None  # served by controllers, as in eager


def test_pattern_matching_is_name_by_name():
    assert taps.matches("model.layers.*.mlp", "model.layers.12.mlp")
    assert not taps.matches("model.*", "model.layers.0")
    assert taps.matches("**.mlp", "model.layers.0.mlp")
    assert taps.matches("model.layers.1?", "model.layers.10")
    with pytest.raises(ValueError, match="not a module path pattern"):
        taps.check_patterns(["model..layers"])


def test_summaries_fold_numbered_names():
    assert taps.summarize(["a.0.b", "a.1.b", "a.3.b", "c"]) == "a.{0,1,3}.b, c"
    assert taps.summarize(["x.0.y.1"]) == "x.0.y.1"


# --- the operator in a compiled graph ------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, r):
        r = x + r
        return torch.relu(self.lin(r)), r


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(3)])

    def forward(self, x):
        r = torch.zeros_like(x)
        for layer in self.layers:
            x, r = layer(x, r)
        return x + r


class Recorder:
    """Stands in for the worker's interleaver: what the tap operator calls back into."""

    def __init__(self, n: int, edit: dict | None = None):
        self.table_hot_in: set = set()
        self.hot_out: set = set()
        self.counts = [0] * n
        self.seen: list = []
        self.edit = edit or {}

    def link_fields(self):
        return {
            "hot_in": self.table_hot_in,
            "hot_out": self.hot_out,
            "counts": self.counts,
            "visit_output": self.visit_output,
        }

    def visit_input(self, index, value):
        self.seen.append(("in", index, value.shape))
        return value * 0 if "zero_in" in self.edit else value

    def visit_output(self, index, out):
        self.seen.append(("out", index, tuple(t.shape for t in out)))
        if self.edit.get(index) == "in_place":
            out[0].add_(100.0)
            return out
        if self.edit.get(index) == "replace":
            return (out[0] * 0, out[1])
        return out


def tapped_stack(inputs: bool = False) -> Stack:
    torch.manual_seed(0)
    m = Stack().eval()
    for i, layer in enumerate(m.layers):
        layer.forward = taps.tapped_forward(layer.forward, i, f"layers.{i}", input=inputs)
    return m


@pytest.fixture
def bound():
    made = []

    def bind(kernel):
        taps.bind(kernel, None)
        made.append(kernel)
        return kernel

    yield bind
    taps.unbind()


def test_a_compiled_tap_nobody_waits_on_counts_the_call_and_changes_nothing(bound):
    m = tapped_stack()
    x = torch.randn(5, 8)
    with torch.inference_mode():
        ref = m(x)
        k = bound(Recorder(3))
        out = torch.compile(m, backend="inductor", dynamic=True)(x)
    torch.testing.assert_close(out, ref)
    assert k.counts == [1, 1, 1] and k.seen == []


def test_compiled_taps_serve_reads_in_place_edits_and_replacements(bound):
    m = tapped_stack()
    x = torch.randn(5, 8)
    with torch.inference_mode():
        plain = m(x)
        k = bound(Recorder(3, {0: "in_place", 1: "replace"}))
        k.hot_out.update({0, 1, 2})
        compiled = torch.compile(m, backend="inductor", dynamic=True)
        out = compiled(x)
        again = compiled(torch.randn(7, 8))  # another token count: the same graph
    assert [s[:2] for s in k.seen] == [("out", 0), ("out", 1), ("out", 2)] * 2
    assert k.seen[3][2] == ((7, 8), (7, 8))
    assert again.shape == (7, 8)
    with torch.inference_mode():  # the same edits made by plain hooks, uncompiled
        taps.unbind()
        ref_m = tapped_stack()
        ref_m.layers[0].register_forward_hook(lambda mod, a, o: (o[0] + 100.0, o[1]))
        ref_m.layers[1].register_forward_hook(lambda mod, a, o: (o[0] * 0, o[1]))
        ref = ref_m(x)
    assert not torch.allclose(out, plain)
    torch.testing.assert_close(out, ref)


def test_compiled_input_taps_serve_the_first_argument(bound):
    m = tapped_stack(inputs=True)
    x = torch.randn(4, 8)
    with torch.inference_mode():
        k = bound(Recorder(3, {"zero_in": True}))
        k.table_hot_in.add(2)
        out = torch.compile(m, backend="inductor", dynamic=True)(x)
    assert k.seen == [("in", 2, torch.Size([4, 8]))]
    assert k.counts == [1, 1, 1]
    with torch.inference_mode():
        taps.unbind()
        ref_m = tapped_stack()
        ref_m.layers[2].register_forward_pre_hook(lambda mod, a: (a[0] * 0, a[1]))
        ref = ref_m(x)
    torch.testing.assert_close(out, ref)


def test_an_output_that_cannot_be_a_tap_is_named():
    with pytest.raises(TapError, match="mod.x cannot be a tap: its output is a dict"):
        taps.flatten({"a": torch.ones(1)}, "mod.x")
    assert taps.flatten((torch.ones(1), None), "p")[1] == [1, 0]
